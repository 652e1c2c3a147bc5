"""Benchmark of the NS dendritic chunked scan's Triton kernels (kernels/ssd_scan.py) on the GPU.

Side by side in one process, at the ns-2b layer's shape (B 8, T 4096, 40 heads of 64, N 64, the
preset's groups (1) and chunk_len (64)), bf16 u, B, C and fp32 dt, A under bf16 autocast as the
dendritic layer runs it: the engine's chunked_scan eager, compiled (`compiled_chunked_scan`, the
model's CUDA path today) and the Triton kernels, forward and forward + backward. Each row holds
the median ms, the achieved TFLOP/s and the arithmetic floor: the scan is not memory bound, so
its floor is its matrix products' FLOPs over the bf16 matmul rate measured in the same run (one
8192^3 product), and each row's fraction of that floor (floor_ms / ms).

FLOPs counted, the SSD form of engine/models/ns/scan.py's docstring, per row and chunk of L:
C B^T (2 L^2 N a group), the masked mixing times the drive (2 L^2 P a head), the chunk's state
B^T x (2 L N P a head), the entering state read through C (2 L N P a head), and the pass between
chunks (2 N P a head and chunk, as a recurrence). The backward forms two products for each
forward one (the gradients of both factors): forward + backward counts 3x the forward. The
kernels themselves do a little more (C B^T once a head, not a group; the backward recomputes
C B^T and C S, and forms dY X^T in both of its per-chunk gradient kernels); the floor counts the
form, not the kernels.

Then the Triton kernels one by one (rows with a `piece`): each kernel's device time per call of
the forward and of the backward (torch.profiler, the backward replayed on one kept graph), with
the PyTorch kernels around them (the group sums of dB and dC, dA's sum, casts).

`--pass-sweep` times only the pass between chunks (`_state_pass_kernel`, the one sequential
launch) at the same shape over its tile, warps and prefetch settings, forward and reverse: that
launch reads each chunk's contribution and writes its entering state (fp32, 2 x 335 MB at ns-2b's
shape) with an FMA an element, so it is memory bound and its floor is a device copy of the same
bytes, timed in the same run (`fraction_of_copy` = copy ms / pass ms).

    python bench/ssd_scan.py [--iters-budget 0.6] [--pass-sweep] > rows.jsonl
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

# The repository root first: run as a script, bench/ would lead sys.path and its kernels.py
# would shadow the kernels package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kernels import time_ms  # noqa: E402
from engine.models.ns.presets import PRESETS  # noqa: E402
from engine.models.ns.scan import chunked_scan, compiled_chunked_scan  # noqa: E402
from kernels.ssd_scan import _pass_states, ssd_scan  # noqa: E402


def emit(**row) -> dict:
    print(json.dumps(row), flush=True)
    return row


def matmul_tflops(budget_s: float) -> float:
    """The card's bf16 matmul rate, TFLOP/s, on one 8192^3 product."""
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ms = time_ms(lambda: a @ b, budget_s)
    rate = 2 * 8192**3 / ms / 1e9
    emit(kernel="matmul", size="8192^3 bf16", impl="torch", ms=round(ms, 4), TFLOP_s=round(rate, 1))
    return rate


def kernel_split(forward: Callable, leaves: tuple[torch.Tensor, ...], gradients: tuple[torch.Tensor, ...],
                 calls: int = 5) -> None:
    """Each CUDA kernel's device time per call of `forward` and of its backward, one row each."""
    outputs = forward()

    def backward() -> None:
        for tensor in leaves:
            tensor.grad = None
        torch.autograd.backward(outputs, gradients, retain_graph=True)

    for mode, call in (("fwd", forward), ("bwd", backward)):
        call()  # compiled and warm before the profile
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
            for _ in range(calls):
                call()
            torch.cuda.synchronize()
        for event in profiler.key_averages():
            if event.self_device_time_total > 0:
                emit(kernel="ssd_scan", impl="triton", mode=mode, piece=event.key,
                     ms=round(event.self_device_time_total / calls / 1e3, 4), launches=event.count / calls)


def forward_gflop(batch: int, length: int, heads: int, head_dim: int, groups: int, state: int, chunk: int) -> float:
    """The SSD form's matrix-product FLOPs of one forward, GFLOP (module docstring)."""
    chunks = -(-length // chunk)
    per_chunk = 2 * chunk * chunk * state * groups + heads * (2 * chunk * chunk * head_dim + 4 * chunk * state * head_dim)
    passing = heads * 2 * state * head_dim
    return batch * chunks * (per_chunk + passing) / 1e9


def pass_sweep(batch: int, heads: int, chunks: int, state: int, head_dim: int, budget_s: float) -> None:
    """The pass between chunks alone, per setting, against a copy of the bytes it moves."""
    states = torch.randn(batch, heads, chunks, state, head_dim, device="cuda")
    # Decays of exp(-30): each entering state is the previous chunk's contribution, so repeated
    # passes in place neither grow nor change the values' magnitude (the timing's inputs stay alike).
    totals = torch.full((batch, heads, chunks), -30.0, device="cuda")
    start, end = torch.randn(batch, heads, state, head_dim, device="cuda"), torch.empty(batch, heads, state, head_dim, device="cuda")
    source = torch.empty_like(states)
    moved_gb = 2 * states.numel() * states.element_size() / 1e9
    copy_ms = time_ms(lambda: states.copy_(source), budget_s)
    emit(kernel="ssd_state_pass", impl="copy", shape=list(states.shape), ms=round(copy_ms, 4),
         GB_s=round(moved_gb / copy_ms * 1e3, 1))
    for reverse, block, warps, prefetch in itertools.product((False, True), (128, 256, 512, 1024, 2048),
                                                             (1, 2, 4, 8), (False, True)):
        if block < 32 * warps:
            continue
        walk = functools.partial(_pass_states, states, totals, start, end, reverse, block, warps, prefetch)
        ms = time_ms(walk, budget_s)
        emit(kernel="ssd_state_pass", reverse=reverse, block=block, warps=warps, prefetch=prefetch,
             ms=round(ms, 4), GB_s=round(moved_gb / ms * 1e3, 1), fraction_of_copy=round(copy_ms / ms, 3))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters-budget", type=float, default=0.6, help="seconds of timed calls a row")
    parser.add_argument("--pass-sweep", action="store_true", help="only the pass between chunks, every setting")
    args = parser.parse_args(argv)
    preset = PRESETS["ns-2b"]
    batch, length = 8, 4096
    heads, head_dim, state = preset.dendritic_heads, preset.dendritic_head_dim, preset.dendritic_state
    groups, chunk = preset.dendritic_groups, preset.chunk_len
    if args.pass_sweep:
        pass_sweep(batch, heads, length // chunk, state, head_dim, args.iters_budget)
        return 0
    rate = matmul_tflops(args.iters_budget)
    generator = torch.Generator(device="cuda").manual_seed(0)

    def leaf(*shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, generator=generator, device="cuda") * scale).to(dtype).requires_grad_()

    u = leaf(batch, length, heads, head_dim)
    dt = (torch.rand(batch, length, heads, generator=generator, device="cuda") * 0.1).requires_grad_()
    A = (-torch.rand(heads, generator=generator, device="cuda") * 4).requires_grad_()
    B, C = leaf(batch, length, groups, state), leaf(batch, length, groups, state)
    state0 = leaf(batch, heads, state, head_dim, dtype=torch.float32, scale=0.1)
    grad_y = torch.randn(batch, length, heads, head_dim, generator=generator, device="cuda")
    grad_last = torch.randn(batch, heads, state, head_dim, generator=generator, device="cuda")
    leaves = (u, dt, A, B, C, state0)
    gflop = forward_gflop(batch, length, heads, head_dim, groups, state, chunk)
    shape = f"B{batch} T{length} H{heads} P{head_dim} G{groups} N{state} L{chunk} bf16 autocast"
    impls: dict[str, Callable] = {"eager": chunked_scan, "compiled": compiled_chunked_scan(), "triton": ssd_scan}
    for impl, scan in impls.items():

        def forward(scan=scan) -> tuple[torch.Tensor, torch.Tensor]:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return scan(u, dt, A, B, C, chunk, state0)

        def training(forward=forward) -> None:
            for tensor in leaves:
                tensor.grad = None
            y, last = forward()
            torch.autograd.backward((y, last), (grad_y, grad_last))

        for mode, call, work in (("fwd", forward, gflop), ("fwd+bwd", training, 3 * gflop)):
            ms = time_ms(call, args.iters_budget)  # the forward as training runs it: saving for a backward
            floor_ms = work / rate
            emit(kernel="ssd_scan", impl=impl, mode=mode, shape=shape, ms=round(ms, 4),
                 TFLOP_s=round(work / ms, 2), GFLOP=round(work, 2), floor_ms=round(floor_ms, 4),
                 fraction_of_floor=round(floor_ms / ms, 4))  # fmt: skip
        if impl == "triton":
            kernel_split(forward, leaves, (grad_y, grad_last))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
