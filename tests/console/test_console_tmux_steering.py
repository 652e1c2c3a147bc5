"""Steering two real lines from `nsconsole` in a real terminal (tmux at 160x45): tune, stop,
rollback and branch, each through its keys, picker and confirmation, with the screen read after
each step and the line's files checked behind it.

Two tiny CPU lines run under their own supervisors with only data cycle 0 prepared and no
preparer, so each trainer finishes cycle 0 and waits for cycle 1: alive, cheap, and still in
cycle 1 when the branch is asked for (so the branch is queued for that cycle's end and shows in
the first line's `forks` column). The filter selects a line by name; the cursor keeps it when the
filter is cleared, and the keys act on it.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.lines import copy_data_line, make_data_line, make_line
from helpers.supervise import RUNNER, kill_line_processes
from helpers.tmux import Tmux

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install -y tmux)"),
]


def tiny_line(root: Path, name: str, data_template: Path) -> Path:
    """A transformer-tiny line `root/name/name` on its own copy of the data line."""
    made = make_line(root / name, copy_data_line(data_template, root / name))
    line = root / name / name
    made.rename(line)
    return line


def select(tmux: Tmux, name: str) -> None:
    """Select the line named `name` through the filter, then clear the filter (the cursor stays)."""
    tmux.keys("/")
    tmux.wait_for("filter lines: words")  # the box has the focus: the name's letters are not keys
    tmux.type(name)
    tmux.keys("Enter")
    tmux.wait_for(f"/{name}/{name} ─")  # the table's title names the selected line's short path
    tmux.wait_for("s Stop")  # the table has the focus again (the footer shows its keys)
    tmux.keys("Escape")
    tmux.wait_for_absence(" of 2 ─")  # the filter is cleared: every line is listed
    tmux.wait_for(f"/{name}/{name} ─")  # and the cursor kept its line


def test_tune_stop_rollback_and_branch_from_a_real_terminal(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir(mode=0o700)
    (tmp_path / "host.json").write_text("{}")
    environment = {
        **os.environ,
        "XDG_RUNTIME_DIR": str(tmp_path / "run"),
        "NSCONSOLE_HOST": str(tmp_path / "host.json"),
        "HOME": str(tmp_path),  # no line of the user's (~/.nsconsole) joins the console's list
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    data = make_data_line(tmp_path / "data_root", prepare=1)
    alpha = tiny_line(tmp_path, "alpha", data)
    beta = tiny_line(tmp_path, "beta", data)
    branch_data = copy_data_line(data, tmp_path / "branch_data")
    (tmp_path / "runner.py").write_text(RUNNER)
    settings = json.dumps({"poll_seconds": 0.1, "relaunch_delay_seconds": 0.05, "run_preparer": False})
    supervisors = [
        subprocess.Popen([sys.executable, str(tmp_path / "runner.py"), str(line), settings], env=environment)
        for line in (alpha, beta)
    ]
    console_env = {key: environment[key] for key in ("XDG_RUNTIME_DIR", "NSCONSOLE_HOST", "HOME", "PYTHONPATH")}
    assignments = " ".join(f"{key}={shlex.quote(value)}" for key, value in console_env.items())
    command = (f"env -u COLUMNS -u LINES TERM=xterm-256color {assignments} {shlex.quote(sys.executable)} "
               "-m nsconsole; echo EXITED $?; sleep 120")  # fmt: skip
    tmux = Tmux(tmp_path / "tmux.sock")
    tmux.start(command, 160, 45)
    try:
        tmux.wait_for("q Quit")
        # Both lines finish cycle 0 and wait for cycle 1.
        for name in ("alpha", "beta"):
            select(tmux, name)
            tmux.wait_for("waiting-data", timeout=180)

        # Tune `beta`: the picker, the confirmation naming its path, progress until the reply.
        select(tmux, "beta")
        tmux.keys("t")
        tmux.wait_for("Tune beta's micro-batch shape for:")
        tmux.keys("Enter")  # alone
        # The confirmation (it names the full path); the choice in a CPU line's words.
        tmux.wait_for("memory)?")
        tmux.keys("y")
        tmux.wait_for("✓ beta: tune accepted", timeout=300)
        assert "tune: done" in (beta / "run.log").read_text()

        # Stop `beta` at the next update: its row ends `■ stopped`, its supervisor exits 0.
        tmux.keys("s")
        tmux.wait_for("Stop beta: when?")
        tmux.keys("Enter")  # at the next update
        tmux.wait_for("at the next update?")
        tmux.keys("y")
        tmux.wait_for("■ stopped", timeout=120)
        assert supervisors[1].wait(timeout=60) == 0
        assert json.loads((beta / "supervisor.json").read_text())["state"] == "stopped"

        # Roll `alpha` back to its oldest checkpoint.
        select(tmux, "alpha")
        tmux.keys("r")
        tmux.wait_for("Roll alpha back to:")
        tmux.keys("Enter")  # the first (oldest) checkpoint listed
        screen = tmux.wait_for("back to update")
        target = int(screen.split("back to update ")[1].split("?")[0])
        tmux.keys("y")
        tmux.wait_for("✓ alpha: rollback accepted", timeout=180)
        assert list(alpha.glob("rows.rolledback-*.jsonl"))
        rows = [json.loads(row) for row in (alpha / "rows.jsonl").read_text().splitlines()]
        assert all(row["update"] <= target for row in rows[: target]) and len(rows) >= target

        # Branch `alpha` at the end of cycle 1 (never prepared here, so never ended): queued, shown
        # in its forks column. The form suggests the current cycle (0 again after the rollback), and
        # the new line's directory follows the cycle typed: `alpha-c1`.
        tmux.keys("b")
        tmux.wait_for("at the end of cycle")
        tmux.keys("Tab")  # from the new line's directory (focused first) to the cycle, its text selected
        tmux.type("1")
        tmux.keys("Tab")
        tmux.type("decay:2e4")  # within the branch data line's 21,300 tokens
        tmux.keys("Tab")
        tmux.type(str(branch_data))
        tmux.keys("Enter")
        tmux.wait_for("at the end of cycle 1?")
        tmux.keys("y")
        tmux.wait_for("✓ alpha: branch accepted", timeout=120)
        tmux.wait_for("⑂ alpha-c1@1")
        assert not (alpha.parent / "alpha-c1").exists()  # it waits for the end of cycle 1

        tmux.keys("q")
        tmux.wait_for("EXITED 0")
    finally:
        tmux.kill()
        for process in supervisors:
            if process.poll() is None:
                process.kill()
                process.wait()
        kill_line_processes(tmp_path)
