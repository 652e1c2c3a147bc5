"""A private tmux server for real-terminal tests: send-keys drives a program, capture-pane reads it."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path


class Tmux:
    """One tmux server whose socket lives in the test's directory, with no user configuration."""

    def __init__(self, socket: Path, session: str = "console") -> None:
        # A private server (nothing left in /tmp/tmux-UID, nothing shared with a user's tmux).
        self.server = ["tmux", "-S", str(socket), "-f", "/dev/null"]
        self.session = session

    def __call__(self, *args: str) -> str:
        return subprocess.run([*self.server, *args], capture_output=True, text=True, check=True).stdout

    def start(self, command: str, width: int, height: int) -> None:
        """Run `command` in a new session of `width` x `height` (the size is set before the session
        exists: a pane resized after the program started would race its first measurement)."""
        self("start-server", ";", "set-option", "-g", "default-size", f"{width}x{height}", ";",
             "new-session", "-d", "-s", self.session, "-x", str(width), "-y", str(height), command)  # fmt: skip

    KEY_GAP_S = 0.3
    """A pause after each send, at a person's pace: keys sent in one burst can reach a Textual app
    before the focus change the previous key made (seen: a Tab and digits typed after a
    backspace landed in the wrong field)."""

    def keys(self, *keys: str) -> None:
        for key in keys:
            self("send-keys", "-t", self.session, key)
            time.sleep(self.KEY_GAP_S)

    def type(self, text: str) -> None:
        """Type `text` literally (no key names)."""
        self("send-keys", "-t", self.session, "-l", text)
        time.sleep(self.KEY_GAP_S)

    def screen(self) -> str:
        return self("capture-pane", "-p", "-t", self.session)

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

    def kill(self) -> None:
        subprocess.run([*self.server, "kill-server"], capture_output=True)
