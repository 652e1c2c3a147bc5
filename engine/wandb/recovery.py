"""A damaged or lost `wandb_run.json`: the line's run, and what its next start must do with it,
rebuilt from the line's checkpoints (engine.wandb.checkpoint_records).

When wandb_run.json cannot be read, or is missing while a checkpoint records a run, the next start
does not start a new run beside the line's; it does what the lost file would have had it do, the
first of these that the checkpoints show:

- rewind the run to the update `checkpoints/latest` names where a checkpoint after `latest` records
  a run: the line was rolled back (those checkpoints stay until the line writes its next one), and
  the run as the newest of them records it holds, or may hold, the steps the rollback abandoned.
  The rewind is planned as `rollback` plans it (`WandbRunState.plan_rewind`). A crash between a
  checkpoint's write and `latest`'s move shows the same; a rewind to `latest` is sound there too,
  the trainer resuming from `latest` and training those updates again;
- carry out a rewind or fork that the newest checkpoint at or before `latest` records as planned
  and not carried out (W&B was out from the rollback or branch until that checkpoint);
- continue the run that checkpoint records (a plain resume, as after any restart): weeks of a
  line's curve stay in one run;
- fork the parent's run where the line is a branch and no checkpoint records a run of it yet: its
  first checkpoint records the parent and the parent's checkpoint of the fork, whose record names
  the parent's run and the step acknowledged there. Without them (the parent or that checkpoint
  gone, no step acknowledged) the fork cannot be rebuilt: a new run gets the parent's rows up to
  the fork, then the branch's, and run.log says why the parent's run was not forked.

The recovered state holds the run id and the step acknowledged at that checkpoint, and the rewind
or fork, nothing more (what else wandb_run.json kept -- superseded runs, local directories, refused
features -- is found again or rebuilt as the line goes on). What cannot be told from disk: whether
the start before the loss carried out the rewind or fork already. A native rewind carried out again
leaves the same run and curve; a fork, or a rewind where W&B cannot rewind, makes a new run again,
whole, and the one the earlier start made stays beside it.

A checkpoint's acknowledged step may be behind what W&B holds (acknowledged later, the file then
lost): online, the server's own count decides what a resume sends; offline, the rows after the
recorded step are logged again, which the offline client accepts and a later `wandb sync` leaves as
they were (W&B drops a step not above the run's last). Nothing saved is lost: a damaged file is set
aside under a name of its own first.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.checkpoints.format import update_of
from engine.layout import LineLayout
from engine.wandb.checkpoint_records import BranchOrigin, abandoned_run, branch_origin, recorded_run
from engine.wandb.state import PendingStart, WandbRunState, WandbStateError


@dataclass(frozen=True)
class Recovery:
    """What a start goes on with in place of a damaged or lost wandb_run.json."""

    state: WandbRunState
    """The state the start works from: the run, its acknowledged step, a rewind or fork to carry out."""
    verb: str
    """What the start does: continue (the run), rewind (it), fork (the parent's), start (a new run)."""
    what: str
    """The run and the evidence: `run X from checkpoint uN (update N, W&B step A acknowledged)`."""
    sends: str
    """What reaches W&B, from which rows."""

    def plan(self) -> str:
        """What the next start does: `continues run X from checkpoint uN (...)` (for `nsconsole status`)."""
        return f"{self.verb}s {self.what}"

    def doing(self) -> str:
        """`continuing run X ...; the rows after step A are sent again from rows.jsonl` (for run.log)."""
        return f"{self.verb.removesuffix('e')}ing {self.what}; {self.sends}"


def planned_recovery(layout: LineLayout, online: bool = False) -> Recovery | None:
    """What the next start does in place of a damaged or lost wandb_run.json (see the module
    docstring); None: no checkpoint records a run or a planned start, and the line is no branch.
    `online`: the line's W&B mode is online, where a resume sends what the server says it lacks."""
    abandoned = abandoned_run(layout)
    if abandoned is not None:
        record, latest = abandoned
        state = record.state()
        state.plan_rewind(update_of(Path(latest)) or 0)  # abandoned_run names a checkpoint
        return _carrying_out(state, f"the line was rolled back to {latest}: checkpoint {record.checkpoint} after it "
                                    "records the run")  # fmt: skip
    present = recorded_run(layout)
    if present is not None and present.pending is None:
        return Recovery(present.state(), "continue", present.describe(),
                        f"{present.resent(online)} from {layout.rows_jsonl.name}")
    if present is not None:
        return _carrying_out(present.state(), f"as checkpoint {present.checkpoint} records it planned")
    origin = branch_origin(layout)
    if origin is not None:
        return _rebuilt_fork(origin)
    return None


def _carrying_out(state: WandbRunState, why: str) -> Recovery:
    """The recovery of a state that holds a planned rewind or fork (`why`: what says so)."""
    pending = state.pending
    assert pending is not None  # plan_rewind plans one for a run; a record without a run holds one
    if pending.kind == "fork":
        return _fork(state, why, unforked="the plan names no run of the parent")
    return Recovery(
        state, "rewind", f"run {state.run_id} to update {pending.at_update} ({why})",
        "the line's rows that W&B lacks, up to the checkpoint the line resumes from, are sent from rows.jsonl "
        "(to a new run where W&B cannot rewind)",
    )  # fmt: skip


def _rebuilt_fork(origin: BranchOrigin) -> Recovery:
    """The fork a branch's first start makes, rebuilt from the branch's first checkpoint."""
    parent = LineLayout(origin.parent)
    parent_exists = parent.root.is_dir()
    pending = PendingStart(
        kind="fork",
        at_update=origin.update,
        parent_run_id=None if origin.parent_run is None else origin.parent_run.run_id,
        parent_rows=str(parent.rows_jsonl.resolve()) if parent_exists else None,
        parent_acknowledged=origin.parent_through(),
    )
    if not parent_exists:
        unforked = f"{parent.root} is gone"
    else:
        unforked = f"{parent.checkpoints / origin.checkpoint} records no run (gone, unreadable, or W&B off)"
    why = f"the branch's first checkpoint records its parent {origin.parent}, forked after {origin.checkpoint}"
    return _fork(WandbRunState(pending=pending), why, unforked)


def _fork(state: WandbRunState, why: str, unforked: str) -> Recovery:
    """A branch's planned fork; `unforked`: why the parent's run is unknown, where it is.

    A fork needs the parent's run and a step of it known acknowledged (start.py forks there and
    sends the parent's rows after it); without either, the branch's run is a new one backfilled
    from the parent's rows, as the start does it.
    """
    pending = state.pending
    assert pending is not None and pending.kind == "fork"
    if pending.parent_run_id is not None and pending.parent_acknowledged is not None:
        return Recovery(
            state, "fork", f"run {pending.parent_run_id} at update {pending.at_update} ({why})",
            "the parent's rows up to the fork that W&B lacks, then the branch's, are sent from their rows.jsonl "
            "(to a new run where W&B cannot fork)",
        )  # fmt: skip
    if pending.parent_run_id is not None:
        unforked = f"no step of run {pending.parent_run_id} is recorded acknowledged at the fork"
    rows = "the branch's rows"
    if pending.parent_rows is not None:
        rows = f"the rows of {pending.parent_rows} up to update {pending.at_update}, then the branch's,"
    return Recovery(state, "start", f"a new run ({why})",
                    f"{rows} are sent to it; the parent's run could not be forked: {unforked}")


def load_or_recover(layout: LineLayout, say: Callable[[str], None], online: bool = False) -> WandbRunState:
    """wandb_run.json as saved; when it is damaged or missing, the state `planned_recovery` rebuilds
    (`online`: the line's W&B mode is online, where the server's count decides what is re-sent).

    A damaged file is set aside first (`set_aside`); either way one line goes to `say` (run.log)
    naming the file, its problem and what the line goes on with. A missing file with nothing to
    recover is a line whose run has not begun: nothing is said.
    """
    path = layout.wandb_run_json
    aside: Path | None = None
    try:
        state = WandbRunState.load(path)
    except WandbStateError as error:
        problem = str(error)
        # Keep the damaged file for the user before anything new is written in its place.
        aside = set_aside(path)
    else:
        if path.exists():
            return state
        problem = f"{path.name}: missing"
    recovery = planned_recovery(layout, online)
    if recovery is None:
        if aside is not None:
            # Nothing else records the run: a new run, backfilled from rows.jsonl, keeps the W&B
            # record complete.
            say(f"W&B: {problem}; set aside as {aside.name}, starting a new W&B run with every row "
                "(no checkpoint records the line's run)")
        return WandbRunState()
    kept = f"; set aside as {aside.name}" if aside is not None else ""
    say(f"W&B: {problem}{kept}; {recovery.doing()}")
    return recovery.state


def set_aside(path: Path) -> Path:
    """Rename a damaged wandb_run.json to `wandb_run.json.bad-<time>` (`-2`, `-3`, ... when that
    name is taken: an earlier damaged file is never replaced); returns the new path."""
    stem = f"{path.name}.bad-{time.strftime('%Y%m%d-%H%M%S')}"
    aside, number = path.with_name(stem), 1
    while aside.exists() or aside.is_symlink():
        number += 1
        aside = path.with_name(f"{stem}-{number}")
    path.rename(aside)
    return aside
