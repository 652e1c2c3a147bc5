"""Roll a line back to an earlier checkpoint.

`rollback_line(LINE, U)`: the line continues from checkpoint u<U>, its W&B run rewound to U where
the server can, else a new run backfilled (`engine.wandb.mirror.plan_rollback`). `latest` names u<U>; the later checkpoints stay on disk until the
line writes its next checkpoint, when retention removes them as an abandoned continuation
(`abandoned_after`, engine.checkpoints.tensors); rows.jsonl is cut back to the checkpoint's rows after the rows
it sets aside are kept as rows.rolledback-<time>.jsonl; the data cycles the line will read again are reopened
(their consumed mark cleared, so the preparer rebuilds their shards from the permanent manifests).
Refused while the line's trainer runs.

Every check runs before anything is written; each file is replaced atomically.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import datalines
from engine.atomic import write_text_atomic
from engine.checkpoints.format import (
    STATE_NAME,
    checkpoint_name,
    list_checkpoints,
    no_such_checkpoint,
    read_checkpoint_state,
    read_latest,
    resume_candidate,
    update_of,
    verify_checkpoint,
    write_latest,
)
from engine.config.run import RunConfig
from engine.errors import LineError
from engine.layout import LineLayout
from engine.logrotate import RotatingLog
from engine.ops.branch_records import branches_forked_after
from engine.ops.lines import failed_writes_said, open_line, refuse_an_unwritable_line, resolve_data_path
from engine.ops.rollback_records import keep_rolled_back_rows
from engine.protocol.facts import LineState, Stage
from engine.rows import RowsFile, prefix_lines, rows_file_problem, rows_problem
from engine.supervisor.reads import read_json, running_trainer_pid
from engine.wandb.mirror import plan_rollback


@dataclass
class RollbackResult:
    """What a rollback did."""

    to_update: int
    """The update the line continues from."""
    set_aside: list[str]
    """Later checkpoints left for retention to remove once the line moves on."""
    rows_kept: Path | None
    """The rows set aside, those after the checkpoint's, byte for byte (None when there was no rows.jsonl)."""
    rows_now: int
    """Rows left in rows.jsonl."""
    reopened_cycles: list[int]
    """Data cycles whose consumed mark was cleared (the preparer rebuilds their shards)."""
    branches_after: list[str] = dataclasses.field(default_factory=list)
    """Branches forked after `to_update` (`branches_forked_after`): the trunk rows they grew from
    past `to_update` are in `rows_kept` now (the earlier ones stay in rows.jsonl)."""


def running_trainer(layout: LineLayout) -> int | None:
    """The pid of the line's trainer while it runs (its heartbeat's process, not one that reused its pid)."""
    return running_trainer_pid(read_json(layout.heartbeat))


def rollback_line(line: Path | str, to_update: int) -> RollbackResult:
    """Roll a line back to checkpoint u<to_update> (see the module docstring)."""
    layout = open_line(line)
    pid = running_trainer(layout)
    if pid is not None:
        raise LineError(f"{layout.root}: its trainer is running (pid {pid}); stop the line before a rollback")
    refuse_an_unwritable_line(layout, "a rollback")
    target = layout.checkpoint(to_update)
    if not target.is_dir():
        raise LineError(no_such_checkpoint(target))
    # "Back" is from the checkpoint `latest` names (a damaged one included: rolling back past it is
    # the way to mend it), or where `latest` is damaged or names one that is gone, from where a
    # start resumes: the newest before it (the rollback then writes a good `latest`).
    latest = read_latest(layout.checkpoints)
    if latest is None or not (layout.checkpoints / latest).is_dir():
        resume = resume_candidate(layout.checkpoints)
        latest = None if resume is None else resume.name
    if latest is None or to_update >= (update_of(Path(latest)) or 0):
        raise LineError(f"{target}: not before the line's latest checkpoint ({latest or 'none'}); a rollback goes back")
    verify_checkpoint(target)
    state = read_checkpoint_state(target)
    if state is None:
        raise LineError(f"{target / STATE_NAME}: unreadable")
    config = RunConfig.load(layout.run_json)

    check_rows_prefix(layout.rows_jsonl, int(state["rows"]), int(state["rows_bytes"]))

    with failed_writes_said("the rollback", layout.root):  # a full disk, say: one line naming the file
        # The rows set aside (those after the checkpoint's), not the whole of rows.jsonl: the rest stays in it.
        rows_kept = keep_rolled_back_rows(layout, int(state["rows_bytes"])) if layout.rows_jsonl.exists() else None
        try:
            plan_rollback(layout.root, to_update)
        except (LineError, OSError):
            # Refused before it wrote (a damaged wandb_run.json, say: "the rollback changed
            # nothing"): the copy of the rows this call set aside goes too, or each retry would
            # leave another.
            if rows_kept is not None:
                rows_kept.unlink(missing_ok=True)
            raise
        reopened = reopen_cycles(resolve_data_path(layout, config.data.line), int(state["position"]["cycle"]))
        write_latest(layout.checkpoints, target.name)
        RowsFile.cut_back(layout.rows_jsonl, int(state["rows"]), int(state["rows_bytes"]))
    later = [directory.name for directory in list_checkpoints(layout.checkpoints) if (update_of(directory) or 0) > to_update]
    return RollbackResult(to_update, later, rows_kept, int(state["rows"]), reopened,
                          branches_forked_after(layout, to_update))


def rows_remedy(layout: LineLayout) -> str:
    """What to do about a rows.jsonl that lacks rows the latest checkpoint counts (lost to a disk
    fault, or edited): roll back to the newest earlier checkpoint whose rows it still holds, and
    the updates after it are trained again (bit for bit on the CPU). Nothing else can mend it.
    A rows.jsonl that is no file at all (a directory, say) has no rows to roll back to."""
    if rows_file_problem(layout.rows_jsonl) is not None:
        return "put the line's rows.jsonl back in its place (from a backup if need be); the checkpoints are kept"
    resume = resume_candidate(layout.checkpoints)
    latest_update = None if resume is None else update_of(resume)
    for directory in reversed(list_checkpoints(layout.checkpoints)):
        update = update_of(directory)
        if update is None or latest_update is None or update >= latest_update:
            continue
        state = read_checkpoint_state(directory) or {}
        if rows_problem(layout.rows_jsonl, int(state.get("rows", -1)), int(state.get("rows_bytes", -1))) is None:
            return (f"`nsconsole rollback {layout.root} --to {update}` goes back to {directory.name}, the newest "
                    "checkpoint whose rows it holds (the updates after it are trained again)")
    return "no earlier checkpoint's rows are all there either: restore rows.jsonl from a backup"


def record_rollback_at_rest(layout: LineLayout, result: RollbackResult) -> None:
    """After `nsconsole rollback` on a line nothing runs (the caller holds the line: `hold_line`),
    leave its files saying so, as a supervisor's rollback leaves them: a line in run.log, the
    heartbeat at the update the line continues from (not the one it had reached), and a supervisor
    state of `finished` (no longer true: the line has updates to train again) made `stopped`.
    Each file is replaced atomically; one that is absent or unreadable is left as it is."""
    where = f"the line continues from update {result.to_update}"
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    with contextlib.suppress(OSError):
        RotatingLog(layout.run_log).write(f"{stamp} rollback: done from the command line; {where}\n")
    beat = read_json(layout.heartbeat)
    if beat is not None:
        beat.update(update=result.to_update, stage=Stage.STOPPED, time=time.time(),
                    reason=f"rolled back to {checkpoint_name(result.to_update)}")
        write_text_atomic(layout.heartbeat, json.dumps(beat))
    supervisor = read_json(layout.supervisor_json)
    if supervisor is not None and supervisor.get("state") == LineState.FINISHED:
        supervisor["state"] = LineState.STOPPED
        write_text_atomic(layout.supervisor_json, json.dumps(supervisor, indent=1, default=str) + "\n")


def check_rows_prefix(path: Path, rows: int, size: int) -> None:
    """Refuse before anything is written when rows.jsonl does not begin with the checkpoint's rows."""
    unusable = rows_file_problem(path)
    if unusable is not None:
        raise LineError(unusable)
    try:
        present = min(path.stat().st_size, size)
        newlines, _ = prefix_lines(path, size)
    except FileNotFoundError:
        present, newlines = 0, 0
    if present < size or newlines != rows:
        raise LineError(f"{path}: does not begin with the {rows} rows the checkpoint counts ({size} bytes)")


def reopen_cycles(data_path: Path, from_cycle: int) -> list[int]:
    """Clear the consumed mark of every cycle from `from_cycle` on: the line reads them again.

    The preparer rebuilds a reopened cycle's shards from its permanent manifest and checks them
    byte for byte, so the line trains exactly the samples it trained before.
    """
    data_line = datalines.open_data_line(data_path)
    return [index for index in data_line.known_cycles() if index >= from_cycle and data_line.reopen(index)]
