"""Throughput of one training shape: tokens/s, MFU, and (with a profile) the top kernels by time.

`bench_shape(...)` builds the preset's model with the trainer's optimizer and step engine, feeds it
random tokens (`rows` x `accum` rows of `seq_len` per update), times whole updates after a warm-up,
and measures the device's matmul rate in the same run (bf16 on CUDA, fp32 on the CPU), so the MFU
`flops_per_token x tokens/s / matmul rate` compares the model against what this device actually
does rather than a datasheet.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from engine.errors import ConfigError
from engine.models.build import build_model
from engine.models.presets import preset_config
from engine.protocol.facts import Engine
from engine.training.cpu_heap import keep_freed_memory
from engine.training.optim import AdamWSettings, FlatAdamW
from engine.training.step import EagerEngine, GraphEngine
from engine.training.trainer import resolve_device
from engine.units import GIB

BENCH_LR = 1e-4
BENCH_WEIGHT_DECAY = 0.1
MATMUL_SECONDS = 1.0
"""Time spent measuring the matmul rate (after its own warm-up)."""


@dataclass
class BenchResult:
    """One JSON row of `nsconsole bench`."""

    model: str
    """The preset."""
    parameters: int
    """Trainable parameters."""
    device: str
    """Where it ran (the GPU's name on CUDA)."""
    engine: str
    """`eager` or `graph`."""
    seq_len: int
    """Tokens per row."""
    rows: int
    """Rows per micro-batch."""
    accum: int
    """Micro-batches per update."""
    recompute: str
    """Activation recomputation (`none`, `all` or a layer kind)."""
    overrides: dict[str, Any]
    """The preset's config fields replaced for this run (`--override`)."""
    updates: int
    """Timed updates."""
    seconds_per_update: float
    """Mean wall time of a timed update."""
    tokens_per_s: float
    """Trained tokens per second."""
    flops_per_token: float
    """The model's analytic training FLOPs per token at this length."""
    matmul_tflops: float
    """The measured dense matmul rate of this device (bf16 on CUDA, fp32 on the CPU), in TFLOP/s."""
    mfu: float
    """Model FLOPs utilisation: flops_per_token x tokens/s over the measured matmul rate."""
    peak_memory_gib: float | None = None
    """Peak CUDA memory allocated by the run, the CUDA-graph capture's warm-up included (None on the CPU)."""
    top_kernels: list[dict[str, Any]] = field(default_factory=list)
    """With --profile: the kernels (CUDA) or operators (CPU) taking the most time in one update."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def measure_matmul_tflops(device: torch.device, seconds: float = MATMUL_SECONDS) -> float:
    """Dense matmul rate of the device: bf16 8192^3 products on CUDA, fp32 1024^3 on the CPU."""
    cuda = device.type == "cuda"
    size = 8192 if cuda else 1024
    dtype = torch.bfloat16 if cuda else torch.float32
    left = torch.randn(size, size, device=device, dtype=dtype)
    right = torch.randn(size, size, device=device, dtype=dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)

    def synchronize() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    for _ in range(3):
        torch.matmul(left, right, out=out)
    synchronize()
    products = 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        for _ in range(10 if cuda else 1):
            torch.matmul(left, right, out=out)
            products += 1
        synchronize()
    elapsed = time.perf_counter() - started
    return 2.0 * size**3 * products / elapsed / 1e12


def _top_kernels(profiler: torch.profiler.profile, cuda: bool, limit: int = 40) -> list[dict[str, Any]]:
    events = profiler.key_averages()
    if cuda:
        timed = [(event.key, event.self_device_time_total, event.count) for event in events]
    else:
        timed = [(event.key, event.self_cpu_time_total, event.count) for event in events]
    timed = [entry for entry in timed if entry[1] > 0]
    total = sum(entry[1] for entry in timed) or 1.0
    timed.sort(key=lambda entry: entry[1], reverse=True)
    return [
        {"name": name, "ms": round(us / 1e3, 3), "percent": round(100 * us / total, 2), "calls": count}
        for name, us, count in timed[:limit]
    ]


def bench_shape(
    preset: str,
    seq_len: int,
    rows: int,
    accum: int,
    *,
    engine: str = "auto",
    device: str = "auto",
    updates: int = 5,
    warmup: int = 2,
    profile: bool = False,
    overrides: dict[str, Any] | None = None,
    recompute: str = "none",
    keep_cpu_heap: bool = False,
) -> BenchResult:
    """Time `updates` updates of `rows x accum` random rows of `seq_len` (see the module docstring).
    `keep_cpu_heap`: on a CPU, keep freed memory as a CPU trainer does (engine.training.cpu_heap;
    process-wide, so only where the process is the benchmark's own: `nsconsole bench`)."""
    target = resolve_device(device, "bench: --device")
    cuda = target.type == "cuda"
    if keep_cpu_heap and not cuda:
        keep_freed_memory()
    engine_name = (Engine.GRAPH if cuda else Engine.EAGER) if engine == Engine.AUTO else Engine(engine)
    if engine_name == Engine.GRAPH and not cuda:
        raise ConfigError("bench: the graph engine needs a CUDA device")
    vocab = int(preset_config(preset, overrides).vocab_size)
    torch.manual_seed(0)
    model = build_model(preset, overrides).to(target)
    if recompute != "none":
        if not hasattr(model, "recompute"):
            raise ConfigError(f"bench: --recompute {recompute}: {preset} has no activation recomputation")
        model.recompute = recompute
    optimizer = FlatAdamW(model, AdamWSettings(0.9, 0.95, 1e-8, 1.0), target)
    if engine_name == Engine.GRAPH:
        from engine.training.arena import Arena

        arena = Arena(target)
        # After the arena's fill (one block of nearly the whole GPU, allocated and freed) and before
        # the capture's eager warm-up: the peak is then the step's own (weights, optimizer and the
        # activations the captured graphs reuse), not only what the replays allocate anew (nothing).
        torch.cuda.reset_peak_memory_stats(target)
        step: EagerEngine | GraphEngine = GraphEngine(model, optimizer, rows, seq_len, arena)
    else:
        if cuda:
            torch.cuda.reset_peak_memory_stats(target)
        step = EagerEngine(model, optimizer, rows)
    generator = torch.Generator().manual_seed(0)
    windows = torch.randint(0, vocab, (rows * accum, seq_len + 1), generator=generator)
    if cuda:
        windows = windows.pin_memory()

    def synchronize() -> None:
        if cuda:
            torch.cuda.synchronize(target)

    for _ in range(warmup):
        step.run_update(windows, BENCH_LR, BENCH_WEIGHT_DECAY)
    synchronize()
    started = time.perf_counter()
    for _ in range(updates):
        step.run_update(windows, BENCH_LR, BENCH_WEIGHT_DECAY)
    synchronize()
    seconds = (time.perf_counter() - started) / updates

    top: list[dict[str, Any]] = []
    if profile:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as profiler:
            step.run_update(windows, BENCH_LR, BENCH_WEIGHT_DECAY)
            synchronize()
        top = _top_kernels(profiler, cuda)

    tokens_per_s = rows * accum * seq_len / seconds
    flops_per_token = float(model.flops_per_token(seq_len))
    matmul_tflops = measure_matmul_tflops(target)
    return BenchResult(
        model=preset,
        parameters=model.num_parameters(),
        device=torch.cuda.get_device_name(target) if cuda else "cpu",
        engine=engine_name,
        seq_len=seq_len,
        rows=rows,
        recompute=recompute,
        overrides=dict(overrides or {}),
        accum=accum,
        updates=updates,
        seconds_per_update=seconds,
        tokens_per_s=tokens_per_s,
        flops_per_token=flops_per_token,
        matmul_tflops=matmul_tflops,
        mfu=flops_per_token * tokens_per_s / (matmul_tflops * 1e12),
        peak_memory_gib=torch.cuda.max_memory_allocated(target) / GIB if cuda else None,
        top_kernels=top,
    )
