"""`nsconsole` in a real terminal: tmux runs it, send-keys drives it, capture-pane reads it.

The host has no line running (a private runtime directory), so the console says how to start
one; `?` shows the keys with their ids; `q` quits with status 0. A private tmux server (`-S`)
keeps the test away from any tmux the user runs, its socket in the test's directory.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

import pytest
from helpers.tmux import Tmux

pytestmark = pytest.mark.skipif(
    shutil.which("tmux") is None, reason="tmux is not installed (apt-get install -y tmux)"
)


def test_the_console_in_a_real_terminal(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir(mode=0o700)
    (tmp_path / "host.json").write_text("{}")
    environment = {
        "XDG_RUNTIME_DIR": str(tmp_path / "run"),
        "NSCONSOLE_HOST": str(tmp_path / "host.json"),
        "TERM": "xterm-256color",
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    assignments = " ".join(f"{key}={shlex.quote(value)}" for key, value in environment.items())
    command = f"env -u COLUMNS -u LINES {assignments} {shlex.quote(sys.executable)} -m nsconsole --theme light; echo EXITED $?; sleep 60"
    tmux = Tmux(tmp_path / "tmux.sock")
    tmux.start(command, 140, 36)
    try:
        tmux.wait_for("q Quit")  # the footer, once the app has the terminal's full size
        screen = tmux.wait_for("No line is running on this host")
        assert "no GPU" in screen  # this machine's GPU panel
        tmux.keys("?")
        help_screen = tmux.wait_for("rollback")
        assert "stop" in help_screen and "filter" in help_screen
        tmux.keys("Escape")
        tmux.wait_for_absence("rollback")
        tmux.keys("q")
        tmux.wait_for("EXITED 0")
    finally:
        tmux.kill()
