"""`nsconsole bench` on the CPU: one JSON row whose figures hang together, and clear refusals."""

from __future__ import annotations

import json

import pytest
from helpers.lines import one_torch_thread

from engine.models.build import build_model
from nsconsole.cli import main


def test_bench_prints_one_consistent_json_row(capsys: pytest.CaptureFixture[str]) -> None:
    with one_torch_thread():
        arguments = ["--model", "transformer-tiny", "--seq-len", "16", "--rows", "2", "--accum", "2"]
        assert main(["bench", *arguments, "--updates", "2", "--profile"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["device"] == "cpu" and row["engine"] == "eager"
    assert row["tokens_per_s"] == pytest.approx(2 * 2 * 16 / row["seconds_per_update"])
    assert row["flops_per_token"] == build_model("transformer-tiny").flops_per_token(16)
    expected_mfu = row["flops_per_token"] * row["tokens_per_s"] / (row["matmul_tflops"] * 1e12)
    assert row["mfu"] == pytest.approx(expected_mfu)
    assert row["mfu"] > 0 and row["matmul_tflops"] > 0
    assert row["top_kernels"] and all(kernel["ms"] > 0 for kernel in row["top_kernels"])


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--model", "nope", "--seq-len", "8"], "unknown preset 'nope'"),
        (["--model", "transformer-tiny", "--seq-len", "0"], "--seq-len must be at least 1"),
        (["--model", "transformer-tiny", "--seq-len", "8", "--device", "tpu"], "--device must be"),
        (["--model", "ns-tiny", "--seq-len", "8", "--recompute", "most"], "--recompute must be one of"),
        (["--model", "transformer-tiny", "--seq-len", "8", "--recompute", "all"], "has no activation recomputation"),
        (["--model", "ns-tiny", "--seq-len", "8", "--override", "width=3"], "unknown key 'width'"),
        (["--model", "ns-tiny", "--seq-len", "8", "--override", "compile_scan=1"], "compile_scan must be true or false"),
    ],
)
def test_bench_refuses_bad_input_in_one_line(
    arguments: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", *arguments]) == 2
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1


def test_bench_times_an_ns_model_with_recomputation(capsys: pytest.CaptureFixture[str]) -> None:
    with one_torch_thread():
        arguments = ["--model", "ns-tiny", "--seq-len", "16", "--rows", "2", "--updates", "1", "--recompute", "all"]
        assert main(["bench", *arguments, "--device", "cpu", "--override", "n_layers=2"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["model"] == "ns-tiny" and row["recompute"] == "all" and row["tokens_per_s"] > 0
    assert row["overrides"] == {"n_layers": 2}
    assert row["parameters"] == build_model("ns-tiny", {"n_layers": 2}).num_parameters()
