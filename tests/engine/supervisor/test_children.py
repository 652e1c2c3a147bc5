"""The supervisor's children start through engine's own entry points and end with the supervisor."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers import REPOSITORY

from engine.supervisor.children import preparer_command, tune_command
from engine.supervisor.detach import foreground_argv


def test_no_child_is_started_through_the_console_package(tmp_path: Path) -> None:
    for command in (preparer_command(), tune_command(tmp_path, shared=True), foreground_argv(tmp_path)):
        assert command[:2] == [sys.executable, "-m"] and command[2].startswith("engine.")
    assert tune_command(tmp_path, shared=True)[-2:] == [str(tmp_path), "--shared"]


def test_a_child_whose_supervisor_is_gone_does_not_start(tmp_path: Path) -> None:
    # Its parent is this test, not the pid it names: as if the supervisor had died before the child ran.
    command = [sys.executable, "-m", "engine.supervisor.children", "tune", "--parent", "1", str(tmp_path)]
    finished = subprocess.run(command, cwd=REPOSITORY, capture_output=True, text=True, timeout=120)
    assert finished.returncode == 143
    assert "the supervisor exited before this child started" in finished.stderr


def test_a_tune_child_refuses_a_missing_line_in_one_line(tmp_path: Path) -> None:
    script = (
        "import os, subprocess, sys\n"
        f"command = [sys.executable, '-m', 'engine.supervisor.children', 'tune', '--parent', str(os.getpid()), "
        f"{str(tmp_path / 'nowhere')!r}]\n"
        "finished = subprocess.run(command, capture_output=True, text=True)\n"
        "print(finished.returncode); print(finished.stderr.strip())\n"
    )
    output = subprocess.run([sys.executable, "-c", script], cwd=REPOSITORY, capture_output=True, text=True,
                            timeout=300).stdout.splitlines()
    assert output[0] == "2"
    assert len(output) == 2 and output[1].startswith("nsconsole: ") and "nowhere" in output[1]
