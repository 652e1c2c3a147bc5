"""The scans' memory access pattern with no arithmetic: what bandwidth it can reach at all.

A scan kernel walks time in (CHUNK_T, BLOCK_D) tiles, one program a block of channels of one batch
row, one warp a program, with the loads of STAGES tiles in flight. This benchmark runs that walk
with the same tiles, programs and pipeline but nothing to compute: each tile's reads are summed and
written to each output stream. Its bandwidth is the ceiling the pattern sets on a scan (the PLIF
forward reads 1 stream and writes 2; its backward reads 3 and writes 1), to set against the card's
copy bandwidth (a plain `copy_`).

    python bench/stream_pattern.py [--batch 8 --steps 4096 --channels 2560]

Prints one JSON row per pattern: median ms, bytes moved, GB/s and the share of copy.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kernels import copy_bandwidth, time_ms  # noqa: E402


@triton.jit(do_not_specialize=["channels"])
def _walk_kernel(
    in0_ptr, in1_ptr, in2_ptr, out0_ptr, out1_ptr, seq_len, channels,
    READS: tl.constexpr, WRITES: tl.constexpr, REVERSE: tl.constexpr,
    BLOCK_D: tl.constexpr, CHUNK_T: tl.constexpr, STAGES: tl.constexpr,
):
    batch = tl.program_id(0)
    channel = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    rows = tl.arange(0, CHUNK_T)
    tile = rows[:, None] * channels + channel[None, :]  # (CHUNK_T, BLOCK_D) int32
    base = batch.to(tl.int64) * seq_len * channels
    for start in tl.range(0, seq_len, CHUNK_T, num_stages=STAGES):
        row = seq_len - CHUNK_T - start if REVERSE else start
        at = base + row * channels + tile
        total = tl.load(in0_ptr + at)
        if READS > 1:
            total += tl.load(in1_ptr + at)
        if READS > 2:
            total += tl.load(in2_ptr + at)
        tl.store(out0_ptr + at, total)
        if WRITES > 1:
            tl.store(out1_ptr + at, total * 2.0)


def walk(inputs: list[torch.Tensor], outputs: list[torch.Tensor], reverse: bool, block_d: int, chunk_t: int,
         stages: int) -> None:
    batch, seq_len, channels = inputs[0].shape
    ins = inputs + [inputs[0]] * (3 - len(inputs))
    outs = outputs + [outputs[0]] * (2 - len(outputs))
    _walk_kernel[(batch, channels // block_d)](
        *ins, *outs, seq_len, channels, READS=len(inputs), WRITES=len(outputs), REVERSE=reverse,
        BLOCK_D=block_d, CHUNK_T=chunk_t, STAGES=stages, num_warps=max(block_d // 32, 1) if block_d > 64 else 1,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4096)
    parser.add_argument("--channels", type=int, default=2560)
    args = parser.parse_args()
    copy_gbs = copy_bandwidth()
    shape = (args.batch, args.steps, args.channels)
    streams = [torch.randn(shape, device="cuda") for _ in range(5)]
    stream_bytes = streams[0].numel() * 4
    # (name, reads, writes, reverse): the PLIF scan's two directions.
    patterns = [("plif_fwd_pattern", 1, 2, False), ("plif_bwd_pattern", 3, 1, True)]
    for name, reads, writes, reverse in patterns:
        for block_d, chunk_t, stages in [(32, 8, 4), (64, 4, 8), (64, 8, 3), (64, 8, 4), (64, 8, 6), (32, 8, 8), (128, 8, 4)]:
            if args.channels % block_d or args.steps % chunk_t:
                continue
            ins, outs = streams[:reads], streams[reads:reads + writes]
            walk(ins, outs, reverse, block_d, chunk_t, stages)
            want = sum(ins)
            if not torch.equal(outs[0], want) or (writes > 1 and not torch.equal(outs[1], want * 2)):
                raise SystemExit(f"stream_pattern: {name} {block_d}x{chunk_t}x{stages} wrote wrong values")
            ms = time_ms(partial(walk, ins, outs, reverse, block_d, chunk_t, stages))
            gbs = stream_bytes * (reads + writes) / ms / 1e6
            print(json.dumps({"kernel": name, "block_d": block_d, "chunk_t": chunk_t, "stages": stages,
                              "ms": round(ms, 4), "GB_s": round(gbs, 1), "frac_of_copy": round(gbs / copy_gbs, 3)}),
                  flush=True)


if __name__ == "__main__":
    main()
