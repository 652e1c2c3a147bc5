"""Branch and rollback on real tiny lines: checkpoints, schedules, branches.json, W&B records, refusals."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers.lines import (
    SEQ_LEN,
    copy_data_line,
    data_template_fixture,
    make_data_line,
    make_line,
    rows_without_wall_clock,
)
from helpers.supervise import this_process_as_trainer
from helpers.wandb_fakes import RecordingBackend, SimulatedServer, session

from datalines import open_data_line
from datalines.preparer import delete_consumed_shards, prepare_cycle
from engine.checkpoints.format import (
    STATE_NAME,
    list_checkpoints,
    read_latest,
    update_of,
    verify_checkpoint,
    write_latest,
)
from engine.checkpoints.tensors import load_checkpoint
from engine.config.run import RunConfig
from engine.errors import LineError
from engine.layout import LineLayout
from engine.ops.branch import BranchRequest, branch_line, find_cycle_end, parse_plan
from engine.ops.branch_records import read_branches
from engine.ops.fork_point import expected_fork_position
from engine.ops.rollback import rollback_line
from engine.training.schedule import learning_rate
from engine.training.trainer import Trainer
from engine.wandb.state import RunPoint, WandbRunState
from nsconsole.app import rollback_consequences
from nsconsole.cli import main as cli_main
from nsconsole.state import LineView
from nsconsole.widgets.checkpoint_list import CheckpointInfo

LONG = 2 * SEQ_LEN


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread


data_template = data_template_fixture(files=4)


@pytest.fixture(scope="module")
def trained_trunk(data_template: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A trunk trained to the end of its data (kept checkpoints at every cycle end); copied per test."""
    root = tmp_path_factory.mktemp("trunk")
    # This module checks W&B planning against a simulated server; the real trainer's offline
    # run would carry out the planned fork first (tests/test_trainer_wandb.py covers that path).
    line = make_line(root, copy_data_line(data_template, root), **{"wandb.mode": "disabled"})
    assert Trainer(line, echo=None).run() == 0
    return root


@pytest.fixture
def trunk(trained_trunk: Path, tmp_path: Path) -> Path:
    shutil.copytree(trained_trunk, tmp_path / "trunk", symlinks=True)
    line = tmp_path / "trunk" / "line"
    config = RunConfig.load(line / "run.json")
    config.data.line = str(tmp_path / "trunk" / "data")  # the copy's own data line
    config.save(line / "run.json")
    config.save(line / "accepted_run.json")
    return line


def history_of(rows_jsonl: Path) -> list[tuple[int, dict]]:
    """A W&B run's history as the simulated server keeps it, from a rows.jsonl."""
    return [(row["update"], {"loss": row["loss"]}) for row in rows_without_wall_clock(rows_jsonl)]


def kept(line: Path) -> dict[str, str]:
    return {
        directory.name: load_checkpoint(directory).state["kept"]
        for directory in list_checkpoints(line / "checkpoints")
        if load_checkpoint(directory).state["kept"]
    }


def test_parse_plan_and_its_errors() -> None:
    plan = parse_plan("decay:10e9,long:2e9")
    assert [(item.kind, item.tokens, item.shape) for item in plan] == [
        ("decay", 1e10, "linear"),
        ("long", 2e9, "linear"),
    ]
    assert parse_plan("decay:5e9:sqrt")[0].shape == "sqrt"
    for bad, message in (("warm:1e9", "must be decay"), ("decay:x", "not a number"), ("long:-1", "positive"),
                         ("decay:1e9:cubic", "decay shape"), ("long:1e9:sqrt", "must be decay")):  # fmt: skip
        with pytest.raises(LineError, match=message):
            parse_plan(bad)


def test_a_cycle_end_set_aside_by_a_rollback_is_no_fork_point(tmp_path: Path) -> None:
    layout = LineLayout(tmp_path / "line")
    for update, cycle, kept in ((4, 1, "cycle-end 0"), (8, 1, None), (12, 2, "cycle-end 1")):
        directory = layout.checkpoint(update)
        directory.mkdir(parents=True)
        state = {"update": update, "kept": kept, "position": {"cycle": cycle}}
        (directory / STATE_NAME).write_text(json.dumps(state))
    write_latest(layout.checkpoints, layout.checkpoint(8).name)  # rolled back to u8; u12 not yet removed

    assert find_cycle_end(layout, 0) == layout.checkpoint(4)
    with pytest.raises(LineError, match=r"cycle 1 has not ended \(its newest checkpoint, u00000008, is in cycle 1 at update 8\)"):
        find_cycle_end(layout, 1)


def test_branch_from_a_cycle_end(trunk: Path, data_template: Path, tmp_path: Path) -> None:
    parent = RunConfig.load(trunk / "run.json")
    cycle_ends = {name: reason for name, reason in kept(trunk).items() if reason.startswith("cycle-end")}
    fork_name = next(name for name, reason in cycle_ends.items() if reason == "cycle-end 0")
    fork = load_checkpoint(trunk / "checkpoints" / fork_name)
    WandbRunState(run_id="trunk-run", acknowledged_step=fork.update + 3).save(trunk / "wandb_run.json")
    branch_data = copy_data_line(data_template, tmp_path / "b1data")
    request = BranchRequest(tmp_path / "b1", trunk, 0, "decay:1024,long:512", branch_data, long_seq_len=LONG)
    result = branch_line(request)

    # The first checkpoint: the fork's tensors (hard links), the branch's own state and run.json.
    first = tmp_path / "b1" / "checkpoints" / fork_name
    assert read_latest(first.parent) == fork_name and result.fork_update == fork.update
    verify_checkpoint(first)
    assert result.hard_linked
    assert os.stat(first / "model.safetensors").st_ino == os.stat(fork.directory / "model.safetensors").st_ino
    copy = load_checkpoint(first)
    assert all(torch.equal(copy.weights[name], fork.weights[name]) for name in fork.weights)
    fork_tokens = fork.state["position"]["tokens_trained"]
    assert copy.state["position"] == {"update": fork.update, "tokens_trained": fork_tokens,
                                      "stage": 0, "stage_tokens": 0, "cycle": 0, "sample": 0}  # fmt: skip
    assert copy.state["kept"] == "branch-start" and copy.state["rows"] == 0

    # The schedule: the trunk's up to the fork, then a decay to 0 at the plan's end.
    branch = RunConfig.load(tmp_path / "b1" / "run.json")
    assert branch.data.line == str(branch_data.absolute())
    assert [(s.name, s.seq_len, s.tokens) for s in branch.plan] == [
        ("decay", SEQ_LEN, 1024),
        ("long", LONG, 512),
    ]
    assert sorted(entry.seq_len for entry in branch.lengths) == [SEQ_LEN, LONG]
    for tokens in (0, 100, 511, 512, fork_tokens // 2, fork_tokens):
        assert learning_rate(branch, tokens) == pytest.approx(learning_rate(parent, tokens), abs=1e-15)
    assert learning_rate(branch, fork_tokens + 768) == pytest.approx(learning_rate(parent, fork_tokens) / 2)
    assert learning_rate(branch, fork_tokens + 1536) == 0.0
    assert copy.run_json == (tmp_path / "b1" / "run.json").read_bytes()

    # The parent's record and the W&B plan.
    [record] = read_branches(LineLayout(trunk))
    assert (
        record["line"] == str(tmp_path / "b1")
        and record["at_cycle"] == 0
        and record["at_update"] == fork.update
    )
    pending = WandbRunState.load(tmp_path / "b1" / "wandb_run.json").pending
    assert pending is not None and pending.kind == "fork" and pending.at_update == fork.update
    assert pending.parent_run_id == "trunk-run" and pending.parent_rows == str(
        (trunk / "rows.jsonl").resolve()
    )

    # The branch trains from the fork: update numbers and the schedule carry on.
    assert Trainer(tmp_path / "b1", stop_at=fork.update + 3, echo=None).run() == 0
    rows = rows_without_wall_clock(tmp_path / "b1" / "rows.jsonl")
    assert [row["update"] for row in rows] == [fork.update + 1, fork.update + 2, fork.update + 3]
    assert rows[0]["stage"] == "decay" and rows[0]["lr"] == pytest.approx(learning_rate(branch, fork_tokens))
    assert rows[1]["lr"] < rows[0]["lr"]

    # Its W&B run forks the trunk's at the fork update, then carries the branch's own rows.
    server = SimulatedServer(history={"trunk-run": history_of(trunk / "rows.jsonl")})
    session(tmp_path / "b1", RecordingBackend(server), ids=lambda: "b1-run")
    inits = [call[1] for call in server.calls if call[0] == "init"]
    assert inits[0]["fork"] == RunPoint("trunk-run", fork.update)
    assert server.steps("b1-run") == list(range(1, fork.update + 4))
    assert server.losses("b1-run")[-3:] == [row["loss"] for row in rows]


def test_a_branch_says_the_tokens_it_trains_and_trains_them(
    trunk: Path, data_template: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A stage trains whole rows: `decay:100` at 32 trains 128 tokens. The command's output and
    run.json say so, the decay ends there, and the branch trains exactly that much."""
    code = cli_main(["branch", str(tmp_path / "b"), "--from", str(trunk), "--at-cycle", "0",
                     "--plan", "decay:100,long:100", "--data", str(copy_data_line(data_template, tmp_path / "d")),
                     "--long-seq-len", str(LONG)])  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == ("plan: decay at 32 for 128 tokens (100 asked, rounded up to 4 whole rows of 32); "
                      "long at 64 for 128 tokens (100 asked, rounded up to 2 whole rows of 64)")  # fmt: skip
    branch = RunConfig.load(tmp_path / "b" / "run.json")
    assert [(stage.name, stage.seq_len, stage.tokens) for stage in branch.plan] == [
        ("decay", SEQ_LEN, 128), ("long", LONG, 128),
    ]  # fmt: skip
    fork_tokens = load_checkpoint(find_cycle_end(LineLayout(trunk), 0)).state["position"]["tokens_trained"]
    assert learning_rate(branch, fork_tokens + 255) > 0.0 and learning_rate(branch, fork_tokens + 256) == 0.0
    assert Trainer(tmp_path / "b", echo=None).run() == 0  # to the plan's end
    rows = rows_without_wall_clock(tmp_path / "b" / "rows.jsonl")
    assert [(row["stage"], row["tokens"]) for row in rows][-1] == ("long", fork_tokens + 256)


def test_the_branch_start_checkpoint_has_every_state_key_the_trainer_writes(trunk: Path, data_template: Path,
                                                                          tmp_path: Path) -> None:
    """The branch's first checkpoint is read as the trainer's are: the same state keys (the W&B run
    it belongs to: none yet, null with W&B disabled as here; the ranks that wrote its tensors), plus
    where it was branched from. Found missing `wandb` and `degree` in a walkthrough."""
    fork = find_cycle_end(LineLayout(trunk), 0)
    branch_line(BranchRequest(tmp_path / "b1", trunk, 0, "decay:1024", copy_data_line(data_template, tmp_path / "d")))
    fork_state = load_checkpoint(fork).state
    state = load_checkpoint(tmp_path / "b1" / "checkpoints" / fork.name).state
    assert set(state) == set(fork_state) | {"branched_from"}
    assert state["wandb"] is None and state["degree"] == fork_state["degree"]


def test_branch_refusals(
    trunk: Path, data_template: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    data = copy_data_line(data_template, tmp_path / "bdata")
    with pytest.raises(LineError, match=r"the trunk's data line has 3 cycles \(0 to 2\), so cycle 7 never ends on it; the last cycle a branch "
                       "can fork at is 2"):
        branch_line(BranchRequest(tmp_path / "b", trunk, 7, "decay:1024", data))
    with pytest.raises(LineError, match="the long length must exceed the training length 32, got 32"):
        branch_line(BranchRequest(tmp_path / "b", trunk, 0, "long:1024", data, long_seq_len=SEQ_LEN))
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    with pytest.raises(LineError, match="already exists"):
        branch_line(BranchRequest(tmp_path / "taken", trunk, 0, "decay:1024", data))
    other = make_data_line(tmp_path / "other", files=3, prepare=1)  # another tokenizer
    with pytest.raises(LineError, match="its tokenizer differs"):
        branch_line(BranchRequest(tmp_path / "b", trunk, 0, "decay:1024", other))
    shutil.rmtree(data / "val" / f"T{SEQ_LEN}")  # its trainer would refuse to start: refused here
    with pytest.raises(LineError, match=f"bdata/data: no held-out rows of length {SEQ_LEN} for this line's"):
        branch_line(BranchRequest(tmp_path / "b", trunk, 0, "decay:1024", data))
    assert not (tmp_path / "b").exists() and not (trunk / "branches.json").exists()
    code = cli_main(["branch", str(tmp_path / "b"), "--from", str(trunk), "--at-cycle", "9",
                     "--plan", "decay:1e3", "--data", str(data)])  # fmt: skip
    assert code == 2 and "nsconsole: " in capsys.readouterr().err


def test_the_expected_fork_point_of_a_cycle_end_is_close_to_the_real_one(trained_trunk: Path) -> None:
    """What a branch asked for before its cycle ends is checked against (engine/ops/fork_point.py)."""
    line = trained_trunk / "line"
    config = RunConfig.load(line / "run.json")
    data = open_data_line(trained_trunk / "data")
    real = {reason: load_checkpoint(line / "checkpoints" / name).state["position"]["tokens_trained"]
            for name, reason in kept(line).items()}  # fmt: skip
    for cycle in (0, 1):
        expected = expected_fork_position(LineLayout(line), config, data, {}, cycle)["tokens_trained"]
        assert expected == (cycle + 1) * data.cycle_tokens
        # Cycles hold whole documents and windows: a few tokens more or fewer than nominal.
        assert abs(expected - real[f"cycle-end {cycle}"]) < 0.02 * data.cycle_tokens


def test_rollback_then_retrain_reproduces_the_rows(trunk: Path, tmp_path: Path) -> None:
    original = rows_without_wall_clock(trunk / "rows.jsonl")
    layout_latest = read_latest(trunk / "checkpoints")
    WandbRunState(run_id="run-1", acknowledged_step=len(original)).save(trunk / "wandb_run.json")
    data_path = Path(RunConfig.load(trunk / "run.json").data.line)
    data_line = open_data_line(data_path)
    assert delete_consumed_shards(data_line)  # as the preparer does: the consumed cycles' shards are gone

    cycle = load_checkpoint(trunk / "checkpoints" / "u00000010").state["position"]["cycle"]
    history = history_of(trunk / "rows.jsonl")  # what the W&B run holds
    result = rollback_line(trunk, 10)  # a rolling checkpoint
    assert result.to_update == 10 and result.rows_now == 10
    assert read_latest(trunk / "checkpoints") == "u00000010"
    assert rows_without_wall_clock(trunk / "rows.jsonl") == original[:10]
    assert result.rows_kept is not None and rows_without_wall_clock(result.rows_kept) == original[10:]  # set aside
    assert layout_latest in result.set_aside and (trunk / "checkpoints" / layout_latest).is_dir()
    state = WandbRunState.load(trunk / "wandb_run.json")
    assert state.pending is not None and state.pending.kind == "rewind" and state.pending.at_update == 10
    assert result.reopened_cycles == list(range(cycle, cycle + len(result.reopened_cycles)))
    assert all(not data_line.is_consumed(index) for index in result.reopened_cycles)
    for index in result.reopened_cycles:  # what the line's preparer does next: rebuild from the manifests
        prepare_cycle(data_line, index)

    # The next start rewinds the W&B run to update 10 (the abandoned updates leave its history).
    server = SimulatedServer(history={"run-1": history})
    session(trunk, RecordingBackend(server))
    assert server.steps("run-1") == list(range(1, 11))
    assert [call[1]["rewind"] for call in server.calls if call[0] == "init"] == [RunPoint("run-1", 10)]

    assert Trainer(trunk, echo=None).run() == 0
    assert rows_without_wall_clock(trunk / "rows.jsonl") == original  # the same updates, bit for bit
    session(trunk, RecordingBackend(server))
    assert server.steps("run-1") == [row["update"] for row in original]
    # The abandoned continuation is gone, replaced by the new one's checkpoints.
    for directory in list_checkpoints(trunk / "checkpoints"):
        verify_checkpoint(directory)
        assert load_checkpoint(directory).state["rows"] <= len(original)


def test_rollback_refusals(trunk: Path, capsys: pytest.CaptureFixture) -> None:
    (trunk / "heartbeat").write_text(
        json.dumps({"time": 0, "update": 9, "stage": "training", **this_process_as_trainer()})
    )
    with pytest.raises(LineError, match=rf"its trainer is running \(pid {os.getpid()}\); stop the line"):
        rollback_line(trunk, 10)
    (trunk / "heartbeat").write_text(
        json.dumps({"time": 0, "update": 9, "stage": "stopped", "pid": os.getpid()})
    )
    with pytest.raises(LineError, match="u00000004: no such checkpoint"):
        rollback_line(trunk, 4)
    latest = read_latest(trunk / "checkpoints")
    with pytest.raises(LineError, match="not before the line's latest checkpoint"):
        rollback_line(trunk, int(latest[1:]))
    assert read_latest(trunk / "checkpoints") == latest
    rows = (trunk / "rows.jsonl").read_bytes()
    (trunk / "rows.jsonl").write_bytes(rows[:100])  # rows lost: the checkpoint's rows are not there
    with pytest.raises(LineError, match="does not begin with the 10 rows the checkpoint counts"):
        rollback_line(trunk, 10)
    assert read_latest(trunk / "checkpoints") == latest and not list(trunk.glob("rows.rolledback-*"))
    assert cli_main(["rollback", str(trunk), "--to", "3"]) == 2
    assert "u00000003: no such checkpoint (the line has u00000000, u00000010" in capsys.readouterr().err


def test_a_rollback_past_a_branch_point_says_so_from_the_console_and_the_command_line(
    trunk: Path, data_template: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The branch keeps its own checkpoints and rows; the trunk rows it grew from are set aside with
    the rest (found in a console walkthrough: the confirmation said nothing of the branch)."""
    fork_name = next(name for name, reason in kept(trunk).items() if reason == "cycle-end 0")
    branch = tmp_path / "b1"
    branch_line(BranchRequest(branch, trunk, 0, "decay:1024", copy_data_line(data_template, tmp_path / "b1data")))
    fork_update = load_checkpoint(trunk / "checkpoints" / fork_name).update
    said = f"{branch} (forked at update {fork_update})"
    view = LineView("trunk", trunk)
    view.apply_rows(rows_without_wall_clock(trunk / "rows.jsonl"), 0)
    earlier = max(update for update in map(update_of, list_checkpoints(trunk / "checkpoints")) if update < fork_update)
    before, after = (CheckpointInfo(update, f"u{update:08d}", None, False, None) for update in (earlier, fork_update))
    assert said in rollback_consequences(view, before) and "Branches forked after it" not in rollback_consequences(view, after)
    capsys.readouterr()
    assert cli_main(["rollback", str(trunk), "--to", str(earlier)]) == 0
    out = capsys.readouterr().out
    assert f"branches forked after update {earlier} keep their own checkpoints and rows" in out and said in out
