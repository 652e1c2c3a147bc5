"""`nsconsole bench` under torchrun (gloo, on the CPU) and bench/gpu_scaling.py, which launches it.

The group trains as the trainer's ranks do: each of N ranks trains its `rows x accum` of the
group's N x rows x accum rows, and the gradient is summed across the ranks. So two ranks of 2 x 1
rows train the update a degree-1 bench of 2 x 2 rows trains on the same windows (bench_shape
draws the group's windows from one seed), the same two micro-batches, and with two micro-batches
the sum's order does not matter (a + b == b + a; tests/engine/training/test_distributed.py): the
loss after the timed updates equals degree 1's bit for bit, under `none` and under FSDP2 alike. A
group that did not sum its gradients would step each rank on its own half and read another loss.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import REPOSITORY

from nsconsole.cli import main

pytestmark = pytest.mark.slow

MODEL = "transformer-tiny"
SHAPE = ["--model", MODEL, "--device", "cpu", "--seq-len", "32", "--updates", "2", "--warmup", "1"]
LAUNCH_TIMEOUT = 120


def environment() -> dict[str, str]:
    """One intra-op thread in every rank (at every degree: the same arithmetic); the repository
    importable."""
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(REPOSITORY))


def torchrun_bench(nproc: int, *arguments: str) -> dict[str, Any]:
    """`nsconsole bench` as `nproc` ranks under torchrun: the one JSON row it prints (rank 0's)."""
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        "--max-restarts=0", "-m", "nsconsole", "bench", *SHAPE, *arguments,
    ]  # fmt: skip
    done = subprocess.run(argv, cwd=REPOSITORY, env=environment(), capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 1, done.stdout  # rank 0 alone prints
    return json.loads(lines[0])


@pytest.fixture(scope="module")
def one_rank() -> dict[str, Any]:
    """Degree 1 (torchrun with one process) over the 2 x 2 rows the two-rank runs deal in halves."""
    return torchrun_bench(1, "--rows", "2", "--accum", "2")


def assert_group_row(row: dict[str, Any], shard: str) -> None:
    assert (row["degree"], row["shard"], row["engine"]) == (2, shard, "eager")
    assert (row["rows"], row["accum"]) == (2, 1)  # each rank's
    assert row["tokens_per_s"] == pytest.approx(2 * 2 * 1 * 32 / row["seconds_per_update"])
    assert row["tokens_per_s_per_gpu"] == row["tokens_per_s"] / 2
    expected_mfu = row["flops_per_token"] * row["tokens_per_s_per_gpu"] / (row["matmul_tflops"] * 1e12)
    assert row["mfu"] == pytest.approx(expected_mfu)
    assert row["notes"] == []


def test_two_ranks_train_the_one_rank_update(one_rank: dict[str, Any]) -> None:
    assert (one_rank["degree"], one_rank["shard"], one_rank["notes"]) == (1, "none", [])
    assert one_rank["tokens_per_s_per_gpu"] == one_rank["tokens_per_s"]
    row = torchrun_bench(2, "--rows", "2")
    assert_group_row(row, "none")
    assert row["last_loss"] == one_rank["last_loss"]


def test_fsdp_ranks_train_the_one_rank_update(one_rank: dict[str, Any]) -> None:
    row = torchrun_bench(2, "--rows", "2", "--shard", "fsdp")
    assert_group_row(row, "fsdp")
    assert row["last_loss"] == one_rank["last_loss"]


def test_fsdp_at_degree_one_trains_as_none_and_says_so(one_rank: dict[str, Any]) -> None:
    row = torchrun_bench(1, "--rows", "2", "--accum", "2", "--shard", "fsdp")
    assert (row["degree"], row["shard"]) == (1, "fsdp")
    assert row["notes"] == ["shard fsdp at degree 1: nothing to shard; trained as none (as the trainer does)"]
    assert row["last_loss"] == one_rank["last_loss"]


def test_fsdp_without_torchrun_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["bench", *SHAPE, "--shard", "fsdp"]) == 2
    error = capsys.readouterr().err
    assert "--shard fsdp shards the model over a group's processes" in error and error.count("\n") == 1


def test_the_scaling_runner_gives_rows_efficiencies_and_error_rows(tmp_path: Path) -> None:
    out = tmp_path / "scaling.jsonl"
    argv = [
        sys.executable, str(REPOSITORY / "bench" / "gpu_scaling.py"), "--device", "cpu", "--models",
        f"{MODEL},no-such-model", "--shards", "none", "--degrees", "1,2", "--seq-len", "32", "--rows", "2",
        "--accum", "1", "--updates", "2", "--warmup", "1", "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(argv, cwd=tmp_path, env=environment(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert rows == [json.loads(line) for line in out.read_text().splitlines()]
    assert [(row["kind"], row["model"], row["degree"]) for row in rows] == [
        ("run", MODEL, 1), ("run", MODEL, 2), ("scaling", MODEL, 2),
        ("run", "no-such-model", 1), ("run", "no-such-model", 2), ("scaling", "no-such-model", 2),
    ]  # fmt: skip
    one, two, scaling, *failed = rows
    for row in (one, two):
        assert row["error"] is None and row["shard"] == "none" and row["tokens_per_s_per_gpu"] > 0
    efficiency = two["tokens_per_s_per_gpu"] / one["tokens_per_s_per_gpu"]
    assert scaling["scaling_efficiency"] == pytest.approx(efficiency)
    assert scaling["efficiency_per_doubling"] == pytest.approx(efficiency)  # one doubling
    assert scaling["meets_goal"] == (efficiency >= 0.9)
    for row in failed[:2]:
        assert "unknown preset 'no-such-model'" in row["error"] and "tokens_per_s" not in row
    assert failed[2]["scaling_efficiency"] is None and failed[2]["meets_goal"] is None
