"""Lines whose supervisor was lost: it died while the line ran (the host went down, a kill -9, the
OOM killer), so nothing trains the line until someone starts it again.

A supervisor that ends a line leaves supervisor.json in a final state (`FINAL_LINE_STATES`); one
that dies leaves it in the state it was in, naming a process that no longer runs (or, after a
reboot, a pid some younger process now has: the start since boot tells them apart). The trainer
and the data preparer die with it (PR_SET_PDEATHSIG, or the reboot), and the files hold whatever
they had saved: the trainer's next start resumes from the newest whole checkpoint as after any
crash. `nsconsole resume` starts each such line again, with the `--engine` and `--stop-at` its lost
supervisor ran it with (supervisor.json records them); the console's `R` does the same for one.

A line whose trainer finished it (its plan complete, or every cycle of its data line trained) before
its supervisor could write `finished` has nothing left to start, and a start is refused:
`record_finished` writes the end that supervisor would have written, and tells the operator.

A line lost while `stopping`, or with a stop at the next update still pending in its STOP file (asked
just before the host went down, or of the orphan trainer finishing its checkpoint), was asked to stop:
it is reported, not resumed (the stop may not have been served; `nsconsole run LINE` starts it if that
is what is wanted, and its supervisor discards that stop).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.atomic import write_text_atomic
from engine.layout import LineLayout
from engine.protocol.facts import ENGINE_CHOICES, FINAL_LINE_STATES, Engine, EventKind, LineState
from engine.supervisor.notify import NotifyResult, make_event, notify
from engine.supervisor.reads import (
    latest_update,
    pending_stop,
    read_json,
    running_supervisor_pid,
    running_trainer_pid,
)
from engine.training.line_lock import hold_line


@dataclass(frozen=True)
class LostLine:
    """A line whose supervisor died with the line running, as supervisor.json leaves it."""

    path: Path
    """The line's directory."""
    state: str
    """The state its supervisor was in (a `LineState` that is not final)."""
    supervisor_pid: object
    """The pid that supervisor had (it runs no more)."""
    engine: str
    """The step engine it launched trainers with (`auto` where an older supervisor.json names none)."""
    stop_at: int | None
    """The update its trainers were to stop at (None: none)."""
    stop_requested: str | None = None
    """When the stop at the next update pending in its STOP file was asked (None: none pending)."""
    settings_recorded: bool = True
    """Whether supervisor.json records the `--engine` and `--stop-at` (False: an nsconsole older
    than that record wrote it, and what the line ran with is not known; `unrecorded_settings`)."""

    @property
    def asked_to_stop(self) -> bool:
        """It was lost while its trainer stopped on request, or with a stop pending: not resumed by
        `nsconsole resume`."""
        return self.state == LineState.STOPPING or self.stop_requested is not None


def damaged_record(line: Path | str) -> str | None:
    """What is wrong with the line's supervisor.json, in words naming it (`LINE/supervisor.json: not
    JSON (...)`), where it is there but reads as no supervisor's record; None when it reads, or there
    is none. A supervisor writes it whole (atomically): such a file was damaged by hand or by the
    disk, and nothing in it says what the line was doing, nor whether its supervisor was lost."""
    path = LineLayout(line).supervisor_json
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as error:
        return f"{path}: cannot be read ({error.strerror or error})"
    try:
        document = json.loads(raw)
    except ValueError as error:  # a UnicodeDecodeError too
        return f"{path}: not JSON ({error})"
    return None if isinstance(document, dict) else f"{path}: not a JSON object"


def lost_line(line: Path | str) -> LostLine | None:
    """The line's lost supervisor, or None: the line never ran under one, ended (a final state), a
    supervisor or a trainer (one run without a supervisor, or an orphan finishing its checkpoint)
    still runs it, or its supervisor.json is damaged (`damaged_record` says how)."""
    layout = LineLayout(line)
    supervisor = read_json(layout.supervisor_json)
    if supervisor is None:
        return None
    state = supervisor.get("state")
    if not isinstance(state, str) or state in FINAL_LINE_STATES or running_supervisor_pid(supervisor) is not None:
        return None
    if running_trainer_pid(read_json(layout.heartbeat)) is not None:
        return None
    engine = supervisor.get("engine")
    stop_at = supervisor.get("stop_at")
    stop = pending_stop(layout)
    return LostLine(
        path=layout.root,
        state=state,
        supervisor_pid=supervisor.get("pid"),
        engine=engine if engine in ENGINE_CHOICES else Engine.AUTO.value,
        stop_at=stop_at if isinstance(stop_at, int) and not isinstance(stop_at, bool) and stop_at > 0 else None,
        stop_requested=stop.requested if stop is not None and stop.at_cycle_end is None else None,
        settings_recorded="engine" in supervisor,
    )


def unrecorded_settings(line: LostLine) -> str | None:
    """What a resume of `line` cannot know, in words, with what to do about it; None when its
    supervisor.json records it all. A supervisor of an nsconsole from before that record (lost
    after an upgrade, by a reboot) kept its --engine and --stop-at in its memory only: the line
    resumes as `nsconsole run LINE` starts it, which trains past a --stop-at it had."""
    if line.settings_recorded:
        return None
    return (f"{LineLayout(line.path).supervisor_json}, written by an older nsconsole, does not record the "
            "--engine and --stop-at its supervisor ran it with: it runs with --engine auto and no --stop-at "
            f"(`nsconsole stop {line.path}`, then `nsconsole run {line.path} --stop-at N`, for one it had)")


def record_finished(
    line: LostLine, ended: str, notify_command: str | Sequence[str] | None
) -> NotifyResult | None:
    """Record in supervisor.json the end a lost supervisor's line had reached (`ended`: what
    `engine.ops.line_end.line_end` says), as that supervisor would have: state `finished` and its
    `finished` event, notified (the result; None when the line is no longer lost).

    Else `nsconsole resume` failed on it at every boot (a finished line starts no supervisor) and
    it read as lost for good. The line is held as a supervisor holds it: `LineError` naming the
    holder when another process does."""
    layout = LineLayout(line.path)
    hold = hold_line(layout)
    try:
        if lost_line(layout.root) is None:
            return None
        record = read_json(layout.supervisor_json) or {}
        message = (f"the line has finished ({ended}); its supervisor (pid {line.supervisor_pid}) was lost "
                   "before it said so")
        event = make_event(EventKind.FINISHED, str(layout.root), message, update=latest_update(layout))
        record.update(state=LineState.FINISHED, trainer_pid=None, trainer_launched=None, last_event=event)
        write_text_atomic(layout.supervisor_json, json.dumps(record, indent=1, default=str) + "\n")
    finally:
        os.close(hold)
    return notify(notify_command, event)
