"""The trainer's own hold on its line: one trainer per line, with or without a supervisor.

The supervisor flocks the line directory for its life (`engine/supervisor/reads.lock_line`), but
`nsconsole run LINE --no-supervisor` starts a trainer with no supervisor at all: beside a
supervised line it would append the same updates to rows.jsonl and race its checkpoints. So every
trainer flocks `<line>/trainer.lock` for its life, and a trainer started without a supervisor also
refuses a line whose supervisor is running (that supervisor would relaunch its own trainer into it).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os

from engine.errors import LineError
from engine.layout import LineLayout


def _holder(path: os.PathLike[str] | str) -> str:
    """The pid a JSON state file names, for the message (`?` when it cannot be read)."""
    with contextlib.suppress(OSError, UnicodeDecodeError, ValueError, AttributeError), open(
        path, encoding="utf-8"
    ) as handle:
        return str(json.load(handle).get("pid", "?"))
    return "?"


def hold_trainer_lock(layout: LineLayout) -> int:
    """Flock `trainer.lock` (the descriptor is the hold: close it to let go); `LineError` if taken."""
    fd = os.open(layout.trainer_lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise LineError(
            f"{layout.root}: another trainer is training this line (pid {_holder(layout.heartbeat)}); "
            "stop it first (nsconsole stop)"
        ) from None
    return fd


def refuse_if_supervised(layout: LineLayout) -> None:
    """`LineError` when a supervisor holds the line (its flock on the directory is taken)."""
    fd = os.open(layout.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise LineError(
            f"{layout.root}: its supervisor is running (pid {_holder(layout.supervisor_json)}); "
            "a trainer without a supervisor would race it: stop the line first (nsconsole stop)"
        ) from None
    finally:
        os.close(fd)  # closing the descriptor drops a lock just taken
