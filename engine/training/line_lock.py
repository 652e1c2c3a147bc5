"""The holds on a line: one supervisor or supervisor-less trainer, and one trainer, per line.

Two flocks, each held for the holder's life:
- the line directory (`hold_line`): by its supervisor, or by `nsconsole run LINE --no-supervisor`,
  which starts a trainer with no supervisor at all. Either excludes the other: a supervisor beside
  a supervisor-less trainer would launch a second trainer into the line (or, taking it for an
  orphan of a dead supervisor, stop it), and a supervisor-less trainer beside a supervised line
  would append the same updates to rows.jsonl and race its checkpoints.
- `<line>/trainer.lock` (`hold_trainer_lock`): by every trainer. An orphan whose supervisor died
  (it checkpoints and goes) still holds it while the next supervisor starts and waits for it.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager

from engine.errors import LineError
from engine.layout import LineLayout
from engine.supervisor.reads import read_json, running_supervisor_pid, running_trainer_pid


def hold_trainer_lock(layout: LineLayout) -> int:
    """Flock `trainer.lock` (the descriptor is the hold: close it to let go); `LineError` if taken."""
    fd = os.open(layout.trainer_lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise LineError(
            f"{layout.root}: another trainer is training this line (pid {running_trainer_pid(read_json(layout.heartbeat)) or '?'}); "
            "stop it first (nsconsole stop)"
        ) from None
    return fd


def hold_line(layout: LineLayout) -> int:
    """Flock the line directory (the descriptor is the hold); `LineError` naming the holder if taken."""
    fd = os.open(layout.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise LineError(f"{layout.root}: {line_holder(layout)}") from None
    return fd


@contextmanager
def held_at_rest(layout: LineLayout, through_supervisor: str) -> Iterator[None]:
    """The line held for a command that changes it at rest (`nsconsole rollback`, `tune`): no
    supervisor or trainer starts on it meanwhile, not even one between two launches of a running
    supervisor. Refused in one line while another process holds it; where that is a running
    supervisor, the line adds `through_supervisor` (how that supervisor makes the change:
    "roll it back from the console (r)"). A trainer run without a supervisor is stopped first."""
    try:
        hold = hold_line(layout)
    except LineError as error:
        if running_supervisor_pid(read_json(layout.supervisor_json) or {}) is None:
            raise
        raise LineError(f"{error}; {through_supervisor}, or stop the line first") from None
    try:
        yield
    finally:
        os.close(hold)


def refuse_a_held_line(layout: LineLayout) -> None:
    """`LineError` naming the holder while another process holds the line; nothing is held after.

    A start asks this first, before its slow work (start checks that load torch): asked after it,
    the refusal came seconds late. What a start reads from the line's files before it holds the line
    (has it finished?) is read again by the supervisor once it holds it."""
    os.close(hold_line(layout))


def line_holder(layout: LineLayout) -> str:
    """Who holds the line's directory, as its files tell (the flock itself names nobody)."""
    supervisor = running_supervisor_pid(read_json(layout.supervisor_json) or {})
    if supervisor is not None:
        return f"a supervisor already runs this line (pid {supervisor})"
    trainer = running_trainer_pid(read_json(layout.heartbeat))
    if trainer is not None:
        return (f"a trainer started without a supervisor is running it (pid {trainer}); stop it first "
                f"(nsconsole stop {layout.root})")
    return "a supervisor or a trainer is starting on it; try again once it runs, or stop it (nsconsole stop)"
