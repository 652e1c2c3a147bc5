"""The preparer's status file, `preparer.json`, which the supervisor and the console read.

Written atomically at every change of state and as a cycle's progress moves, so a reader always
sees a whole, recent snapshot: what the preparer is doing, for which cycle, how far it is, why
it waits, how often it failed, its pid and the time of the snapshot.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from datalines.errors import DataLineError
from datalines.files import read_json, write_json_atomic

STATUS_NAME = "preparer.json"
LOCK_NAME = "preparer.lock"
"""The flock one process writes a line's cycles and downloads under (`datalines.service.PreparerLock`)."""
RUNNING_STATES = frozenset({"starting", "preparing", "ready", "waiting", "retrying"})
"""States a preparer writes while it runs: found in the file of a preparer that no longer holds the
line's lock, they are the last word of one killed (kill -9, out of memory) or crashed."""


@dataclass
class PreparerStatus:
    """One snapshot of the preparer (the fields of preparer.json)."""

    state: str = "starting"
    """`starting`, `preparing`, `ready` (the next cycles are ready; polling), `waiting` (low disk),
    `retrying` (backoff after a failure that may pass), `finished` (the last cycle is consumed),
    `failed` (a failure that does not pass by itself: `last_error` says why, `fix` what to do; it is
    not restarted until then) or `stopped` (by a signal)."""
    cycle: int | None = None
    """The cycle being prepared (or waited for); None when idle."""
    progress: float = 0.0
    """Fraction of that cycle done, 0..1."""
    message: str = ""
    """What is being done, for people."""
    waiting_reason: str | None = None
    """Why the preparer waits (low disk, backoff after a failure); None when it does not."""
    failures: int = 0
    """Failed attempts since the preparer started."""
    consecutive_failures: int = 0
    """Failed attempts since the last success (the supervisor notifies when this keeps growing)."""
    last_error: str | None = None
    """The last failure's message."""
    fix: str | None = None
    """With state `failed`: what its operator does so that a preparer started again goes on."""
    ready: list[int] = field(default_factory=list)
    """Cycles prepared and verified now."""
    prepared: int = 0
    """Cycles this preparer process has made (or rebuilt) since it started: a run that did work, as
    the supervisor's restart backoff counts it (a new process's first status proves nothing)."""
    exited: bool = False
    """The preparer ended on its own with this status (`--once`, its cycles ready): a running state
    with it is no crash."""
    pid: int = field(default_factory=os.getpid)
    """The preparer's process id."""
    time: float = 0.0
    """Unix time of this snapshot."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def write_status(line_path: Path, status: PreparerStatus) -> None:
    status.time = time.time()
    write_json_atomic(line_path / STATUS_NAME, status.to_json())


def read_status(line_path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """A data line's preparer.json: (its status, None); (None, None) when there is none (no preparer
    has run); (None, one line naming the file and its damage) when it is no preparer's status: not
    readable JSON, or JSON that is not an object with a `state`. The preparer writes it atomically,
    so damage is no write caught halfway: a reader says it and goes on with all else it knows."""
    path = line_path / STATUS_NAME
    if not path.exists():
        return None, None
    try:
        status = read_json(path)
    except DataLineError as error:
        return None, str(error)
    if not isinstance(status, dict):
        return None, f"{path}: not a preparer status (not a JSON object)"
    if not isinstance(status.get("state"), str):
        return None, f"{path}: not a preparer status (no `state`)"
    return status, None


def preparer_running(line_path: Path) -> bool:
    """Whether a preparer holds the line's lock now (the supervisor's check), or a `data rebuild`:
    either writes the line's cycles, and the supervisor starts no preparer beside it."""
    path = line_path / LOCK_NAME
    if not path.exists():
        return False
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False


def stopped_for_good(line_path: Path) -> dict[str, Any] | None:
    """The last status of the line's preparer when it stopped for good (`failed`, with a `fix`)
    and none runs now: nothing prepares the line's next cycles until its operator acts. None else
    (a damaged preparer.json says nothing: `read_status` names the damage to whoever shows it)."""
    status, _ = read_status(line_path)
    return status if status_stopped_for_good(status, lambda: preparer_running(line_path)) else None


def status_stopped_for_good(status: dict[str, Any] | None, running: Callable[[], bool]) -> bool:
    """Whether a preparer `status` (preparer.json's) is one that stopped for good, with none
    `running` now (asked only when the status says so: it takes the line's lock for a moment)."""
    return bool(status) and status.get("state") == "failed" and bool(status.get("fix")) and not running()
