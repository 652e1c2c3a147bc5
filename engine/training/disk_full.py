"""A disk that fills between checkpoints: the trainer's last line and its exit status.

Any write of the trainer may find the disk full (a rows.jsonl append, the heartbeat, run.log, a
checkpoint). Whatever it was, nothing saved is lost: `latest` names a complete checkpoint, and a
rows.jsonl append cut off mid-row is cut back to that checkpoint's rows at the next start (the
updates after it are trained again, the same ones). The trainer says so in one line, if even that
fits, and exits with `TrainerExitCode.DISK_FULL`: the supervisor records `disk-full` and does not
relaunch until the operator has freed space.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from engine.checkpoints.format import read_latest
from engine.layout import LineLayout
from engine.protocol.facts import TrainerExitCode


def report_disk_full(line: Path | str, error: OSError) -> int:
    """Say it in one line on stderr (run.log; lost if not even that fits) and return the exit status."""
    latest = read_latest(LineLayout(Path(line)).checkpoints)
    where = f" writing {error.filename}" if error.filename else ""
    say(
        f"nsconsole: {line}: the disk filled{where} ({os.strerror(error.errno)}); nothing saved is lost: "
        f"the newest checkpoint is {latest or 'none yet'} and rows.jsonl is cut back to it at the next start; "
        "free some space and run the line again"
    )
    return TrainerExitCode.DISK_FULL


def say(message: str) -> None:
    """One line on stderr, unbuffered: on a full disk it is lost, and does not stay in a buffer
    whose flush at exit would fail again (and turn the exit status into 120)."""
    with contextlib.suppress(OSError):
        sys.stderr.flush()
    with contextlib.suppress(OSError):
        os.write(sys.stderr.fileno(), f"{message}\n".encode("utf-8", errors="replace"))
