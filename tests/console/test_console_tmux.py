"""`nsconsole` in a real terminal: tmux runs it, send-keys drives it, capture-pane reads it.

The host has no line running (a private runtime directory), so the console says how to start
one; `?` shows the keys with their ids; `q` quits with status 0. A private tmux server (`-S`)
keeps the test away from any tmux the user runs, its socket in the test's directory.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    shutil.which("tmux") is None, reason="tmux is not installed (apt-get install -y tmux)"
)


class Tmux:
    def __init__(self, socket: Path) -> None:
        # A private server whose socket lives in the test's directory (so nothing is left in
        # /tmp/tmux-UID), with no user configuration.
        self.server = ["tmux", "-S", str(socket), "-f", "/dev/null"]

    def __call__(self, *args: str) -> str:
        return subprocess.run([*self.server, *args], capture_output=True, text=True, check=True).stdout

    def screen(self) -> str:
        return self("capture-pane", "-p", "-t", "console")

    def wait_for(self, text: str, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            screen = self.screen()
            if text in screen:
                return screen
            time.sleep(0.2)
        raise AssertionError(f"{text!r} never appeared; the screen:\n{self.screen()}")

    def wait_for_absence(self, text: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while text in self.screen():
            assert time.monotonic() < deadline, f"{text!r} stayed on the screen:\n{self.screen()}"
            time.sleep(0.2)


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
    # The size is the server's default before the session exists: a pane resized after the app
    # has started would race its first measurement.
    tmux("start-server", ";", "set-option", "-g", "default-size", "140x36", ";",
         "new-session", "-d", "-s", "console", "-x", "140", "-y", "36", command)
    try:
        tmux.wait_for("q Quit")  # the footer, once the app has the terminal's full size
        screen = tmux.wait_for("No line is running on this host")
        assert "no GPU" in screen  # this machine's GPU panel
        tmux("send-keys", "-t", "console", "?")
        help_screen = tmux.wait_for("rollback")
        assert "stop" in help_screen and "filter" in help_screen
        tmux("send-keys", "-t", "console", "Escape")
        tmux.wait_for_absence("rollback")
        tmux("send-keys", "-t", "console", "q")
        tmux.wait_for("EXITED 0")
    finally:
        subprocess.run([*tmux.server, "kill-server"], capture_output=True)
