"""The light commands and the console start without torch (issue 20 item 9).

Each command runs as a user runs it, `python -m nsconsole ...` in a fresh process, under
`-X importtime`, whose report names every module the process imported; the console runs headless
in a fresh process that reports what it loaded. torch (with triton, wandb and our kernels) takes
seconds and hundreds of MB to load, and only the commands that train or measure need it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers.lines import data_template_fixture, make_line

from engine.layout import LineLayout
from engine.training.line_lock import hold_line

HEAVY = ("torch", "triton", "wandb", "kernels", "lm_eval")
"""Packages that only training, measuring and evaluating may load."""

data_template = data_template_fixture(prepare=1)


@pytest.fixture(scope="module")
def line(data_template: Path) -> Path:
    return make_line(data_template.parent / "lines", data_template)


@pytest.fixture(scope="module")
def environment(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A private runtime directory (no supervisor of this host is found) and an empty host.json."""
    root = tmp_path_factory.mktemp("host")
    (root / "run").mkdir(mode=0o700)
    (root / "host.json").write_text("{}")
    return {**os.environ, "XDG_RUNTIME_DIR": str(root / "run"), "NSCONSOLE_RUN": str(root / "run"),
            "NSCONSOLE_HISTORY": str(root / "history"), "NSCONSOLE_HOST": str(root / "host.json"),
            "PYTHONPATH": os.pathsep.join(sys.path)}  # fmt: skip


def imported_heavy(arguments: list[str], environment: dict[str, str]) -> tuple[int, list[str], str]:
    """Run `nsconsole ARGUMENTS`; its exit status, the heavy top-level packages it imported, stderr."""
    completed = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "nsconsole", *arguments],
        env=environment, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    modules = {
        line.rsplit("|", 1)[-1].strip() for line in completed.stderr.splitlines() if line.startswith("import time:")
    }
    messages = "\n".join(line for line in completed.stderr.splitlines() if not line.startswith("import time:"))
    return completed.returncode, sorted(module for module in HEAVY if module in modules), messages


def test_importtime_reports_torch_where_a_command_loads_it(line: Path, environment: dict[str, str]) -> None:
    # The detector itself: `check` sizes the line's model with torch, so torch shows in its report.
    status, heavy, messages = imported_heavy(["check", str(line)], environment)
    assert status == 0, messages
    assert "torch" in heavy


def test_help_and_the_light_commands_do_not_import_torch(
    line: Path, data_template: Path, environment: dict[str, str], tmp_path: Path
) -> None:
    # Not `new`: it sizes the new line's checkpoints with its model on the meta device (torch).
    commands = {
        "--help": (["--help"], 0),
        "eval --help": (["eval", "--help"], 0),
        "status": (["status", str(line)], 0),
        "data status": (["data", "status", "--work", str(data_template)], 0),
        "stop (not running)": (["stop", str(line)], 2),
        "rollback (no such checkpoint)": (["rollback", str(line), "--to", "99"], 2),
        "branch (no such cycle end)": (
            ["branch", str(tmp_path / "b"), "--from", str(line), "--at-cycle", "0", "--plan", "decay:1000",
             "--data", str(data_template)], 2),
    }  # fmt: skip
    for name, (arguments, expected_status) in commands.items():
        status, heavy, messages = imported_heavy(arguments, environment)
        assert status == expected_status, (name, messages)
        assert heavy == [], f"`nsconsole {name}` imported {', '.join(heavy)}"


def test_a_line_another_process_holds_is_refused_before_torch_loads(
    data_template: Path, environment: dict[str, str], tmp_path: Path
) -> None:
    """While `nsconsole run LINE --no-supervisor` trains (it holds the line), every form of `nsconsole
    run` is refused at once, naming its pid: the lock is probed before the start checks load torch
    (15 s on 2 cores), not after them."""
    line = make_line(tmp_path, data_template)
    hold = hold_line(LineLayout(line))  # as the trainer started without a supervisor holds it
    (line / "heartbeat").write_text(json.dumps({"pid": os.getpid(), "stage": "training", "update": 3}))
    holder = f"a trainer started without a supervisor is running it (pid {os.getpid()}); stop it first"
    try:
        for arguments in (["run", str(line)], ["run", str(line), "--foreground"],
                          ["run", str(line), "--no-supervisor"], ["--run", str(line)]):  # fmt: skip
            status, heavy, messages = imported_heavy(arguments, environment)
            assert status == 2, (arguments, messages)
            assert messages.count("\n") == 0 and holder in messages, (arguments, messages)
            assert heavy == [], f"`nsconsole {' '.join(arguments)}` imported {', '.join(heavy)} before refusing"
    finally:
        os.close(hold)
    assert not (line / "supervisor.json").exists()


CONSOLE = """
import asyncio, json, sys
from nsconsole.app import ConsoleApp

def run_headless(app):  # `nsconsole` as typed, the app driven headless instead of in a terminal
    async def drive():
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause(1.0)  # mounted, painted, discovery and the GPU panel read once
    asyncio.run(drive())

ConsoleApp.run = run_headless
from nsconsole.cli import main
assert main([]) == 0
print(json.dumps(sorted(name for name in sys.modules if name.split(".")[0] in {heavy})))
"""


CONSOLE_HEAVY = (*HEAVY, "numpy", "pyarrow")
"""The console also leaves out numpy and pyarrow (a tenth of a second and 60 MB before its first
paint): it reads branches.json and the rollback record through light modules, not the operations."""


def test_the_console_does_not_import_torch_or_numpy(environment: dict[str, str]) -> None:
    script = textwrap.dedent(CONSOLE).replace("{heavy}", repr(set(CONSOLE_HEAVY)))
    completed = subprocess.run(
        [sys.executable, "-c", script], env=environment, capture_output=True, text=True, timeout=120
    )
    assert completed.returncode == 0, completed.stderr
    assert json.loads(completed.stdout.splitlines()[-1]) == []
