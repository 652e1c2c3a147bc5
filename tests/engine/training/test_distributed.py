"""One line over several processes (torchrun, gloo, on the CPU) against the same line in one process.

An N-rank update deals the update's micro-batches to the ranks in contiguous runs and sums the
ranks' flat gradients: each micro-batch's gradient is the 1-rank one bit for bit, and only the
order in which they are added differs. With two micro-batches on two ranks that order does not
matter (a + b == b + a): the lines are equal bit for bit (asserted). With four micro-batches on
three ranks the sum is (g1 + g2) + g3 + g4 in ring order instead of ((g1 + g2) + g3) + g4:
measured over 12 updates of transformer-tiny, losses within a relative 8.6e-8, gradient norms
1.4e-9, weights within 3.4e-7 absolute; the tests allow `RELATIVE_TOLERANCE` / `ABSOLUTE_TOLERANCE`.

`parallel.shard: fsdp` (FSDP2, each rank holding the dim-0 chunk of every parameter) reduce-scatters
the same sum, so its micro-batch gradients are the 1-rank ones too; what differs is the global norm,
now summed from every rank's chunk (float64 sums of squares added across ranks), and with it the
clip. Measured over 12 updates of transformer-tiny: at degree 2 (two micro-batches) losses, weights
and moments equal bit for bit, gradient norms within a relative 1.0e-15; at degree 3 (four
micro-batches, two ranks running an idle one) losses within a relative 8.6e-8, gradient norms
3.7e-9, weights within 2.3e-7 and moments 9.3e-10 absolute: the same tolerances hold. Checkpoints
saved by fsdp ranks continue at degree 1 and under `none`, and back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import REPOSITORY
from helpers.lines import copy_data_line, data_template_fixture, make_line

from engine.checkpoints.format import read_latest, verify_line_checkpoints
from engine.checkpoints.tensors import load_checkpoint
from engine.config.run import ParallelConfig, RunConfig
from engine.errors import ConfigError
from engine.models.build import build_model
from engine.supervisor.child import group_exit
from engine.training.distributed import refuse_written_state
from engine.training.trainer import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

data_template = data_template_fixture()

RELATIVE_TOLERANCE = 1e-5
"""Losses, gradient norms, weights and moments of an N-rank line against the 1-rank line (float32)."""
ABSOLUTE_TOLERANCE = 1e-6
"""For weights and moments near zero."""

UPDATES = 12


def torchrun_trainer(line: Path, stop_at: int, nproc: int = 2) -> subprocess.CompletedProcess[str]:
    """The line's trainer as `nproc` ranks under torchrun (gloo), as the supervisor starts it."""
    environment = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(REPOSITORY))
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        "--max-restarts=0", "-m", "engine.training.main", str(line), "--parent", str(os.getpid()),
        "--stop-at", str(stop_at),
    ]  # fmt: skip
    return subprocess.run(argv, cwd=REPOSITORY, env=environment, capture_output=True, text=True, timeout=300)


def set_degree(line: Path, degree: int, shard: str = "none") -> None:
    document = json.loads((line / "run.json").read_text())
    document["parallel"].update(degree=degree, shard=shard)
    RunConfig.from_dict(document).save(line / "run.json")


def rows(line: Path) -> list[dict]:
    return [json.loads(text) for text in (line / "rows.jsonl").read_text().splitlines()]


def assert_close_lines(line: Path, reference: Path) -> None:
    """The same updates, positions and losses (to RELATIVE_TOLERANCE), and the same weights and moments."""
    mine, theirs = rows(line), rows(reference)
    assert [row["update"] for row in mine] == [row["update"] for row in theirs]
    for row, their in zip(mine, theirs):
        assert row["tokens"] == their["tokens"] and row["cycle"] == their["cycle"]
        assert row["loss"] == pytest.approx(their["loss"], rel=RELATIVE_TOLERANCE), row["update"]
        assert row["grad_norm"] == pytest.approx(their["grad_norm"], rel=RELATIVE_TOLERANCE), row["update"]
    a = load_checkpoint(line / "checkpoints" / read_latest(line / "checkpoints"))
    b = load_checkpoint(reference / "checkpoints" / read_latest(reference / "checkpoints"))
    assert a.update == b.update and a.state["position"] == b.state["position"]
    for part in ("weights", "optimizer"):
        for key, tensor in getattr(b, part).items():
            torch.testing.assert_close(getattr(a, part)[key], tensor, rtol=RELATIVE_TOLERANCE, atol=ABSOLUTE_TOLERANCE)


def one_process_line(root: Path, data_template: Path, **changes: object) -> Path:
    """The line in one process, UPDATES updates."""
    line = make_line(root, copy_data_line(data_template, root), **changes)
    assert Trainer(line, stop_at=UPDATES, echo=None).run() == 0
    return line


@pytest.fixture
def reference(tmp_path: Path, data_template: Path) -> Path:
    return one_process_line(tmp_path / "one", data_template)


@pytest.mark.parametrize(("degree", "micro_batch_rows"), [(2, 8), (3, 4)])
def test_ranks_train_the_one_rank_line(tmp_path: Path, data_template: Path, degree: int, micro_batch_rows: int) -> None:
    shape = {"lengths": [{"seq_len": 32, "micro_batch_rows": micro_batch_rows}], "validation.every_updates": 5}
    reference = one_process_line(tmp_path / "one", data_template, **shape)
    changes = {**shape, "parallel.degree": degree}
    line = make_line(tmp_path / "group", copy_data_line(data_template, tmp_path / "group"), **changes)
    done = torchrun_trainer(line, UPDATES, nproc=degree)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_close_lines(line, reference)
    if degree == 2:  # two micro-batches on two ranks: the same sums, bit for bit
        assert [row["loss"] for row in rows(line)] == [row["loss"] for row in rows(reference)]
        assert [row["grad_norm"] for row in rows(line)] == [row["grad_norm"] for row in rows(reference)]
    # Validation: every rank's share of the held-out rows, one reading.
    for update in (5, 10):
        mine, theirs = rows(line)[update - 1], rows(reference)[update - 1]
        for key in [key for key in theirs if key.startswith("val_32/")]:
            assert mine[key] == pytest.approx(theirs[key], rel=RELATIVE_TOLERANCE), key
    # Rank 0 wrote the line's records; the others only their own log and heartbeat.
    assert verify_line_checkpoints(line) == []
    latest = load_checkpoint(line / "checkpoints" / read_latest(line / "checkpoints"))
    assert latest.state["degree"] == degree
    assert "validation at update 10" in (line / "run.log").read_text()
    other = (line / "ranks" / "rank1.log").read_text()
    assert "new line: transformer-tiny" in other and "update      1" not in other
    assert (line / "ranks" / "rank1.heartbeat").exists()
    assert group_exit(line) == 0


@pytest.mark.parametrize(("first", "then"), [(2, 1), (1, 2)])
def test_a_checkpoint_saved_at_one_degree_continues_at_another(
    tmp_path: Path, data_template: Path, reference: Path, first: int, then: int
) -> None:
    line = make_line(tmp_path / "line", copy_data_line(data_template, tmp_path / "line"), **{"parallel.degree": first})
    for degree, stop_at in ((first, UPDATES // 2), (then, UPDATES)):
        set_degree(line, degree)
        if degree == 1:
            assert Trainer(line, stop_at=stop_at, echo=None).run() == 0
        else:
            done = torchrun_trainer(line, stop_at)
            assert done.returncode == 0, done.stderr[-3000:]
    saved = load_checkpoint(line / "checkpoints" / "u00000006")
    assert saved.state["degree"] == first
    assert verify_line_checkpoints(line) == []
    assert_close_lines(line, reference)


def test_a_degree_above_one_needs_torchrun(tmp_path: Path, data_template: Path) -> None:
    line = make_line(tmp_path / "two", copy_data_line(data_template, tmp_path / "two"), **{"parallel.degree": 2})
    with pytest.raises(ConfigError, match=r"parallel.degree is 2, but this trainer runs alone; start the line with"):
        Trainer(line, echo=None).run()


def test_a_degree_that_differs_from_torchrun_s_is_refused(tmp_path: Path, data_template: Path) -> None:
    line = make_line(tmp_path / "two", copy_data_line(data_template, tmp_path / "two"), **{"parallel.degree": 2})
    done = torchrun_trainer(line, 2, nproc=1)
    assert done.returncode != 0
    assert "parallel.degree is 2, but torchrun started 1 processes" in done.stderr
    assert group_exit(line) == 2  # TrainerExitCode.LINE_ERROR, for the supervisor


@pytest.mark.parametrize(("degree", "micro_batch_rows"), [(2, 8), (3, 4)])
def test_fsdp_ranks_train_the_one_rank_line(tmp_path: Path, data_template: Path, degree: int, micro_batch_rows: int) -> None:
    shape = {"lengths": [{"seq_len": 32, "micro_batch_rows": micro_batch_rows}], "validation.every_updates": 5}
    reference = one_process_line(tmp_path / "one", data_template, **shape)
    changes = {**shape, "parallel.degree": degree, "parallel.shard": "fsdp"}
    line = make_line(tmp_path / "group", copy_data_line(data_template, tmp_path / "group"), **changes)
    done = torchrun_trainer(line, UPDATES, nproc=degree)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_close_lines(line, reference)
    if degree == 2:  # each rank's micro-batch gradient, summed once: the same losses, bit for bit
        assert [row["loss"] for row in rows(line)] == [row["loss"] for row in rows(reference)]
        latest = load_checkpoint(line / "checkpoints" / read_latest(line / "checkpoints"))
        assert latest.state["degree"] == 2
    # Validation with the layers gathered on every rank (rank 0 probes and samples alone).
    for update in (5, 10):
        mine, theirs = rows(line)[update - 1], rows(reference)[update - 1]
        for key in [key for key in theirs if key.startswith("val_32/")]:
            assert mine[key] == pytest.approx(theirs[key], rel=RELATIVE_TOLERANCE), key
        assert [key for key in mine if key.startswith("train/grad_norm/")] == [
            key for key in theirs if key.startswith("train/grad_norm/")
        ]
        for key in [key for key in theirs if key.startswith("train/grad_norm/")]:
            assert mine[key] == pytest.approx(theirs[key], rel=RELATIVE_TOLERANCE), key
        # The optimizer's readings are the whole model's, not rank 0's shard.
        opt_keys = [key for key in theirs if key.startswith("opt/")]
        assert opt_keys and opt_keys == [key for key in mine if key.startswith("opt/")]
        for key in opt_keys:
            assert mine[key] == pytest.approx(theirs[key], rel=RELATIVE_TOLERANCE, abs=ABSOLUTE_TOLERANCE), key
    assert f"the model's 2 layers and its root sharded over {degree} ranks (FSDP2); eager engine" in (
        line / "run.log"
    ).read_text()
    assert verify_line_checkpoints(line) == []
    assert group_exit(line) == 0


@pytest.mark.parametrize(("first", "then"), [(("fsdp", 2), ("none", 1)), (("none", 2), ("fsdp", 2))])
def test_a_checkpoint_continues_between_fsdp_and_whole_state(
    tmp_path: Path, data_template: Path, reference: Path, first: tuple[str, int], then: tuple[str, int]
) -> None:
    line = make_line(tmp_path / "line", copy_data_line(data_template, tmp_path / "line"))
    for (shard, degree), stop_at in ((first, UPDATES // 2), (then, UPDATES)):
        set_degree(line, degree, shard)
        if degree == 1:
            assert Trainer(line, stop_at=stop_at, echo=None).run() == 0
        else:
            done = torchrun_trainer(line, stop_at, nproc=degree)
            assert done.returncode == 0, done.stderr[-3000:]
    saved = load_checkpoint(line / "checkpoints" / "u00000006")
    assert saved.state["degree"] == first[1]
    assert verify_line_checkpoints(line) == []
    assert_close_lines(line, reference)


def test_fsdp_at_degree_one_trains_as_none(tmp_path: Path, data_template: Path, reference: Path) -> None:
    line = make_line(tmp_path / "line", copy_data_line(data_template, tmp_path / "line"), **{"parallel.shard": "fsdp"})
    assert Trainer(line, stop_at=UPDATES, echo=None).run() == 0
    assert "parallel.shard fsdp at degree 1: nothing to shard; the line trains as none" in (line / "run.log").read_text()
    assert [row["loss"] for row in rows(line)] == [row["loss"] for row in rows(reference)]


def test_fsdp_with_a_moving_average_is_refused(tmp_path: Path, data_template: Path) -> None:
    changes = {"parallel.degree": 2, "parallel.shard": "fsdp", "ema": {"horizon_tokens": 4096, "from_tokens": 0}}
    line = make_line(tmp_path / "two", copy_data_line(data_template, tmp_path / "two"), **changes)
    done = torchrun_trainer(line, 2)
    assert done.returncode != 0
    assert "parallel.shard fsdp does not keep the moving average (ema) yet" in done.stderr
    assert group_exit(line) == 2  # TrainerExitCode.LINE_ERROR: the supervisor does not relaunch it


def test_an_unknown_shard_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^run.json: parallel.shard must be one of none, fsdp, got 'zero3'$"):
        ParallelConfig(degree=2, shard="zero3").validate()


def test_a_model_that_writes_state_in_its_forward_trains_at_degree_1_only() -> None:
    """The trainer's and the bench's rule: PSSA's banks are written from each rank's own rows."""
    pssa, transformer = build_model("pssa-tiny"), build_model("transformer-tiny")
    with pytest.raises(ConfigError, match=r"run.json: parallel.degree 2: pssa-tiny keeps state .* degree 1 only"):
        refuse_written_state(pssa, 2, "pssa-tiny", "run.json")
    refuse_written_state(pssa, 1, "pssa-tiny", "run.json")
    refuse_written_state(transformer, 2, "transformer-tiny", "run.json")

