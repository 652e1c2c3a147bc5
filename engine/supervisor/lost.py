"""Lines whose supervisor was lost: it died while the line ran (the host went down, a kill -9, the
OOM killer), so nothing trains the line until someone starts it again.

A supervisor that ends a line leaves supervisor.json in a final state (`FINAL_LINE_STATES`); one
that dies leaves it in the state it was in, naming a process that no longer runs (or, after a
reboot, a pid some younger process now has: the start since boot tells them apart). The trainer
and the data preparer die with it (PR_SET_PDEATHSIG, or the reboot), and the files hold whatever
they had saved: the trainer's next start resumes from the newest whole checkpoint as after any
crash. `nsconsole resume` starts each such line again, with the `--engine` and `--stop-at` its lost
supervisor ran it with (supervisor.json records them); the console's `R` does the same for one.

A line lost while `stopping` was asked to stop: it is reported, not resumed (the stop may not have
been served; `nsconsole run LINE` starts it if that is what is wanted).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.layout import LineLayout
from engine.protocol.facts import ENGINE_CHOICES, FINAL_LINE_STATES, Engine, LineState
from engine.supervisor.reads import read_json, running_supervisor_pid, running_trainer_pid


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

    @property
    def asked_to_stop(self) -> bool:
        """It was lost while its trainer stopped on request: not resumed by `nsconsole resume`."""
        return self.state == LineState.STOPPING


def lost_line(line: Path | str) -> LostLine | None:
    """The line's lost supervisor, or None: the line never ran under one, ended (a final state), or
    a supervisor or a trainer (one run without a supervisor, or an orphan finishing its checkpoint)
    still runs it."""
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
    return LostLine(
        path=layout.root,
        state=state,
        supervisor_pid=supervisor.get("pid"),
        engine=engine if engine in ENGINE_CHOICES else Engine.AUTO.value,
        stop_at=stop_at if isinstance(stop_at, int) and not isinstance(stop_at, bool) and stop_at > 0 else None,
    )
