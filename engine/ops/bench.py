"""Throughput of one training shape: tokens/s, MFU, and (with a profile) the top kernels by time.

`bench_shape(...)` builds the preset's model with the trainer's optimizer and step engine, feeds it
random tokens (`rows` x `accum` rows of `seq_len` per update), times whole updates after a warm-up,
and measures the device's matmul rate in the same run (bf16 on CUDA, fp32 on the CPU), so the MFU
`flops_per_token x tokens/s / matmul rate` compares the model against what this device actually
does rather than a datasheet.

Under torchrun (`Ranks.from_environment`: WORLD_SIZE set) the process is one rank of a group that
trains as the trainer's ranks do (engine.training.distributed): it joins the group on the
trainer's device (rank r on the GPU `device` names + r, NCCL; gloo on the CPU), each of the N
ranks trains `rows x accum` rows an update (the per-GPU shape, as a user tunes it), so the group's
update is `N x rows x accum` rows, dealt by `Ranks.rows_of` and summed by the engine's `Ranks.sum_`
as the trainer deals and sums them. `shard="fsdp"` wraps the model in `FullyShardedModel` with
`ShardedFlatAdamW`, with the trainer's rules: at degree 1 nothing is sharded (it trains as
`none`), and a sharded model trains eagerly (FSDP2 cannot be captured in CUDA graphs); the row's
`notes` say when either applied. The ranks wait for each other (a barrier) before the clock
starts and before it stops, so the time is the group's; tokens/s is the group's, and the MFU is
per device (the group's tokens/s over N, against one device's matmul rate). Rank 0's result is
the row (`nsconsole bench` prints it alone); every rank returns its own.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from engine.config.run import PARALLEL_SHARDS, ParallelConfig
from engine.errors import ConfigError
from engine.models.base import LanguageModel
from engine.models.build import build_model
from engine.models.presets import preset_config
from engine.protocol.facts import Engine
from engine.training.cpu_heap import keep_freed_memory
from engine.training.distributed import FullyShardedModel, Ranks, refuse_written_state
from engine.training.optim import AdamWSettings, FlatAdamW
from engine.training.sharded_optim import ShardedFlatAdamW
from engine.training.step import EagerEngine, GraphEngine
from engine.training.trainer import resolve_device
from engine.units import GIB

BENCH_LR = 1e-4
BENCH_WEIGHT_DECAY = 0.1
BENCH_ADAMW = AdamWSettings(0.9, 0.95, 1e-8, 1.0)
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
    degree: int
    """Ranks that trained each update together (torchrun's processes; 1 without torchrun)."""
    shard: str
    """`none` or `fsdp` (`--shard`; `notes` say when fsdp trained as none)."""
    seq_len: int
    """Tokens per row."""
    rows: int
    """Rows per micro-batch (of each rank)."""
    accum: int
    """Micro-batches per update (of each rank)."""
    recompute: str
    """Activation recomputation (`none`, `all` or a layer kind)."""
    overrides: dict[str, Any]
    """The preset's config fields replaced for this run (`--override`)."""
    updates: int
    """Timed updates."""
    seconds_per_update: float
    """Mean wall time of a timed update (of the whole group)."""
    tokens_per_s: float
    """Trained tokens per second (of the whole group: degree x rows x accum x seq_len an update)."""
    tokens_per_s_per_gpu: float
    """tokens_per_s over the degree: what one rank's device contributes."""
    flops_per_token: float
    """The model's analytic training FLOPs per token at this length."""
    matmul_tflops: float
    """The measured dense matmul rate of this device (bf16 on CUDA, fp32 on the CPU), in TFLOP/s."""
    mfu: float
    """Model FLOPs utilisation of one device: flops_per_token x tokens_per_s_per_gpu over the
    measured matmul rate."""
    last_loss: float
    """The last timed update's loss (the mean over the group's rows): the same windows give the same
    loss at every degree only if the ranks' gradients were summed, so a group can be checked against
    degree 1."""
    peak_memory_gib: float | None = None
    """Peak CUDA memory allocated by the run (this rank's: rank 0's in the row), the CUDA-graph
    capture's warm-up included (None on the CPU)."""
    notes: list[str] = field(default_factory=list)
    """The trainer's rules that changed what was asked (fsdp at degree 1, fsdp's eager engine)."""
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


def _engine_and_notes(engine: str, cuda: bool, shard: str, ranks: Ranks) -> tuple[Engine, list[str]]:
    """The step engine and the trainer's rules that apply (ConfigError for what cannot run)."""
    engine_name = (Engine.GRAPH if cuda else Engine.EAGER) if engine == Engine.AUTO else Engine(engine)
    if engine_name == Engine.GRAPH and not cuda:
        raise ConfigError("bench: the graph engine needs a CUDA device")
    if shard not in PARALLEL_SHARDS:
        raise ConfigError(f"bench: --shard must be one of {', '.join(PARALLEL_SHARDS)}, got {shard!r}")
    notes: list[str] = []
    if shard == "fsdp":
        if not ranks.launched:
            raise ConfigError(
                "bench: --shard fsdp shards the model over a group's processes; start the bench under "
                "torchrun: torchrun --standalone --nproc-per-node N -m nsconsole bench ..."
            )
        if ranks.size == 1:
            notes.append("shard fsdp at degree 1: nothing to shard; trained as none (as the trainer does)")
        elif engine_name == Engine.GRAPH:
            engine_name = Engine.EAGER
            notes.append("shard fsdp: eager engine (FSDP2 cannot be captured in CUDA graphs: as the trainer)")
    return engine_name, notes


def _step_engine(
    model: LanguageModel,
    target: torch.device,
    engine_name: Engine,
    rows: int,
    seq_len: int,
    ranks: Ranks,
    shard: str,
) -> EagerEngine | GraphEngine:
    """The trainer's optimizer and step engine for this rank (engine.training.trainer's choices)."""
    cuda = target.type == "cuda"
    if shard == "fsdp" and ranks.size > 1:
        sharded = FullyShardedModel(model, ranks, target)
        optimizer: FlatAdamW = ShardedFlatAdamW(model, BENCH_ADAMW, target, ranks)
        if cuda:
            torch.cuda.reset_peak_memory_stats(target)
        return EagerEngine(model, optimizer, rows, ranks, rows, sharded)
    optimizer = FlatAdamW(model, BENCH_ADAMW, target)
    if engine_name == Engine.GRAPH:
        from engine.training.arena import Arena

        arena = Arena(target)
        # After the arena's fill (one block of nearly the whole GPU, allocated and freed) and before
        # the capture's eager warm-up: the peak is then the step's own (weights, optimizer and the
        # activations the captured graphs reuse), not only what the replays allocate anew (nothing).
        torch.cuda.reset_peak_memory_stats(target)
        return GraphEngine(model, optimizer, rows, seq_len, arena, ranks, rows)
    if cuda:
        torch.cuda.reset_peak_memory_stats(target)
    return EagerEngine(model, optimizer, rows, ranks, rows)


def writes_the_row() -> bool:
    """Whether this process prints the row: alone, or rank 0 of a torchrun group (the row is the group's)."""
    return Ranks.from_environment().writes


@contextmanager
def _in_group(ranks: Ranks, shard: str, device: torch.device) -> Iterator[torch.device]:
    """This rank's device, in its group for the bench's life (alone: `device`, no group)."""
    try:
        yield ranks.connect(ParallelConfig(degree=ranks.size, shard=shard), device, "bench")
    finally:
        ranks.close()


def _model(preset: str, overrides: dict[str, Any] | None, recompute: str, device: torch.device, ranks: Ranks
           ) -> LanguageModel:  # fmt: skip
    """The preset's model on the device, the same weights on every rank (built from seed 0 on the
    CPU); ConfigError for what the trainer would refuse."""
    torch.manual_seed(0)
    model = build_model(preset, overrides).to(device)
    refuse_written_state(model, ranks.size, preset, "bench")
    if recompute != "none":
        if not hasattr(model, "recompute"):
            raise ConfigError(f"bench: --recompute {recompute}: {preset} has no activation recomputation")
        model.recompute = recompute
    return model


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
    shard: str = "none",
) -> BenchResult:
    """Time `updates` updates of `rows x accum` random rows of `seq_len` a rank (see the module
    docstring; under torchrun the whole group's updates, every rank calling this together).
    `keep_cpu_heap`: on a CPU, keep freed memory as a CPU trainer does (engine.training.cpu_heap;
    process-wide, so only where the process is the benchmark's own: `nsconsole bench`)."""
    ranks = Ranks.from_environment()
    target = resolve_device(device, "bench: --device")
    engine_name, notes = _engine_and_notes(engine, target.type == "cuda", shard, ranks)
    with _in_group(ranks, shard, target) as target:
        cuda = target.type == "cuda"
        if keep_cpu_heap and not cuda:
            keep_freed_memory()
        vocab = int(preset_config(preset, overrides).vocab_size)
        model = _model(preset, overrides, recompute, target, ranks)
        parameters, flops_per_token = model.num_parameters(), float(model.flops_per_token(seq_len))
        step = _step_engine(model, target, engine_name, rows, seq_len, ranks, shard)
        generator = torch.Generator().manual_seed(0)
        # The group's update: every rank holds it whole and trains its `rows x accum` (`Ranks.rows_of`).
        windows = torch.randint(0, vocab, (ranks.size * rows * accum, seq_len + 1), generator=generator)
        if cuda:
            windows = windows.pin_memory()

        def synchronize() -> None:
            if cuda:
                torch.cuda.synchronize(target)

        def settle() -> None:
            """This rank's work done, then every rank's: the clock then reads the group's time."""
            synchronize()
            ranks.barrier()

        for _ in range(warmup):
            step.run_update(windows, BENCH_LR, BENCH_WEIGHT_DECAY)
        settle()
        started = time.perf_counter()
        timed = [step.run_update(windows, BENCH_LR, BENCH_WEIGHT_DECAY) for _ in range(updates)]
        settle()
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

        tokens_per_s = ranks.size * rows * accum * seq_len / seconds
        matmul_tflops = measure_matmul_tflops(target)
        return BenchResult(
            model=preset,
            parameters=parameters,
            device=torch.cuda.get_device_name(target) if cuda else "cpu",
            engine=engine_name,
            degree=ranks.size,
            shard=shard,
            seq_len=seq_len,
            rows=rows,
            recompute=recompute,
            overrides=dict(overrides or {}),
            accum=accum,
            updates=updates,
            seconds_per_update=seconds,
            tokens_per_s=tokens_per_s,
            tokens_per_s_per_gpu=tokens_per_s / ranks.size,
            flops_per_token=flops_per_token,
            matmul_tflops=matmul_tflops,
            mfu=flops_per_token * tokens_per_s / ranks.size / (matmul_tflops * 1e12),
            last_loss=timed[-1].loss,
            peak_memory_gib=torch.cuda.max_memory_allocated(target) / GIB if cuda else None,
            notes=notes,
            top_kernels=top,
        )
