"""The README's list of commands that start without torch holds only such commands: it named `new`,
which loads torch to size the new line's checkpoints (its model on the meta device), found in a
fault walkthrough. tests/console/test_cli_startup.py holds the listed ones to it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.lines import data_template_fixture

README = Path(__file__).resolve().parents[2] / "README.md"
TORCH_FREE = re.compile(r"\n(`--help`, [^\n]*\n?[^\n]*?) and the console do not load\s+it")
"""The README's sentence naming the commands that do not load torch."""

data_template = data_template_fixture(prepare=1)


def torch_free_commands() -> list[str]:
    found = TORCH_FREE.search(README.read_text(encoding="utf-8"))
    assert found is not None, "the README's list of commands that start without torch moved"
    return re.findall(r"`([^`]+)`", found.group(1))


def test_the_readme_does_not_call_new_torch_free() -> None:
    commands = torch_free_commands()
    assert "status" in commands and "new" not in commands, commands


@pytest.mark.slow  # a fresh process that imports torch
def test_new_loads_torch(data_template: Path, tmp_path: Path) -> None:
    (tmp_path / "host.json").write_text("{}")
    environment = {**os.environ, "NSCONSOLE_HOST": str(tmp_path / "host.json"),
                   "PYTHONPATH": os.pathsep.join(sys.path)}  # fmt: skip
    completed = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "nsconsole", "new", str(tmp_path / "line"),
         "--model", "transformer-tiny", "--data", str(data_template)],
        env=environment, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in completed.stderr.splitlines()}
    assert "torch" in imported
