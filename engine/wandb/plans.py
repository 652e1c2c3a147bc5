"""A rewind or fork that a rollback or branch plans in wandb_run.json, and the line's next start
carries out (engine.wandb.start)."""

from __future__ import annotations

from pathlib import Path

from engine.errors import LineError
from engine.layout import LineLayout
from engine.wandb.state import PendingStart, WandbRunState, WandbStateError


def plan_rollback(line_dir: Path | str, to_update: int) -> None:
    """Record that the line was rolled back to `to_update`; its next start rewinds the W&B run.

    Called by the rollback operation before the trainer is started again. Where the server can
    rewind, the run continues from `to_update`; elsewhere a new run is backfilled from rows.jsonl
    up to `to_update` and the old run is marked superseded.
    """
    layout = LineLayout(line_dir)
    # Refused, the file left as it is: a rollback is the user's act, so the user decides; the
    # start that follows a move recovers the run (engine.wandb.recovery).
    state = _load_or_refuse(
        layout.wandb_run_json, "the rollback changed nothing: move the file aside and roll back again (the next "
        "start rewinds the W&B run the line's checkpoints record)"
    )  # fmt: skip
    if state.pending is not None and state.pending.kind == "fork" and to_update < state.pending.at_update:
        raise LineError(
            f"{layout.wandb_run_json.name}: the branch starts at update {state.pending.at_update}; "
            f"it cannot be rolled back to {to_update}"
        )
    if state.plan_rewind(to_update):
        state.save(layout.wandb_run_json)


def plan_branch(branch_dir: Path | str, parent_dir: Path | str, at_update: int) -> None:
    """Record that the line at `branch_dir` branches from `parent_dir` after update `at_update`.

    Called by the branch operation once the branch's directory exists. The branch's first start
    forks the parent's run at `at_update` where the server can, else starts a new run
    backfilled from the parent's rows.jsonl up to `at_update`.
    """
    branch = LineLayout(branch_dir)
    parent = LineLayout(parent_dir)
    existing = WandbRunState.load(branch.wandb_run_json)
    if existing.run_id is not None:
        raise LineError(f"{branch.wandb_run_json}: the branch already has W&B run {existing.run_id}")
    # The parent's own next start sets a damaged file aside and recovers its run from its
    # checkpoints; a branch made before that would fork a run nobody can name.
    parent_state = _load_or_refuse(
        parent.wandb_run_json, "the branch was not made: run the parent once (its start recovers the W&B run its "
        "checkpoints record) or move the file aside, and branch again"
    )  # fmt: skip
    state = WandbRunState(
        pending=PendingStart(
            kind="fork",
            at_update=at_update,
            parent_run_id=parent_state.run_id,
            parent_rows=str(parent.rows_jsonl.resolve()),
            parent_acknowledged=parent_state.acknowledged_step,
        ),
        # What the server refused for the parent it refuses for the branch too.
        fork_unsupported=parent_state.fork_unsupported,
        rewind_unsupported=parent_state.rewind_unsupported,
    )
    state.save(branch.wandb_run_json)


def _load_or_refuse(path: Path, consequence: str) -> WandbRunState:
    """`WandbRunState.load(path)`; a damaged file refuses the command with the file's whole path
    (the command may have been given any line) in place of its bare name, and `consequence`."""
    try:
        return WandbRunState.load(path)
    except WandbStateError as error:
        message = str(error).removeprefix(f"{path.name}: ")
        raise WandbStateError(f"{path}: {message}; {consequence}") from None
