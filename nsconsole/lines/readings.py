"""What the widgets read off a line: its state as shown, its update, loss and rate, its GPUs,
its trainer's processes, its forks, whether it may be mutated or resumed.

A mixin of `nsconsole.lines.view.LineView`, sharing its state: it only reads what the line was told
(the supervisor's `status`, the `heartbeat`, the rows, run.json's `facts`, the link's flags).
"""

from __future__ import annotations

import math
from typing import Any

from engine.protocol import facts
from engine.protocol.facts import Stage
from nsconsole.lines.forks import ForkView, fork_views
from nsconsole.lines.rows import validation_loss
from nsconsole.widgets.format import PAUSING_FOR, SUPERVISOR_LOST, UNKNOWN_STATE, UNREACHABLE

DAMAGED_RECORD = "damaged_record"
"""The key of a line's status read at rest whose supervisor.json is damaged: what is wrong with the
file, naming it (`nsconsole.history.supervisor_record`); no supervisor's status has it."""

SHOWN_STAGES = frozenset(
    {Stage.CHECKPOINTING, Stage.WAITING_DATA, Stage.VALIDATING, Stage.CAPTURING, Stage.COMPILING, Stage.PROBING,
     Stage.DREAMING}
)
"""Trainer stages shown in place of the supervisor's `training`: they say more."""


class LineReadings:
    """What the table shows (mixed into `LineView`, whose status, heartbeat, rows and facts it reads)."""

    @property
    def kind(self) -> str:
        # The supervisor's status names the line a branch was forked from (`parent`).
        return "branch" if self.status.get("parent") else "trunk"

    @property
    def parent(self) -> str | None:
        """The path of the line this branch was forked from (None: a trunk)."""
        parent = self.status.get("parent")
        return parent if isinstance(parent, str) and parent else None

    @property
    def supervisor_state(self) -> str | None:
        return self.status.get("state")

    @property
    def display_state(self) -> str:
        """The supervisor's state, or what says more: the trainer's stage (checkpointing...), a stop
        asked for (`stopping`), what a pause is for (`pausing → tuning`), nothing left running."""
        if not (self.ever_connected or self.at_rest):
            return UNREACHABLE
        if self.at_rest and DAMAGED_RECORD in self.status:
            return UNKNOWN_STATE
        state = self.supervisor_state or facts.LineState.STARTING
        if self.orphaned and not self.connected and state not in facts.FINAL_LINE_STATES:
            return SUPERVISOR_LOST
        if state == facts.LineState.PAUSING:
            # The supervisor's `under_way`: the mutations it has taken, oldest (the one it pauses for) first.
            for entry in self.status.get("under_way") or ():
                if isinstance(entry, dict) and entry.get("method") in PAUSING_FOR:
                    return PAUSING_FOR[entry["method"]]
        if state == facts.LineState.TRAINING:
            stop = self.status.get("stop")
            if isinstance(stop, dict):
                cycle = stop.get("at_cycle_end")
                return facts.LineState.STOPPING if cycle is None else f"{facts.LineState.STOPPING} after cycle {cycle}"
            if self._trainer_served_stop:
                return facts.LineState.STOPPING
            stage = (self.heartbeat or {}).get("stage")
            if stage in SHOWN_STAGES:
                return stage
        return state

    @property
    def _trainer_served_stop(self) -> bool:
        """The running trainer served a stop: it removed STOP and beat `stopped` for it, and its
        supervisor, which calls the line `training` until the trainer exits, has not seen it leave."""
        beat = self.heartbeat or {}
        # Its own beat, not a stopped trainer's read before a relaunched one's first (torchrun's
        # rank 0 beats under `trainer_pid`, among its `trainer_children`).
        trainer = [self.status.get("trainer_pid"), *(self.status.get("trainer_children") or ())]
        return (beat.get("stage") == Stage.STOPPED and beat.get("reason") == facts.StopReason.STOP_FILE
                and beat.get("pid") is not None and beat.get("pid") in trainer)

    @property
    def ended(self) -> bool:
        """Nothing runs the line: it ended (finished, stopped, failed), its supervisor and trainer are
        gone, or it is at rest with its state unknown. Its heartbeat, pace and next events are
        history, not live readings."""
        state = self.display_state
        return state in facts.FINAL_LINE_STATES or state in (SUPERVISOR_LOST, UNKNOWN_STATE)

    @property
    def on_cpu(self) -> bool | None:
        """Whether the line trains on the CPU: run.json's `device` as its supervisor read it, else the
        GPUs that `device` lets it lease (none: the CPU); None when its supervisor did not say."""
        device = self.status.get("device")
        if device == "cpu":
            return True
        if "gpu_candidates" in self.status:  # what `device` came to on this host (`auto` without a GPU: the CPU)
            return self.gpu_candidates is None
        return False if isinstance(device, str) and device.startswith("cuda") else None

    def heartbeat_age(self, now: float) -> float | None:
        if not self.heartbeat:
            return None
        beat = beat_time(self.heartbeat)
        return None if beat <= 0 else max(0.0, now - beat)

    @property
    def last_row(self) -> dict[str, Any] | None:
        return self.recent_rows[-1] if self.recent_rows else None

    @property
    def update(self) -> int | None:
        row_update = self.series.update[-1] if self.series.update else None
        beat_update = (self.heartbeat or {}).get("update")
        candidates = [value for value in (row_update, beat_update) if isinstance(value, int)]
        return max(candidates) if candidates else None

    @property
    def tokens(self) -> float | None:
        return self.series.tokens[-1] if self.series.tokens else None

    @property
    def cycle(self) -> int | None:
        """The data cycle the trainer is in: its last row's, or the one a heartbeat says it waits for."""
        row = self.last_row
        candidates = [
            value
            for value in (None if row is None else row.get("cycle"), (self.heartbeat or {}).get("cycle"))
            if isinstance(value, int) and not isinstance(value, bool)
        ]
        return max(candidates) if candidates else None

    @property
    def is_pssa(self) -> bool:
        """A PSSA line (it gets the memory tab), from run.json or the supervisor's status."""
        preset = self.status.get("preset")
        return self.facts.is_pssa or (isinstance(preset, str) and preset.startswith("pssa"))

    @property
    def plan_stage(self) -> str | None:
        row = self.last_row
        return None if row is None else row.get("stage")

    @property
    def loss(self) -> float | None:
        return _present(self.series.loss[-1]) if self.series.loss else None

    @property
    def tokens_per_s(self) -> float | None:
        return _present(self.series.tokens_per_s[-1]) if self.series.tokens_per_s else None

    @property
    def val_loss(self) -> float | None:
        for row in reversed(self.validations):
            value = validation_loss(row)
            if value is not None:
                return value
        return None

    @property
    def restarts(self) -> int:
        """Crashes the supervisor restarted the trainer after (supervisor.json's `crashes`, over every
        life of the line's supervisor); relaunches the line asked for (a rollback, a tune, a resume) are none."""
        crashes = self.status.get("crashes")
        return crashes if isinstance(crashes, int) and not isinstance(crashes, bool) else 0

    @property
    def gpu_index(self) -> int | None:
        index = self.status.get("gpu_index")
        return index if isinstance(index, int) else None

    @property
    def gpu_indices(self) -> list[int]:
        """Every GPU the line's leases hold, rank 0's first (one at parallel.degree 1; none on the
        CPU or while it waits; a supervisor older than the field: `gpu_index` alone)."""
        indices = self.status.get("gpu_indices")
        if isinstance(indices, list) and indices and all(type(index) is int for index in indices):
            return indices
        return [] if self.gpu_index is None else [self.gpu_index]

    @property
    def gpu_candidates(self) -> list[int] | None:
        """The GPUs (NVML indices) run.json's `device` lets the line lease (None: the CPU, or not said)."""
        candidates = self.status.get("gpu_candidates")
        if not isinstance(candidates, list):
            return None
        return [index for index in candidates if isinstance(index, int) and not isinstance(index, bool)]

    @property
    def waiting_for_gpus(self) -> list[int]:
        """The GPUs the line waits for a lease on, every one held by another line (none while it holds
        one, or waits holding its own for other processes to leave)."""
        if self.at_rest or self.supervisor_state != facts.LineState.WAITING_GPU or self.gpu_index is not None:
            return []
        return self.gpu_candidates or []

    @property
    def sharing_gpu(self) -> bool:
        """Training with its lengths' shared shapes beside other GPU processes (its newest row's
        `gpu_mode`): slower on purpose, and back to its own shapes once they have gone."""
        row = self.last_row
        return row is not None and row.get("gpu_mode") == "shared"

    @property
    def trainer_pid(self) -> int | None:
        pid = self.status.get("trainer_pid")
        return pid if isinstance(pid, int) else None

    @property
    def trainer_pids(self) -> list[int]:
        """The trainer's processes: its pid and, at parallel.degree above 1, its ranks' (none while no
        trainer runs)."""
        pid = self.trainer_pid
        if pid is None:
            return []
        children = self.status.get("trainer_children")
        ranks = [child for child in children if type(child) is int] if isinstance(children, list) else []
        return [pid, *ranks]

    @property
    def latest_checkpoint(self) -> int | None:
        update = self.status.get("latest_checkpoint")
        return update if isinstance(update, int) else None

    @property
    def queued_forks(self) -> list[ForkView]:
        """Branches waiting for the end of their trunk cycle (the supervisor's `queued_forks`)."""
        return fork_views(self.status.get("queued_forks"), failed=False)

    @property
    def failed_forks(self) -> list[ForkView]:
        """Queued branches that could not be made (the supervisor's `failed_forks`, with the reason)."""
        return fork_views(self.status.get("failed_forks"), failed=True)

    @property
    def mutable(self) -> bool:
        """Mutating keys work only on a line whose supervisor answers now."""
        return self.connected

    @property
    def resumable(self) -> bool:
        """No supervisor runs the line (none answers, none is registered): `resume` may start one."""
        return not self.connected and not self.registered


def _present(value: float) -> float | None:
    return None if math.isnan(value) else value


def beat_time(heartbeat: dict[str, Any]) -> float:
    """When a heartbeat was written (Unix time; 0.0 where it does not say)."""
    beat = heartbeat.get("time")
    return float(beat) if isinstance(beat, (int, float)) and not isinstance(beat, bool) else 0.0


def is_newer_beat(candidate: dict[str, Any], held: dict[str, Any] | None) -> bool:
    """Whether `candidate` is a later heartbeat than the one `held` (None: none yet).

    A beat of the held one's time is that same beat (a trainer writes one beat per moment): taking
    it again would undo what the console learned since, a rollback's update over the stopped
    trainer's last beat, which the supervisor's status keeps sending until the next trainer beats.
    A held beat without a time is replaced by any."""
    if held is None:
        return True
    held_time = beat_time(held)
    return held_time == 0.0 or beat_time(candidate) > held_time
