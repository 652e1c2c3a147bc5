"""The scans' memory access pattern with no arithmetic: what bandwidth it can reach at all.

A scan kernel walks time in (CHUNK_T, BLOCK_D) tiles, one program a block of channels of one batch
row, one warp a program, with the loads of STAGES tiles in flight. This benchmark runs that walk
with the same tiles, programs and pipeline but nothing to compute: each tile's reads are summed and
written to each output stream. Its bandwidth is the ceiling the pattern sets on a scan (the PLIF
forward reads 1 stream and writes 2; its backward reads 3 and writes 1), to set against the card's
copy bandwidth (a plain `copy_`).

The selective scan's forward is walked the same way with its exponentials and nothing else
(`_exp_walk_kernel`): each (t, n, d) takes exp(delta A) as the scan does, weighted by B and summed
over n, with no recurrence, on the forward's tiles, programs and pipeline. Its time is what the
exponentials and the loads cost together, the floor of any kernel that computes them this way.

    python bench/stream_pattern.py [--batch 8 --steps 4096 --channels 2560 --scan-channels 1024]

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
from kernels._scan_tiles import LOG2_E  # noqa: E402


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


@triton.jit
def _exp_walk_kernel(
    x_ptr, delta_ptr, A_T_ptr, B_ptr, y_ptr, seq_len, log2_e,
    channels: tl.constexpr, state_size: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK_T: tl.constexpr,
    STAGES: tl.constexpr,
):
    batch = tl.program_id(0)
    channel = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.arange(0, state_size)
    A2 = tl.load(A_T_ptr + n[:, None] * channels + channel[None, :]) * log2_e  # (N, BLOCK_D)
    rows = tl.arange(0, CHUNK_T)
    for start in tl.range(0, seq_len, CHUNK_T, num_stages=STAGES):
        row = batch.to(tl.int64) * seq_len + start + rows  # (CHUNK_T,)
        offsets = row[:, None] * channels + channel[None, :]
        xs = tl.load(x_ptr + offsets)
        deltas = tl.load(delta_ptr + offsets)
        Bs = tl.load(B_ptr + row[:, None] * state_size + n[None, :])  # (CHUNK_T, N)
        decay = tl.exp2(deltas[:, None, :] * A2[None, :, :])  # (CHUNK_T, N, BLOCK_D)
        tl.store(y_ptr + offsets, tl.sum(decay * Bs[:, :, None], axis=1) * xs)


def exp_walk(x: torch.Tensor, delta: torch.Tensor, A_T: torch.Tensor, B: torch.Tensor, y: torch.Tensor,
             block_d: int, chunk_t: int, stages: int) -> None:
    batch, seq_len, channels = x.shape
    _exp_walk_kernel[(batch, channels // block_d)](
        x, delta, A_T, B, y, seq_len, LOG2_E, channels=channels, state_size=A_T.shape[0],
        BLOCK_D=block_d, CHUNK_T=chunk_t, STAGES=stages, num_warps=1,
    )


def walk(inputs: list[torch.Tensor], outputs: list[torch.Tensor], reverse: bool, block_d: int, chunk_t: int,
         stages: int) -> None:
    batch, seq_len, channels = inputs[0].shape
    ins = inputs + [inputs[0]] * (3 - len(inputs))
    outs = outputs + [outputs[0]] * (2 - len(outputs))
    _walk_kernel[(batch, channels // block_d)](
        *ins, *outs, seq_len, channels, READS=len(inputs), WRITES=len(outputs), REVERSE=reverse,
        BLOCK_D=block_d, CHUNK_T=chunk_t, STAGES=stages, num_warps=1 if block_d <= 64 else block_d // 32,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4096)
    parser.add_argument("--channels", type=int, default=2560)
    parser.add_argument("--scan-channels", type=int, default=1024)
    parser.add_argument("--state-size", type=int, default=16)
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
    del streams
    # The selective scan's forward bytes: x and delta read, y written (B per row: N floats a step).
    shape = (args.batch, args.steps, args.scan_channels)
    x, delta = torch.randn(shape, device="cuda"), torch.rand(shape, device="cuda") * 0.1
    A_T = -torch.rand(args.state_size, args.scan_channels, device="cuda") - 0.5
    B = torch.randn(args.batch, args.steps, args.state_size, device="cuda")
    y = torch.empty_like(x)
    exp_walk(x, delta, A_T, B, y, 16, 8, 5)
    want = (torch.exp(delta[:, :, None, :] * A_T[None, None]) * B[..., None]).sum(2) * x
    if float((y - want).norm() / want.norm()) > 1e-5:
        raise SystemExit("stream_pattern: the exponentials' walk wrote wrong values")
    nbytes = (3 * x.numel() + B.numel()) * 4
    exps = x.numel() * args.state_size
    for block_d, chunk_t, stages in [(16, 8, 5), (8, 8, 5), (32, 8, 4), (16, 16, 4)]:
        ms = time_ms(partial(exp_walk, x, delta, A_T, B, y, block_d, chunk_t, stages))
        gbs = nbytes / ms / 1e6
        print(json.dumps({"kernel": "selective_scan_exp_pattern", "block_d": block_d, "chunk_t": chunk_t,
                          "stages": stages, "ms": round(ms, 4), "GB_s": round(gbs, 1),
                          "frac_of_copy": round(gbs / copy_gbs, 3), "exps_per_ns": round(exps / ms / 1e6, 1)}),
              flush=True)


if __name__ == "__main__":
    main()
