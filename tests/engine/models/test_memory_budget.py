"""The memory estimate against torch's measured peak, the config checks, and the refusal of a line
that cannot fit, before anything is allocated (`check` prints the estimate)."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch
from helpers.lines import copy_data_line, data_template_fixture, make_line
from torch.distributed._tools.mem_tracker import MemTracker

from engine.config.run import RunConfig
from engine.errors import ConfigError
from engine.models.build import (
    build_model,
    checked_config,
    count_parameters,
    line_memory_estimate,
    refuse_unfit_memory,
)
from engine.models.memory_budget import (
    ACCURACY,
    activation_bytes,
    buffer_bytes,
    estimate_memory,
    floats_per_micro_batch,
    floats_per_token,
    memory_problem,
)
from engine.models.presets import family_of, preset_config
from engine.models.validation import MAX_LOOPS
from engine.ops.check import check_line
from engine.training.step import autocast_for
from engine.training.trainer import Trainer
from engine.units import GIB

TINY = ("transformer-tiny", "pssa-tiny", "ns-tiny")
LENGTHS = (16, 64)
"""Two lengths each: PSSA-tiny's chunk (16) and four chunks; the transformer's window is 32."""


def _estimated_activations(preset: str, rows: int, seq_len: int, device_type: str) -> float:
    config = checked_config(preset)
    return 4 * rows * seq_len * floats_per_token(family_of(preset), config, seq_len, device_type)


def _batch(preset: str, rows: int, seq_len: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    vocab = checked_config(preset).vocab_size
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (rows, seq_len + 1), generator=generator).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def _peak_beside_parameters(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> int:
    """Measured peak (MemTracker, CPU) of one training forward and backward, less the parameters
    and buffers: the activations, the gradients and the transients."""
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        loss, _ = model(tokens, targets)
        loss.sum().backward()
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    held = {str(kind).rsplit(".", 1)[-1]: size for kind, size in peak.items()}
    return held["Total"] - held["PARAM"] - held["BUFFER"]


@pytest.mark.parametrize("preset", TINY)
def test_the_estimate_is_within_its_accuracy_of_the_measured_cpu_peak(preset: str) -> None:
    for seq_len in LENGTHS:
        torch.manual_seed(0)
        model = build_model(preset)
        measured = _peak_beside_parameters(model, *_batch(preset, 2, seq_len, "cpu"))
        ratio = _estimated_activations(preset, 2, seq_len, "cpu") / measured
        assert 1 / ACCURACY <= ratio <= ACCURACY, f"{preset} T{seq_len}: estimate / measured = {ratio:.2f}"


MEASURED_ON_CUDA = {
    # (preset, seq_len, rows, recompute): GiB beyond the state, the trainer's eager update, H100 80GB,
    # 2026-12-07 (`python bench/cuda_memory.py`, bench/RESULTS.md session 27).
    ("ns-2b", 4096, 1, "none"): 14.77, ("ns-2b", 4096, 2, "none"): 24.11,
    ("ns-2b", 4096, 1, "dendritic"): 10.55, ("ns-2b", 4096, 2, "dendritic"): 17.04,
    ("ns-2b", 4096, 1, "all"): 4.02, ("ns-2b", 4096, 2, "all"): 6.59,
    ("ns-1p3b", 4096, 1, "none"): 11.42, ("ns-1p3b", 4096, 2, "none"): 18.90,
    ("ns-1p3b", 4096, 1, "dendritic"): 8.25, ("ns-1p3b", 4096, 2, "dendritic"): 13.44,
    ("ns-2b", 16384, 1, "dendritic"): 30.48,
    ("transformer-2b", 4096, 1, "none"): 14.94, ("transformer-2b", 4096, 2, "none"): 24.36,
    ("transformer-1p3b", 4096, 1, "none"): 11.06, ("transformer-1p3b", 4096, 2, "none"): 18.16,
    ("pssa-127m", 4096, 2, "none"): 7.88, ("pssa-127m", 4096, 4, "none"): 12.69,
    # Session 13 on the H200: the graph engine's 8 x 4K update, 88.2 GiB in all less the state.
    ("ns-2b", 4096, 8, "dendritic"): 88.2 - 1_993_992_320 * 16 / GIB,
}  # fmt: skip


@pytest.mark.parametrize(("preset", "seq_len", "rows", "recompute"), list(MEASURED_ON_CUDA))
def test_the_cuda_estimate_is_within_its_accuracy_of_what_the_gpu_measured(
    preset: str, seq_len: int, rows: int, recompute: str
) -> None:
    """The 2B models' CUDA estimate against the H100's measurements (bf16, chunked loss,
    recomputation): it used to be the CPU's fp32 formula, 3.6-16x what ns-2b keeps."""
    family, config = family_of(preset), checked_config(preset)
    estimate = activation_bytes(family, config, rows, seq_len, "cuda", recompute, count_parameters(preset))
    ratio = estimate / (MEASURED_ON_CUDA[preset, seq_len, rows, recompute] * GIB)
    assert 1 / ACCURACY <= ratio <= ACCURACY, f"{preset} {rows} x T{seq_len} {recompute}: {ratio:.2f}"


@pytest.mark.parametrize(
    ("preset", "rows", "recompute", "gpu_gib"),
    [("ns-1p3b", 4, "dendritic", 79.2), ("ns-2b", 4, "dendritic", 79.2), ("ns-2b", 8, "dendritic", 139.8),
     ("transformer-2b", 8, "none", 139.8)],
)  # fmt: skip
def test_a_2b_line_that_ran_on_the_gpu_is_not_refused(preset: str, rows: int, recompute: str, gpu_gib: float) -> None:
    """Shapes measured to run (ns-2b 8 x 4K dendritic at 88.2 GiB and transformer-2b 8 x 4K at 110.7
    on the H200, ns-2b 4 x 4K at 60.3 on the H100 80GB) pass the start's memory check; they were
    refused (ns-1p3b at 4 rows was, on the H100, by `bench/startup_gpu.py`'s trainer)."""
    estimate = estimate_memory(
        family_of(preset), checked_config(preset), count_parameters(preset), {4096: [(rows, recompute)]},
        device_type="cuda",
    )  # fmt: skip
    assert memory_problem(estimate, int(gpu_gib * GIB), "run.json", "cuda:0") is None
    # Four times the rows without recomputation cannot fit, and is refused.
    bigger = estimate_memory(
        family_of(preset), checked_config(preset), count_parameters(preset), {4096: [(4 * rows, "none")]},
        device_type="cuda",
    )  # fmt: skip
    assert memory_problem(bigger, int(gpu_gib * GIB), "run.json", "cuda:0") is not None


@pytest.mark.cuda
@pytest.mark.parametrize("preset", TINY)
def test_the_estimate_bounds_the_measured_cuda_peak(preset: str) -> None:
    """On CUDA the estimate is within ACCURACY of the peak of a tiny preset's update as the trainer
    runs it (bf16 autocast, the chunked loss)."""
    device = torch.device("cuda")
    for seq_len in LENGTHS:
        torch.manual_seed(0)
        model = build_model(preset).cuda()
        tokens, targets = _batch(preset, 2, seq_len, "cuda")
        # One update first: what the first call allocates for good (cuBLAS's workspace, a kernel's
        # tables) is no activation, and at a tiny preset it is hundreds of times the activations.
        with autocast_for(device):
            loss, _ = model(tokens, targets)
        loss.sum().backward()
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with autocast_for(device):
            loss, _ = model(tokens, targets)
        loss.sum().backward()
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated() - before
        estimate = activation_bytes(family_of(preset), checked_config(preset), 2, seq_len, "cuda", "none",
                                    count_parameters(preset))  # fmt: skip
        ratio = estimate / measured
        print(f"{preset} T{seq_len}: estimate / measured = {ratio:.2f}")
        assert 1 / ACCURACY <= ratio <= 2 * ACCURACY, f"{preset} T{seq_len}: estimate / measured = {ratio:.2f}"
        del model, loss
        torch.cuda.empty_cache()


def _pssa_peak_activations(overrides: dict, rows: int, seq_len: int) -> int:
    """Measured peak of one pssa-1.5m training forward and backward, its banks full (every slot
    read), less the parameters, their gradients and the buffers: what the estimate's activations
    stand for (the state counts the gradients)."""
    torch.manual_seed(0)
    model = build_model("pssa-1.5m", overrides)
    with torch.no_grad():
        for block in model.blocks:
            block.bank.keys.normal_(std=0.1)
            block.bank.values.normal_()
            block.bank.slot_count.fill_(block.bank.capacity)
    tokens, targets = _batch("pssa-1.5m", rows, seq_len, "cpu")
    vocab = model.config.vocab_size
    parameters = sum(parameter.numel() for parameter in model.parameters())
    return _peak_beside_parameters(model, tokens % vocab, targets % vocab) - 4 * parameters


@pytest.mark.parametrize(
    ("overrides", "rows", "seq_len"),
    [
        ({}, 8, 64),  # the article's shape: the old formula overestimated it 2.5x
        ({"d_state": 64}, 4, 128),  # 2.5 d N a token: 4x over, a line that fits refused
        ({"mem_capacity": 8192, "mem_top_k": 0}, 4, 64),  # a whole-bank read: 3x under
        ({"mem_capacity": 16384}, 2, 256),  # the banks' per-chunk copies: 4x under
    ],
)
def test_the_pssa_estimate_follows_its_state_width_banks_and_reads(overrides: dict, rows: int, seq_len: int) -> None:
    config = checked_config("pssa-1.5m", overrides)
    estimated = estimate_memory("pssa", config, 0, {seq_len: rows}).largest[2]
    ratio = estimated / _pssa_peak_activations(overrides, rows, seq_len)
    assert 1 / ACCURACY <= ratio <= ACCURACY, f"{overrides} {rows}x{seq_len}: estimate / measured = {ratio:.2f}"


def test_pssa_banks_and_dreaming_record_count_beside_the_state() -> None:
    """The banks (key, value, 20 bytes of rule state a slot) and the dreaming record (S chunks of
    int64 tokens and targets, on the device and the host) are no parameters, and a large
    mem_capacity makes them GiBs."""
    config = checked_config("pssa-1.5m", {"mem_capacity": 10**6})
    torch.manual_seed(0)
    small = build_model("pssa-1.5m", {"mem_capacity": 4096})
    held = sum(buffer.numel() * buffer.element_size() for buffer in small.buffers())
    estimated = buffer_bytes("pssa", checked_config("pssa-1.5m", {"mem_capacity": 4096}))
    host_cache = 4096 * 64 * 2 * 8  # the dreaming cache's chunks once drained to the host
    assert held <= estimated <= held + host_cache + 2**20
    estimate = estimate_memory("pssa", config, 1_544_704, {64: 8})
    assert estimate.buffer_bytes == buffer_bytes("pssa", config) > 2 * GIB
    assert estimate.total_bytes == estimate.state_bytes + estimate.buffer_bytes + estimate.largest[2]
    assert "+ model buffers " in estimate.describe()
    assert buffer_bytes("transformer", checked_config("transformer-1.5m")) == 0


def test_state_and_activations_add_up() -> None:
    config = checked_config("pssa-1.5m")
    parameters = count_parameters("pssa-1.5m")
    assert parameters == 1_544_704  # counted on the meta device, nothing allocated
    plain = estimate_memory("pssa", config, parameters, {64: 8})
    with_ema = estimate_memory("pssa", config, parameters, {64: 8, 256: 2}, ema=True)
    assert plain.state_bytes == 16 * parameters and with_ema.state_bytes == 20 * parameters
    per_token = floats_per_token("pssa", config, 64)
    per_micro_batch = floats_per_micro_batch("pssa", config, 64)
    assert plain.activations == {64: (8, int(4 * (8 * 64 * per_token + per_micro_batch)))}
    assert plain.total_bytes == plain.state_bytes + plain.buffer_bytes + plain.activations[64][1]
    assert with_ema.largest[0] in (64, 256)
    # The NS pool read's biased softmax is materialised on the CPU only: quadratic there, not on CUDA.
    ns = checked_config("ns-tiny")
    growth_cpu = floats_per_token("ns", ns, 512, "cpu") - floats_per_token("ns", ns, 256, "cpu")
    assert growth_cpu == 2 * ns.attn_heads * 256 * 1 and floats_per_token("ns", ns, 512, "cuda") == floats_per_token(
        "ns", ns, 256, "cuda"
    )
    assert memory_problem(plain, plain.total_bytes, "run.json", "the CPU") is None
    # Refused only when even the lower end (state + activations / ACCURACY) does not fit.
    assert memory_problem(plain, plain.lower_bytes, "run.json", "the CPU") is None
    problem = memory_problem(plain, plain.lower_bytes - 1, "run.json", "the CPU")
    assert problem is not None and problem.startswith("run.json: training needs about ") and "\n" not in problem


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"depth": 33}, "depth must be in 1..32, got 33"),
        ({"loops": 0}, "loops must be positive, got 0"),
        ({"loops": MAX_LOOPS + 1}, f"loops must be in 1..{MAX_LOOPS}, got {MAX_LOOPS + 1}"),
        ({"tau_mem": math.nan}, "tau_mem must be finite, got nan"),
        ({"norm_eps": math.inf}, "norm_eps must be finite, got inf"),
        ({"ema_alpha": 1.5}, "ema_alpha must be in [0, 1], got 1.5"),
        ({"d_latent": 256.5}, "d_latent must be an integer, got 256.5"),
        ({"d_state": True}, "d_state must be an integer, got True"),
        ({"mem_top_k": 600}, "mem_top_k (600) exceeds mem_capacity (512): a read cannot pick more slots than a bank has"),
        ({"d_mem_key": 0}, "d_mem_key must be positive, got 0"),
    ],
)
def test_pssa_configs_the_article_refuses_are_refused_before_building(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_model("pssa-1.5m", overrides)
    assert str(info.value) == f"model.overrides: {message}"


def test_float_fields_of_every_family_must_be_finite() -> None:
    with pytest.raises(ConfigError, match=r"^model.overrides: init_std must be finite, got nan$"):
        build_model("ns-tiny", {"init_std": math.nan})
    with pytest.raises(ConfigError, match=r"^model.overrides: rope_base must be finite, got inf$"):
        build_model("transformer-tiny", {"rope_base": math.inf})


data_template = data_template_fixture()


def test_a_line_that_cannot_fit_is_refused_before_allocating_and_check_says_so(
    tmp_path: Path, data_template: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    line = make_line(tmp_path, copy_data_line(data_template, tmp_path))
    _, results = check_line(line, verify_checkpoints=False)
    memory = [result for result in results if result.message.startswith("memory: ")]
    assert len(memory) == 1 and memory[0].ok, memory
    assert "training needs about" in memory[0].message and "the CPU (available memory) has" in memory[0].message
    # A micro-batch of a million rows: terabytes of activations.
    big = make_line(tmp_path / "big", line.parent / "data", **{"lengths": [{"seq_len": 32, "micro_batch_rows": 10**6}]})
    _, results = check_line(big, verify_checkpoints=False)
    failed = [result.message for result in results if not result.ok]
    assert any(message.startswith("memory: training needs about") and "cannot fit" in message for message in failed)

    def no_model(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the model was built")

    monkeypatch.setattr("engine.training.trainer.build_model", no_model)
    with pytest.raises(ConfigError, match=r"run\.json: training needs about .* cannot fit .* nothing was allocated$"):
        Trainer(big, echo=None).run()


def test_a_pssa_line_whose_banks_cannot_fit_is_refused_before_allocating(
    tmp_path: Path, data_template: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A billion slots: the banks and the dreaming record alone are terabytes, though the
    parameters and a micro-batch are small. `check` fails it naming mem_capacity, and the trainer
    refuses it in one line before the model (whose buffers these are) is built."""
    changes = {"model.preset": "pssa-tiny", "model.overrides": {"vocab_size": 300, "mem_capacity": 10**9}}
    line = make_line(tmp_path, copy_data_line(data_template, tmp_path), **changes)
    _, results = check_line(line, verify_checkpoints=False)
    failed = [result.message for result in results if not result.ok and result.message.startswith("memory: ")]
    assert len(failed) == 1 and "+ model buffers " in failed[0], failed
    assert "lower model.overrides.mem_capacity" in failed[0] and "\n" not in failed[0]

    def no_model(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the model was built")

    monkeypatch.setattr("engine.training.trainer.build_model", no_model)
    with pytest.raises(ConfigError, match=r"run\.json: training needs about .* model buffers .* model\.overrides\.mem_capacity"):
        Trainer(line, echo=None).run()


def test_fsdp_shards_the_state_and_not_the_activations() -> None:
    """Under `parallel.shard: fsdp` a rank holds 1/degree of the weights, gradients and moments; its
    micro-batch's activations are its own, whole."""
    config = checked_config("pssa-1.5m")
    parameters = count_parameters("pssa-1.5m")
    whole = estimate_memory("pssa", config, parameters, {64: 8})
    sharded = estimate_memory("pssa", config, parameters, {64: 8}, shards=4)
    assert sharded.state_bytes == math.ceil(16 * parameters / 4) and sharded.activations == whole.activations
    assert "(1,544,704 parameters x 16 bytes over 4 ranks)" in sharded.describe()
    assert "over" not in whole.describe().split("+")[0]


def test_the_ranks_of_a_cpu_line_share_the_host_s_memory(
    tmp_path: Path, data_template: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every rank of a CPU line at parallel.degree 2 holds the whole state and its activations on the
    same host: the check and each rank compared one rank's need with all the available memory, so a
    line twice too big for the host passed and its ranks were killed for memory, launch after launch."""
    line = make_line(tmp_path, copy_data_line(data_template, tmp_path))
    config = RunConfig.load(line / "run.json")
    need = line_memory_estimate(config, "cpu").lower_bytes
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=int(need * 1.5)))
    [alone] = [r for r in check_line(line, verify_checkpoints=False)[1] if r.message.startswith("memory: ")]
    assert alone.ok and "the CPU (available memory) has" in alone.message
    refuse_unfit_memory(config, torch.device("cpu"), "run.json")
    config.parallel.degree = 2
    config.save(line / "run.json")
    [group] = [r for r in check_line(line, verify_checkpoints=False)[1] if r.message.startswith("memory: ")]
    assert not group.ok
    assert "a rank's 1/2 of the CPU's available memory (the line's 2 ranks share it)" in group.message
    assert "cannot fit" in group.message
    with pytest.raises(ConfigError, match=r"^run\.json: training needs .* a rank's 1/2 of the CPU's available memory"):
        refuse_unfit_memory(config, torch.device("cpu"), "run.json")


def test_the_description_counts_its_rows_in_words() -> None:
    """`check`'s memory line (found in a README walk: "a micro-batch of 1 rows")."""
    config = preset_config("pssa-1.5m")
    assert "(a micro-batch of 1 row at T64)" in estimate_memory("pssa", config, 1_544_704, {64: 1}).describe()
    assert "(a micro-batch of 8 rows at T64)" in estimate_memory("pssa", config, 1_544_704, {64: 8}).describe()
