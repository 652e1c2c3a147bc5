"""bench/gpu_peers.py end to end on the CPU: the ceiling, a plain GPT and its project peer, each in
its own process, and the rows a user reads (the H200 run is the lead's: bench/RESULTS.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "bench" / "gpu_peers.py"
sys.path.insert(0, str(ROOT / "bench"))

from gpu_peers import PLAIN_SHAPES, plain_flops_per_token  # noqa: E402


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)  # fmt: skip


@pytest.mark.slow
def test_a_plain_gpt_and_its_peer_give_rows_with_ratios_side_by_side(tmp_path: Path) -> None:
    out = tmp_path / "rows.jsonl"
    done = run_script("--device", "cpu", "--models", "transformer-tiny,plain-gpt-tiny", "--seq-lens", "128",
                      "--rows", "2", "--updates", "1", "--warmup", "1", "--yardstick", "plain-gpt-tiny",
                      "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert rows == [json.loads(line) for line in out.read_text().splitlines()]
    # The peer is measured first, whatever order --models gave.
    plain, transformer = rows
    assert (plain["model"], transformer["model"]) == ("plain-gpt-tiny", "transformer-tiny")
    for row in rows:
        assert row["error"] is None and row["tokens_per_s"] > 0 and row["device"] == "cpu"
        assert (row["seq_len"], row["rows"], row["accum"], row["recompute"]) == (128, 2, 1, "none")
        assert row["mfu"] == pytest.approx(
            row["flops_per_token"] * row["tokens_per_s"] / (row["matmul_tflops"] * 1e12)
        )
        assert row["peak_mem_gib"] is None  # no CUDA memory on a CPU
    assert plain["parameters"] == 28_832 and plain["peer"] is None and plain["ratio_to_plain_gpt"] == 1.0
    assert plain["flops_per_token"] == plain_flops_per_token(PLAIN_SHAPES["plain-gpt-tiny"], 128)
    assert transformer["parameters"] == 33_024 and transformer["peer"] == "plain-gpt-tiny"
    expected = transformer["tokens_per_s"] / plain["tokens_per_s"]
    assert transformer["ratio_to_peer"] == pytest.approx(expected)
    assert transformer["ratio_to_plain_gpt"] == pytest.approx(expected)
    assert "matmul ceiling on cpu" in done.stderr and "2/2 transformer-tiny at 128" in done.stderr


def test_an_unknown_model_is_one_line_naming_it() -> None:
    done = run_script("--models", "plain-gpt,transformer-3b", "--device", "cpu")
    assert done.returncode == 2 and done.stdout == ""
    assert "unknown model 'transformer-3b'" in done.stderr.splitlines()[-1]
