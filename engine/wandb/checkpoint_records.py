"""What a line's checkpoints record of its W&B run: read by a start that lost wandb_run.json.

Every checkpoint's state.json keeps `wandb` (`WandbMirror.checkpoint_record`): the line's run, the
step W&B had acknowledged, and a rewind or fork planned but not carried out yet (`pending`). A
branch's first checkpoint also records the parent line and the parent's checkpoint it was forked
from (`branched_from`, engine.ops.branch); that checkpoint's own record names the parent's run at
the fork.

`checkpoints/latest` divides the checkpoints: those at or before it are the line's present; those
after it are a continuation the line no longer has (a rollback set `latest` back; they stay on disk
until the line writes its next checkpoint), whose records say the run went further than the line.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from engine.checkpoints.format import (
    BRANCH_START_KEPT,
    list_checkpoints,
    read_checkpoint_state,
    read_latest,
    update_of,
)
from engine.layout import LineLayout
from engine.wandb.state import STATE_VERSION, PendingStart, WandbRunState, WandbStateError


@dataclass(frozen=True)
class RecordedRun:
    """The line's W&B run as a checkpoint recorded it."""

    run_id: str | None
    """The run the checkpoint's updates belong to (None: not begun; `pending` is the fork that begins it)."""
    acknowledged_step: int | None
    """The last step of the run W&B had acknowledged when the checkpoint was taken (None: none yet)."""
    checkpoint: str
    """The checkpoint's directory name (`u00001200`)."""
    update: int
    """The checkpoint's update."""
    pending: PendingStart | None = None
    """A rewind or fork planned and not carried out when the checkpoint was taken."""

    def describe(self) -> str:
        """`run X from checkpoint uN (update N, W&B step A acknowledged)`."""
        acknowledged = "no step" if self.acknowledged_step is None else f"W&B step {self.acknowledged_step}"
        return f"run {self.run_id} from checkpoint {self.checkpoint} (update {self.update}, {acknowledged} acknowledged)"

    def resent(self, online: bool) -> str:
        """What the resume of the recovered run sends again: online, what the server says it lacks;
        offline, the rows after the recorded step (nothing else tells what the run holds)."""
        if online:
            return "the rows after the server's last step are sent again"
        if self.acknowledged_step is None:
            return "every row is sent again"
        return f"the rows after step {self.acknowledged_step} are sent again"

    def state(self) -> WandbRunState:
        """A wandb_run.json holding what the record holds (a copy: a start changes its state)."""
        pending = None if self.pending is None else dataclasses.replace(self.pending)
        return WandbRunState(run_id=self.run_id, acknowledged_step=self.acknowledged_step, pending=pending)


def read_record(directory: Path) -> RecordedRun | None:
    """The record of one checkpoint; None where it names neither a run nor a planned start.

    Those are a new line's first checkpoint (taken before its run began), a branch's first one (its
    run is the fork its first start makes), those of a time W&B was disabled, and one whose
    state.json is unreadable. A step that is no step reads as none acknowledged; a `pending` that
    does not read as wandb_run.json's reads as none.
    """
    record = (read_checkpoint_state(directory) or {}).get("wandb")
    if not isinstance(record, dict):
        return None
    run_id = record.get("run_id")
    run_id = run_id if isinstance(run_id, str) and run_id else None
    pending = _pending(record.get("pending"))
    if run_id is None and pending is None:
        return None
    acknowledged = record.get("acknowledged_step")
    if isinstance(acknowledged, bool) or not isinstance(acknowledged, int) or acknowledged < 0:
        acknowledged = None
    update = update_of(directory)
    assert update is not None  # only checkpoint directories are read
    return RecordedRun(run_id, acknowledged, directory.name, update, pending)


def _pending(value: object) -> PendingStart | None:
    if value is None:
        return None
    try:
        return WandbRunState.from_dict({"version": STATE_VERSION, "pending": value}).pending
    except WandbStateError:
        return None


def recorded_run(layout: LineLayout) -> RecordedRun | None:
    """The newest record at or before `latest` (`read_record`): the line's present.

    With no readable `latest`, every checkpoint counts (as for the trainer's resume). None: no
    checkpoint of the present records a run or a planned start.
    """
    latest = _latest_update(layout)
    present = list_checkpoints(layout.checkpoints)
    if latest is not None:
        present = [directory for directory in present if (update_of(directory) or 0) <= latest]
    return _newest_record(present)


def abandoned_run(layout: LineLayout) -> tuple[RecordedRun, str] | None:
    """The newest record after `latest`, and the checkpoint `latest` names: the run as the line left
    it before `latest` was set back (a rollback, or a crash between a checkpoint's write and
    `latest`'s move). None: no checkpoint after `latest` records a run or a planned start, or no
    `latest` is readable."""
    latest = read_latest(layout.checkpoints)
    if latest is None:
        return None
    bound = update_of(Path(latest)) or 0  # read_latest returns checkpoint names only
    record = _newest_record([path for path in list_checkpoints(layout.checkpoints) if (update_of(path) or 0) > bound])
    return None if record is None else (record, latest)


def _latest_update(layout: LineLayout) -> int | None:
    latest = read_latest(layout.checkpoints)
    return None if latest is None else update_of(Path(latest))


def _newest_record(directories: list[Path]) -> RecordedRun | None:
    for directory in reversed(directories):
        record = read_record(directory)
        if record is not None:
            return record
    return None


@dataclass(frozen=True)
class BranchOrigin:
    """Where a branch line was forked from, as its first checkpoint records it."""

    parent: Path
    """The parent line's directory."""
    checkpoint: str
    """The parent's checkpoint the branch continues from."""
    update: int
    """The update of the fork (the branch's first checkpoint's)."""
    parent_run: RecordedRun | None
    """The parent's run as that checkpoint records it (None: it records none, or is gone)."""

    def parent_through(self) -> int | None:
        """The last step of the parent's run that belongs to the parent's history at the fork: the
        step acknowledged there, or less where a rewind of the parent's run was still pending (the
        steps past its point were abandoned). None: no step known."""
        run = self.parent_run
        if run is None or run.acknowledged_step is None:
            return None
        pending = run.pending
        if pending is not None and pending.kind == "rewind" and not pending.initialized:
            return min(run.acknowledged_step, pending.at_update)
        return run.acknowledged_step


def branch_origin(layout: LineLayout) -> BranchOrigin | None:
    """The parent of a branch line (None: a trunk, or a first checkpoint that does not read)."""
    checkpoints = list_checkpoints(layout.checkpoints)
    if not checkpoints:
        return None
    first = checkpoints[0]
    state = read_checkpoint_state(first) or {}
    origin = state.get("branched_from")
    if state.get("kept") != BRANCH_START_KEPT or not isinstance(origin, dict):
        return None
    line, checkpoint = origin.get("line"), origin.get("checkpoint")
    if not isinstance(line, str) or not isinstance(checkpoint, str) or update_of(Path(checkpoint)) is None:
        return None
    update = update_of(first)
    assert update is not None  # list_checkpoints lists checkpoint names only
    parent = LineLayout(Path(line))
    return BranchOrigin(parent.root, checkpoint, update, read_record(parent.checkpoints / checkpoint))
