"""A damaged or lost wandb_run.json on real tiny lines, with the real wandb client in offline mode:
the line's run continues as its newest checkpoint records it (engine.wandb.recovery), a rollback's
rewind and a branch's fork are rebuilt from the checkpoints, and a new run starts only where no
checkpoint records one.

The first two sessions train updates 1..4 and 5..8: the second session's checkpoints (u5, u8)
record the run with step 4 acknowledged (the step is read back every 30 s, and these sessions are
shorter), behind the 8 steps the run's local logs hold: the recovering start sends the rows after
step 4 again (the offline client takes them; `wandb sync` leaves a step W&B already has as it is).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.lines import copy_data_line, data_template_fixture
from test_trainer_wandb import (
    assert_rewound,
    last_session,
    line_rows,
    losses,
    train,
    wandb_history,
    wandb_line,
)

from engine.config.run import RunConfig
from engine.layout import LineLayout
from engine.ops.branch import BranchRequest, branch_line
from engine.ops.rollback import rollback_line
from engine.wandb.state import RunPoint, WandbRunState

pytestmark = pytest.mark.usefixtures("offline_wandb", "one_thread")  # conftest: a temporary, offline wandb home

data_template = data_template_fixture()

GARBAGE = b"\x00\xff{\"version\": 1, \"run_id\": \x9c\n"
"""What a damaged wandb_run.json holds: not UTF-8, not JSON."""


def two_sessions(line: Path) -> str:
    """Train updates 1..8 in two starts; returns the line's run id."""
    train(line, stop_at=4)
    train(line, stop_at=8)
    state = WandbRunState.load(LineLayout(line).wandb_run_json)
    assert state.run_id is not None and state.acknowledged_step == 8
    # The newest checkpoint names the run, with the step acknowledged when it was taken.
    record = json.loads((line / "checkpoints" / "u00000008" / "state.json").read_text())["wandb"]
    assert record == {"run_id": state.run_id, "acknowledged_step": 4}
    return state.run_id


def run_log_lines(line: Path, marker: str) -> list[str]:
    return [text for text in (line / "run.log").read_text().splitlines() if marker in text]


def said_of_the_damaged_file(line: Path) -> tuple[str, str]:
    """(the name the damaged file was set aside as, run.log's one line about wandb_run.json); the
    file is kept byte for byte: nothing saved is lost."""
    [aside] = line.glob("wandb_run.json.bad-*")
    assert aside.read_bytes() == GARBAGE
    [said] = run_log_lines(line, "W&B: wandb_run.json")
    return aside.name, said


def test_a_damaged_state_file_continues_the_run_its_newest_checkpoint_records(
    tmp_path: Path, data_template: Path
) -> None:
    line = wandb_line(tmp_path, data_template, "offline")
    layout = LineLayout(line)
    run_id = two_sessions(line)
    layout.wandb_run_json.write_bytes(GARBAGE)
    train(line, stop_at=12)
    state = WandbRunState.load(layout.wandb_run_json)
    assert (state.run_id, state.start, state.acknowledged_step) == (run_id, "resume", 12)
    # The start sent the rows after the recorded step 4 again, then the session's own: one run.
    record, history = last_session(line)
    assert record.run_id == run_id
    assert history == losses(line, range(5, 13))
    # The run's directories of the earlier sessions are the line's again (kept until synced).
    assert {entry.run_id for entry in state.local_files} == {run_id}
    # Steps 5..8 logged twice (the earlier session's, as far as its close flushed them, and the re-sent
    # copies) are the same rows of rows.jsonl.
    history = wandb_history(line)
    assert sorted({step for _, step, _ in history}) == list(range(1, 13))
    by_update = dict(losses(line, range(1, 13)))
    assert all(values["loss"] == by_update[step] for _, step, values in history)
    assert [row["update"] for row in line_rows(line)] == list(range(1, 13))
    # Nothing saved is lost: the damaged file is kept under a name that says so.
    aside, said = said_of_the_damaged_file(line)
    assert said.endswith(
        f"W&B: wandb_run.json: not UTF-8 text (byte 1); set aside as {aside}; continuing run {run_id} "
        "from checkpoint u00000008 (update 8, W&B step 4 acknowledged); the rows after step 4 are sent "
        "again from rows.jsonl"
    ), said


def test_a_lost_state_file_continues_the_run_its_checkpoints_record(tmp_path: Path, data_template: Path) -> None:
    line = wandb_line(tmp_path, data_template, "offline")
    layout = LineLayout(line)
    run_id = two_sessions(line)
    layout.wandb_run_json.unlink()
    train(line, stop_at=10)
    state = WandbRunState.load(layout.wandb_run_json)
    assert (state.run_id, state.start, state.acknowledged_step) == (run_id, "resume", 10)
    record, history = last_session(line)
    assert record.run_id == run_id and history == losses(line, range(5, 11))
    assert not list(line.glob("wandb_run.json.bad-*"))  # nothing was damaged, nothing set aside
    [said] = run_log_lines(line, "W&B: wandb_run.json")
    assert said.endswith(
        f"W&B: wandb_run.json: missing; continuing run {run_id} from checkpoint u00000008 (update 8, "
        "W&B step 4 acknowledged); the rows after step 4 are sent again from rows.jsonl"
    ), said


def test_where_no_checkpoint_records_a_run_a_damaged_state_file_starts_a_new_run_with_every_row(
    tmp_path: Path, data_template: Path
) -> None:
    # W&B disabled for the first updates: the checkpoints record no run (`wandb` is null).
    line = wandb_line(tmp_path, data_template, "disabled")
    train(line, stop_at=4)
    config = RunConfig.load(line / "run.json")
    config.wandb.mode = "offline"
    config.save(line / "run.json")
    layout = LineLayout(line)
    layout.wandb_run_json.write_bytes(GARBAGE)
    train(line, stop_at=6)
    state = WandbRunState.load(layout.wandb_run_json)
    assert state.run_id is not None and (state.start, state.acknowledged_step) == ("new", 6)
    record, history = last_session(line)
    assert record.run_id == state.run_id and history == losses(line, range(1, 7))
    aside, said = said_of_the_damaged_file(line)
    assert said.endswith(
        f"W&B: wandb_run.json: not UTF-8 text (byte 1); set aside as {aside}, starting a new W&B run "
        "with every row (no checkpoint records the line's run)"
    ), said


def test_a_new_line_s_first_start_says_nothing_of_a_missing_state_file(tmp_path: Path, data_template: Path) -> None:
    line = wandb_line(tmp_path, data_template, "offline")
    train(line, stop_at=2)  # its first checkpoint (u0) records no run yet: nothing to recover
    state = WandbRunState.load(LineLayout(line).wandb_run_json)
    assert state.start == "new" and state.acknowledged_step == 2
    assert not run_log_lines(line, "wandb_run.json")


def test_a_rollback_and_a_branch_whose_state_files_are_lost_are_rewound_and_forked_as_planned(
    tmp_path: Path, data_template: Path
) -> None:
    trunk = wandb_line(tmp_path / "trunk", data_template, "offline")
    train(trunk, stop_at=4)
    train(trunk, stop_at=12)  # past cycle 0's end (update 10); its checkpoints record step 4 acknowledged
    run_id = WandbRunState.load(LineLayout(trunk).wandb_run_json).run_id
    assert run_id is not None

    # A branch after cycle 0 loses its wandb_run.json before its first start: the fork is rebuilt from
    # its first checkpoint (the parent, and the parent's checkpoint u10, which names the parent's run).
    branch_data = copy_data_line(data_template, tmp_path / "branch_data")
    fork = branch_line(BranchRequest(tmp_path / "b1", trunk, 0, "decay:1024", branch_data))
    LineLayout(fork.line).wandb_run_json.unlink()
    train(fork.line, stop_at=fork.fork_update + 2)
    branch = WandbRunState.load(LineLayout(fork.line).wandb_run_json)
    assert (branch.start, branch.method, branch.pending) == ("fork", "native", None)
    assert branch.parent == RunPoint(run_id, 4) and branch.run_id != run_id
    record, history = last_session(fork.line)
    assert (record.run_id, record.branch_point.run, record.branch_point.value) == (branch.run_id, run_id, 4)
    # The trunk's rows after the fork step up to the fork, then the branch's own.
    after_fork = range(fork.fork_update + 1, fork.fork_update + 3)
    assert history == losses(trunk, range(5, fork.fork_update + 1)) + losses(fork.line, after_fork)
    [said] = run_log_lines(fork.line, "W&B: wandb_run.json")
    assert f"forking run {run_id} at update {fork.fork_update} (the branch's first checkpoint records its parent" in said

    # A rollback of the trunk to update 5, its wandb_run.json damaged before the next start: the run is
    # rewound (to the step acknowledged, 4, and sent row 5 again), not resumed past the rollback.
    rollback_line(trunk, 5)
    LineLayout(trunk).wandb_run_json.write_bytes(GARBAGE)
    train(trunk, stop_at=7)
    assert_rewound(trunk, run_id, point=4, through=7)
    aside, said = said_of_the_damaged_file(trunk)
    assert f"set aside as {aside}; rewinding run {run_id} to update 5 (the line was rolled back to u00000005" in said
