"""Where one training update's GPU time goes: each kernel, each kind of kernel, and the idle GPU.

Builds what `nsconsole bench` builds (the trainer's model, FlatAdamW and step engine), warms up,
then profiles `--updates` updates under torch.profiler and prints JSON rows:

- one `kernel` row for each of the `--top` kernels with the most device time: its name (cut to
  120 characters), its kind, milliseconds an update and calls an update;
- one `kind` row for each kind (matmul, flash attention, the project's Triton kernels by name,
  torch.compile's fused glue, eager elementwise, reductions, casts and copies, other), with its
  share of the kernel time;
- with `--ops N`, one `operator` row for each of the N operators (grouped by input shapes) whose
  own kernels took the most device time: with the eager engine, which call launched the casts and
  copies (a graph replay launches its kernels under no operator);
- one `summary` row: wall milliseconds an update, kernel milliseconds an update (their sum), busy
  milliseconds (the union of the kernels' intervals: overlapping kernels count once) and idle, the
  GPU's waiting on the host. The graph engine replays a captured update, so its idle time is the
  host's work between replays; the eager engine's includes every kernel launch.

Issue 22 (the NS step at its transformer peer's rate) is judged by these: what is left beside the
matrix products, and whether the GPU ever waits.

    python3 bench/profile_update.py --model ns-2b --seq-len 4096 --rows 4 --recompute dendritic \
        [--engine graph] [--updates 2] [--top 40] [--override KEY=VALUE] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

# The repository root first: run as a script, bench/ would lead sys.path and its kernels.py
# would shadow the kernels package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_peers import emit  # noqa: E402  (bench/, this script's own directory)

KINDS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("matmul", re.compile(r"nvjet|gemm|cutlass|xmma|cublas|sm90_|sm80_", re.I)),
    ("flash attention", re.compile(r"flash|fmha|attention|cudnn", re.I)),
    ("compiled glue", re.compile(r"^triton_(poi|red|per|tem)_")),
    ("dendritic scan", re.compile(r"chunk|segment|state_pass|decay|ssd", re.I)),
    ("selective scan", re.compile(r"selective_scan", re.I)),
    ("PLIF", re.compile(r"plif", re.I)),
    # kernels/pool_attention.py's (its forward and delta kernels carry no family name) and flex's.
    ("pool read", re.compile(r"^_forward_kernel$|^_delta_kernel$|read_|key_side|query_side|distance|slot_terms")),
    ("optimizer", re.compile(r"adamw|multi_tensor|foreach", re.I)),
    ("cast or copy", re.compile(r"copy|cast|memcpy|memset|fill", re.I)),
    ("reduction", re.compile(r"reduce|sum|norm|softmax|cross_entropy|nll", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|pointwise", re.I)),
)


def kind_of(name: str) -> str:
    """The kind of a kernel by its name: the first of `KINDS` whose pattern it matches, else other."""
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other"


def union_ms(intervals: list[tuple[float, float]]) -> float:
    """Milliseconds covered by the (start, end) microsecond intervals, overlaps counted once."""
    covered, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        covered += end - max(start, reach)
        reach = end
    return covered / 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="ns-2b")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--recompute", default="dendritic")
    parser.add_argument("--engine", choices=("eager", "graph"), default="graph")
    parser.add_argument("--updates", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--ops", type=int, default=0,
                        help="also the N operators (with their input shapes) whose kernels took the most time")  # fmt: skip
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="a model setting, as nsconsole bench --override takes it")  # fmt: skip
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    import torch

    from engine.models.presets import preset_config
    from engine.ops.bench import BENCH_LR, BENCH_WEIGHT_DECAY, _model, _step_engine
    from engine.protocol.facts import Engine
    from engine.training.distributed import Ranks
    from nsconsole.commands.new import parse_override

    if not torch.cuda.is_available():
        print("profile_update: no CUDA device (this bench profiles GPU kernels)", file=sys.stderr)
        return 1
    device = torch.device("cuda", torch.cuda.current_device())
    ranks = Ranks.from_environment()
    overrides = dict(parse_override(text) for text in args.override)
    model = _model(args.model, overrides, args.recompute, device, ranks)
    step = _step_engine(model, device, Engine(args.engine), args.rows, args.seq_len, ranks, "none")
    vocab = int(preset_config(args.model).vocab_size)
    windows = torch.randint(0, vocab, (args.rows * args.accum, args.seq_len + 1)).pin_memory()
    for _ in range(args.warmup):
        step.run_update(windows, BENCH_LR, BENCH_WEIGHT_DECAY)
    torch.cuda.synchronize(device)

    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, record_shapes=args.ops > 0) as profiler:
        started = time.perf_counter()
        for _ in range(args.updates):
            step.run_update(windows, BENCH_LR, BENCH_WEIGHT_DECAY)
        torch.cuda.synchronize(device)
        wall_ms = (time.perf_counter() - started) * 1e3 / args.updates

    kernels = [event for event in profiler.events() if event.device_type == torch.autograd.DeviceType.CUDA]
    per_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    intervals = []
    for event in kernels:
        start, end = event.time_range.start, event.time_range.end
        intervals.append((start, end))
        per_name[event.name][0] += (end - start) / 1e3
        per_name[event.name][1] += 1
    kernel_ms = sum(ms for ms, _ in per_name.values()) / args.updates
    busy_ms = union_ms(intervals) / args.updates

    with args.out.open("a") if args.out else contextlib.nullcontext() as out:
        ranked = sorted(per_name.items(), key=lambda item: item[1][0], reverse=True)
        for name, (ms, calls) in ranked[: args.top]:
            emit({"row": "kernel", "kind": kind_of(name), "ms": round(ms / args.updates, 3),
                  "calls": calls // args.updates, "name": name[:120]}, out)  # fmt: skip
        if args.ops:
            operators = [event for event in profiler.key_averages(group_by_input_shape=True)
                         if event.device_type != torch.autograd.DeviceType.CUDA and event.self_device_time_total > 0]  # fmt: skip
            operators.sort(key=lambda event: event.self_device_time_total, reverse=True)
            for event in operators[: args.ops]:
                emit({"row": "operator", "name": event.key, "ms": round(event.self_device_time_total / 1e3 / args.updates, 3),
                      "calls": event.count // args.updates, "shapes": str(event.input_shapes)[:200]}, out)  # fmt: skip
        by_kind: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for name, (ms, calls) in per_name.items():
            by_kind[kind_of(name)][0] += ms / args.updates
            by_kind[kind_of(name)][1] += calls // args.updates
        for kind, (ms, calls) in sorted(by_kind.items(), key=lambda item: item[1][0], reverse=True):
            emit({"row": "kind", "kind": kind, "ms": round(ms, 2), "calls": calls,
                  "share": round(ms / kernel_ms, 4) if kernel_ms else None}, out)  # fmt: skip
        emit({"row": "summary", "model": args.model, "seq_len": args.seq_len, "rows": args.rows,
              "accum": args.accum, "recompute": args.recompute, "engine": args.engine, "overrides": overrides,
              "device": torch.cuda.get_device_name(device), "wall_ms": round(wall_ms, 2),
              "kernel_ms": round(kernel_ms, 2), "busy_ms": round(busy_ms, 2),
              "idle_ms": round(wall_ms - busy_ms, 2),
              "tokens_per_s": round(args.rows * args.accum * args.seq_len / wall_ms * 1e3, 1)}, out)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
