"""`nsconsole bench --model P --seq-len T --rows R --accum A: throughput and MFU of one training shape`."""

from __future__ import annotations

import argparse
import json

from engine.config.run import PARALLEL_SHARDS
from engine.errors import ConfigError
from engine.protocol.facts import ENGINE_CHOICES, Engine
from nsconsole.commands.new import parse_override
from nsconsole.commands.parser import add_command

HELP = "--model P --seq-len T --rows R --accum A: throughput and MFU of one training shape"
DESCRIPTION = """\
Time whole training updates (forward, backward, norms, AdamW) of a preset on random tokens and
print one JSON row: tokens/s, MFU against this device's measured matmul rate (bf16 on CUDA, fp32
on the CPU), and with --profile the top kernels by time.

Under torchrun each process is one rank of a group that trains as the trainer's ranks do: rank r
on the next GPU (gloo on the CPU), each rank R x A rows an update (the per-GPU shape), the
gradient summed across the ranks; --shard fsdp shards the model with FSDP2 (eager engine). Rank 0
prints the group's row: degree, tokens/s of the group and per GPU, MFU per device.
"""
EXAMPLES = """\
examples:
  nsconsole bench --model ns-2b --seq-len 4096 --rows 8 --accum 4
  nsconsole bench --model ns-tiny --seq-len 256 --rows 16 --device cpu --updates 3
  nsconsole bench --model pssa-1.5m --seq-len 64 --rows 8 --device cpu --profile
  python -m torch.distributed.run --standalone --nproc-per-node 2 -m nsconsole bench --model ns-2b \\
      --seq-len 4096 --rows 4 --accum 2 --shard fsdp
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(subparsers, "bench", summary=HELP, description=DESCRIPTION, examples=EXAMPLES)
    parser.add_argument("--model", required=True, metavar="PRESET", help="model preset, e.g. ns-2b")
    parser.add_argument("--seq-len", type=int, required=True, metavar="T", help="tokens per row")
    parser.add_argument("--rows", type=int, default=1, metavar="R", help="rows per micro-batch")
    parser.add_argument("--accum", type=int, default=1, metavar="A", help="micro-batches per update")
    parser.add_argument("--engine", choices=ENGINE_CHOICES, default=Engine.AUTO.value,
                        help="step engine (auto: CUDA graphs on a GPU, eager on the CPU)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    parser.add_argument("--updates", type=int, default=5, help="timed updates (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed updates first (compilation, capture)")
    parser.add_argument("--profile", action="store_true", help="also list the top kernels of one update")
    parser.add_argument("--override", action="append", default=[], type=parse_override, metavar="KEY=VALUE",
                        help="replace a preset config field (VALUE as JSON, else a string); repeatable")
    parser.add_argument("--recompute", default="none", metavar="R",
                        help="activation recomputation of NS models: none, all, a layer kind (dendritic, hippocampal) "
                             "or a kind's first K layers (dendritic:18)")
    parser.add_argument("--shard", choices=PARALLEL_SHARDS, default="none",
                        help="under torchrun: none (each rank holds the whole state) or fsdp (FSDP2 "
                             "shards it)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    for name in ("seq_len", "rows", "accum", "updates"):
        value = getattr(args, name)
        if value < 1:
            raise ConfigError(f"bench: --{name.replace('_', '-')} must be at least 1, got {value}")
    if args.warmup < 0:
        raise ConfigError(f"bench: --warmup must be at least 0, got {args.warmup}")
    from engine.models.ns.presets import recomputed_layers
    from engine.models.presets import family_of, preset_config
    from engine.ops.bench import bench_shape, writes_the_row

    overrides = dict(args.override)
    # A bad preset or override is one clear line, before anything is built.
    model_config = preset_config(args.model, overrides)
    model_config.validate()
    if family_of(args.model) == "ns":
        try:
            recomputed_layers(args.recompute, model_config)
        except ValueError as error:
            raise ConfigError(f"bench: --{error}") from None
    result = bench_shape(
        args.model,
        args.seq_len,
        args.rows,
        args.accum,
        engine=args.engine,
        device=args.device,
        updates=args.updates,
        warmup=args.warmup,
        profile=args.profile,
        recompute=args.recompute,
        overrides=overrides,
        keep_cpu_heap=True,
        shard=args.shard,
    )
    if writes_the_row():
        print(json.dumps(result.to_json()), flush=True)
    return 0
