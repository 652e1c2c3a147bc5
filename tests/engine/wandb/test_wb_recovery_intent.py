"""A rollback's rewind or a branch's fork planned in a wandb_run.json that was then damaged or lost:
the next start rebuilds it from the line's checkpoints (engine.wandb.recovery) instead of resuming
the run as if the rolled-back steps were the line's, or starting a branch's run from its own rows.

Through the mirror with a recording backend; checkpoints are directories with a state.json only
(all the recovery reads of them). The real client's side is in test_trainer_wandb_recovery.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from helpers.wandb_fakes import (
    RecordingBackend,
    SimulatedServer,
    row,
    save_state,
    state_of,
    write_rows,
)
from test_wb_recovery import DAMAGED, checkpoint, record, start, status_line

from engine.layout import LineLayout
from engine.ops.status import line_status
from engine.wandb.mirror import plan_rollback
from engine.wandb.recovery import planned_recovery
from engine.wandb.state import PendingStart, RunPoint
from nsconsole.commands.status import format_status

RECORDED_REWIND_TAIL = (
    "the line's rows that W&B lacks, up to the checkpoint the line resumes from, are sent from rows.jsonl "
    "(to a new run where W&B cannot rewind)"
)


def rolled_back_line(line: Path, state_file: str) -> SimulatedServer:
    """A line rolled back from update 10 to 5 whose wandb_run.json was then lost (`missing`) or
    damaged before its next start: rows.jsonl cut back to 5, `latest` at u5, u8 and u10 after it."""
    server = SimulatedServer(history={"a": [(u, row(u)) for u in range(1, 11)]})
    write_rows(line, range(1, 6))
    checkpoint(line, 5, record("a", 4), latest=False)
    checkpoint(line, 8, record("a", 7), latest=False)
    checkpoint(line, 10, record("a", 9), latest=False)
    (line / "checkpoints" / "latest").write_text("u00000005\n")
    if state_file == "damaged":
        (line / "wandb_run.json").write_text(DAMAGED)
    return server


@pytest.mark.parametrize("state_file", ["missing", "damaged"])
def test_a_rollback_whose_state_file_is_lost_before_the_next_checkpoint_rewinds_the_run(
    tmp_path: Path, state_file: str
) -> None:
    server = rolled_back_line(tmp_path, state_file)
    recovery = planned_recovery(LineLayout(tmp_path))
    assert recovery is not None
    assert recovery.plan() == (
        "rewinds run a to update 5 (the line was rolled back to u00000005: checkpoint u00000010 after it records the run)"
    )
    said = start(tmp_path, RecordingBackend(server), live=range(6, 8), loss_offset=1.0)
    # Rewound at 5 (the step acknowledged at u10 is past it), then trained on: no rolled-back step stays.
    inits = [call for kind, call in server.calls if kind == "init"]
    assert inits[0]["rewind"] == RunPoint("a", 5)
    assert set(server.history) == {"a"} and server.steps("a") == list(range(1, 8))
    assert server.losses("a")[5:] == [10.0 / 6 + 1.0, 10.0 / 7 + 1.0]
    state = state_of(tmp_path)
    assert (state.run_id, state.start, state.method, state.pending) == ("a", "rewind", "native", None)
    [line] = said
    assert line.endswith(
        "; rewinding run a to update 5 (the line was rolled back to u00000005: checkpoint u00000010 after it "
        f"records the run); {RECORDED_REWIND_TAIL}"
    ), line
    assert line.startswith("W&B: wandb_run.json: missing;" if state_file == "missing" else "W&B: wandb_run.json: malformed")


def test_where_wandb_cannot_rewind_the_rebuilt_rollback_starts_a_new_run_and_marks_the_old_one(tmp_path: Path) -> None:
    server = rolled_back_line(tmp_path, "missing")
    start(tmp_path, RecordingBackend(server, rewind=False), live=range(6, 7), loss_offset=1.0)
    assert server.steps("run1") == list(range(1, 7)) and server.losses("run1")[-1] == 10.0 / 6 + 1.0
    assert server.steps("a") == list(range(1, 11))  # the old run as it was, marked
    assert server.tags["a"] == {"superseded"} and server.summary["a"]["superseded_by"] == "run1"
    state = state_of(tmp_path)
    assert (state.run_id, state.start, state.method) == ("run1", "rewind", "backfill")


def test_a_rewind_a_checkpoint_records_as_planned_is_carried_out(tmp_path: Path) -> None:
    # W&B was out from the rollback to 5 until the checkpoint at 7, which records the rewind as
    # still to do; the abandoned checkpoints are gone, and wandb_run.json was lost after it.
    server = SimulatedServer(history={"a": [(u, row(u)) for u in range(1, 11)]})
    write_rows(tmp_path, range(1, 8))
    pending = {"run_id": "a", "acknowledged_step": 10, "pending": asdict(PendingStart(kind="rewind", at_update=5))}
    checkpoint(tmp_path, 7, pending)
    recovery = planned_recovery(LineLayout(tmp_path))
    assert recovery is not None and recovery.plan() == (
        "rewinds run a to update 5 (as checkpoint u00000007 records it planned)"
    )
    said = start(tmp_path, RecordingBackend(server))
    assert [call for kind, call in server.calls if kind == "init"][0]["rewind"] == RunPoint("a", 5)
    assert said == [
        "W&B: wandb_run.json: missing; rewinding run a to update 5 (as checkpoint u00000007 records it planned); "
        + RECORDED_REWIND_TAIL
    ]
    assert state_of(tmp_path).pending is None


def test_a_second_rollback_before_the_first_rewind_keeps_the_earlier_point(tmp_path: Path) -> None:
    # The run still holds the steps the first rollback abandoned: rewound to the later point, it
    # would keep those between the two.
    save_state(tmp_path, run_id="a", start="new", acknowledged_step=12)
    plan_rollback(tmp_path, 3)
    plan_rollback(tmp_path, 5)
    assert state_of(tmp_path).pending == PendingStart(kind="rewind", at_update=3)
    # Begun (the run is rewound to 3 and holds the line's own steps since): the new point stands.
    save_state(tmp_path, run_id="a", start="rewind", acknowledged_step=4,
               pending=PendingStart(kind="rewind", at_update=3, initialized=True))  # fmt: skip
    plan_rollback(tmp_path, 5)
    assert state_of(tmp_path).pending == PendingStart(kind="rewind", at_update=5)


def branch_line(root: Path, parent: Path | None, parent_record: Any = None) -> Path:
    """A branch of `parent` at its update 10 (checkpoint u10 there, recording `parent_record` when
    given) whose wandb_run.json was lost before its first start: the branch's first checkpoint
    (u10) records its origin and no run."""
    if parent is not None:
        parent.mkdir()
        write_rows(parent, range(1, 11))
        if parent_record is not None:
            checkpoint(parent, 10, parent_record)
    branch = root / "branch"
    directory = LineLayout(branch).checkpoint(10)
    directory.mkdir(parents=True)
    origin = {"line": str(parent or root / "gone"), "checkpoint": "u00000010", "cycle": 0}
    state = {"update": 10, "kept": "branch-start", "branched_from": origin, "wandb": record(None, None)}
    (directory / "state.json").write_text(json.dumps(state))
    (branch / "checkpoints" / "latest").write_text("u00000010\n")
    return branch


def test_a_branch_whose_state_file_is_lost_before_its_first_checkpoint_forks_the_parent_s_run(tmp_path: Path) -> None:
    parent = tmp_path / "trunk"
    server = SimulatedServer(history={"trunkrun": [(u, row(u)) for u in range(1, 11)]})
    branch = branch_line(tmp_path, parent, record("trunkrun", 8))
    recovery = planned_recovery(LineLayout(branch))
    assert recovery is not None and recovery.plan() == (
        f"forks run trunkrun at update 10 (the branch's first checkpoint records its parent {parent}, forked "
        "after u00000010)"
    )
    said = start(branch, RecordingBackend(server), live=range(11, 13), loss_offset=1.0)
    assert [call for kind, call in server.calls if kind == "init"][0]["fork"] == RunPoint("trunkrun", 8)
    assert server.steps("run1") == list(range(1, 13)) and server.losses("run1")[10:] == [10.0 / 11 + 1.0, 10.0 / 12 + 1.0]
    state = state_of(branch)
    assert (state.run_id, state.start, state.method, state.pending) == ("run1", "fork", "native", None)
    assert said == [
        f"W&B: wandb_run.json: missing; forking run trunkrun at update 10 (the branch's first checkpoint records "
        f"its parent {parent}, forked after u00000010); the parent's rows up to the fork that W&B lacks, then the "
        "branch's, are sent from their rows.jsonl (to a new run where W&B cannot fork)"
    ]


def test_a_fork_whose_parent_run_is_not_recorded_backfills_a_new_run_and_says_why(tmp_path: Path) -> None:
    parent = tmp_path / "trunk"
    branch = branch_line(tmp_path, parent)  # the parent's checkpoint u10 is gone
    server = SimulatedServer()
    said = start(branch, RecordingBackend(server), live=range(11, 12))
    assert server.steps("run1") == list(range(1, 12))
    assert said == [
        f"W&B: wandb_run.json: missing; starting a new run (the branch's first checkpoint records its parent "
        f"{parent}, forked after u00000010); the rows of {parent.resolve() / 'rows.jsonl'} up to update 10, then "
        "the branch's, are sent to it; the parent's run could not be forked: "
        f"{parent / 'checkpoints' / 'u00000010'} records no run (gone, unreadable, or W&B off)"
    ]


def test_a_fork_with_no_parent_step_recorded_acknowledged_backfills_a_new_run(tmp_path: Path) -> None:
    # The parent's first session took its checkpoint before W&B acknowledged a step: where the
    # parent's run holds the fork's history is unknown, so nothing of it is copied.
    branch = branch_line(tmp_path, tmp_path / "trunk", record("trunkrun", None))
    server = SimulatedServer(history={"trunkrun": [(u, row(u)) for u in range(1, 11)]})
    said = start(branch, RecordingBackend(server), live=range(11, 12))
    assert all(call["fork"] is None for kind, call in server.calls if kind == "init")
    assert server.steps("run1") == list(range(1, 12))
    [line] = said
    assert "; starting a new run (" in line
    assert line.endswith("the parent's run could not be forked: no step of run trunkrun is recorded acknowledged "
                         "at the fork"), line


def test_a_fork_whose_parent_is_gone_gets_the_branch_s_rows_and_says_so(tmp_path: Path) -> None:
    branch = branch_line(tmp_path, None)
    (branch / "wandb_run.json").write_text(DAMAGED)
    server = SimulatedServer()
    said = start(branch, RecordingBackend(server), live=range(11, 12))
    assert server.steps("run1") == [11]
    [line] = said
    assert line.endswith(
        f"the branch's rows are sent to it; the parent's run could not be forked: {tmp_path / 'gone'} is gone"
    ), line


def test_a_fork_a_branch_s_checkpoint_records_as_planned_is_carried_out(tmp_path: Path) -> None:
    # W&B was out through the branch's first checkpoint after its fork point: it records no run, and
    # the fork as planned (with the parent's acknowledged step the branch was made with).
    parent = tmp_path / "trunk"
    branch = branch_line(tmp_path, parent, record("trunkrun", 4))
    planned = PendingStart(kind="fork", at_update=10, parent_run_id="trunkrun",
                           parent_rows=str(parent / "rows.jsonl"), parent_acknowledged=9)  # fmt: skip
    checkpoint(branch, 12, {"run_id": None, "acknowledged_step": None, "pending": asdict(planned)})
    recovery = planned_recovery(LineLayout(branch))
    assert recovery is not None and recovery.plan() == (
        "forks run trunkrun at update 10 (as checkpoint u00000012 records it planned)"
    )
    assert recovery.state.pending == planned


def test_a_checkpoint_past_latest_that_records_no_run_is_no_rollback_of_the_run(tmp_path: Path) -> None:
    # W&B was disabled in the continuation the rollback abandoned: the run never got its steps.
    checkpoint(tmp_path, 5, record("a", 5))
    checkpoint(tmp_path, 10, None, latest=False)
    recovery = planned_recovery(LineLayout(tmp_path))
    assert recovery is not None
    assert recovery.plan() == "continues run a from checkpoint u00000005 (update 5, W&B step 5 acknowledged)"


def test_status_says_the_next_start_rewinds_or_forks_the_run(tmp_path: Path) -> None:
    """`nsconsole status` says beforehand what the start will do: the rebuilt rewind, the rebuilt fork."""
    trunk = status_line(tmp_path)
    rolled_back_line(trunk, "damaged")
    status = line_status(trunk)
    [problem] = [text for text in status.problems if "wandb_run.json" in text]
    assert problem.endswith(
        "; the next start sets it aside and rewinds run a to update 5 (the line was rolled back to u00000005: "
        "checkpoint u00000010 after it records the run)"
    )
    assert "W&B: wandb_run.json unreadable (below)" in format_status(status)
    branch = branch_line(tmp_path, tmp_path / "parent", record("trunkrun", 8))
    (branch / "run.json").write_text((trunk / "run.json").read_text())
    [problem] = [text for text in line_status(branch).problems if "wandb_run.json" in text]
    assert problem == (
        f"wandb_run.json: missing; the next start forks run trunkrun at update 10 (the branch's first checkpoint "
        f"records its parent {tmp_path / 'parent'}, forked after u00000010)"
    )
