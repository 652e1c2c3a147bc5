"""A damaged or lost `wandb_run.json`: the line's run is recovered from its checkpoints.

Every checkpoint's state.json records the line's W&B run at that checkpoint (`wandb`: `run_id`,
`acknowledged_step`; `WandbMirror.checkpoint_record`). When wandb_run.json cannot be read, or is
missing while a checkpoint records a run, the next start continues that run (a plain resume, as
after any restart) instead of starting a new one beside it: weeks of a line's curve stay in one
run. The record is taken from the newest checkpoint at or before `checkpoints/latest` that names
a run: the line's present. After a rollback the later checkpoints stay on disk until the line
writes its next one, but their run and steps are an abandoned continuation's.

The recovered state holds the run id and the step acknowledged at that checkpoint, nothing more
(what else wandb_run.json kept -- superseded runs, local directories, refused features -- is
found again or rebuilt as the line goes on). A checkpoint's acknowledged step may be behind what
W&B holds (acknowledged later, the file then lost): online, the server's own count decides what
the resume sends; offline, the rows after the recorded step are logged again, which the offline
client accepts and a later `wandb sync` leaves as they were (W&B drops a step not above the run's
last). Nothing saved is lost: a damaged file is set aside under a name of its own first.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.checkpoints.format import list_checkpoints, read_checkpoint_state, read_latest, update_of
from engine.layout import LineLayout
from engine.wandb.state import WandbRunState, WandbStateError


@dataclass(frozen=True)
class RecordedRun:
    """The line's W&B run as a checkpoint recorded it."""

    run_id: str
    """The run the checkpoint's updates belong to."""
    acknowledged_step: int | None
    """The last step of the run W&B had acknowledged when the checkpoint was taken (None: none yet)."""
    checkpoint: str
    """The checkpoint's directory name (`u00001200`)."""
    update: int
    """The checkpoint's update."""

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


def recorded_run(layout: LineLayout) -> RecordedRun | None:
    """The run recorded by the newest checkpoint at or before `latest` whose state.json names one.

    Checkpoints without a record are passed over: a new line's first ones (taken before its run
    began), a branch's first one (its run is the fork its first start makes), those of a time W&B
    was disabled, one whose state.json is unreadable. With no readable `latest`, every checkpoint
    counts (as for the trainer's resume). None: no checkpoint names a run.
    """
    directories = list_checkpoints(layout.checkpoints)
    latest = read_latest(layout.checkpoints)
    bound = None if latest is None else update_of(Path(latest))
    if bound is not None:
        directories = [directory for directory in directories if (update_of(directory) or 0) <= bound]
    for directory in reversed(directories):
        record = (read_checkpoint_state(directory) or {}).get("wandb")
        if not isinstance(record, dict):
            continue
        run_id = record.get("run_id")
        if not isinstance(run_id, str) or not run_id:
            continue
        acknowledged = record.get("acknowledged_step")
        if isinstance(acknowledged, bool) or not isinstance(acknowledged, int) or acknowledged < 0:
            acknowledged = None
        update = update_of(directory)
        assert update is not None  # list_checkpoints lists checkpoint names only
        return RecordedRun(run_id, acknowledged, directory.name, update)
    return None


def load_or_recover(layout: LineLayout, say: Callable[[str], None], online: bool = False) -> WandbRunState:
    """wandb_run.json as saved; when it is damaged or missing, the run a checkpoint records
    (`online`: the line's W&B mode is online, where the server's count decides what is re-sent).

    A damaged file is set aside first (`set_aside`); either way one line goes to `say` (run.log)
    naming the file, its problem and what the line goes on with. A missing file with no run
    recorded anywhere is a line whose run has not begun: nothing is said.
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
    recorded = recorded_run(layout)
    if recorded is None:
        if aside is not None:
            # Nothing else records the run: a new run, backfilled from rows.jsonl, keeps the W&B
            # record complete.
            say(f"W&B: {problem}; set aside as {aside.name}, starting a new W&B run with every row "
                "(no checkpoint records the line's run)")
        return WandbRunState()
    kept = f"; set aside as {aside.name}" if aside is not None else ""
    say(f"W&B: {problem}{kept}; continuing {recorded.describe()}; {recorded.resent(online)} from {layout.rows_jsonl.name}")
    return WandbRunState(run_id=recorded.run_id, acknowledged_step=recorded.acknowledged_step)


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

