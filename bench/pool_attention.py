"""Benchmark of the NS pool read's flash kernel (kernels/pool_attention.py) on the GPU.

Side by side in one process, at the hippocampal layer's shape (B 8, H 20, T 4096, d 128, bf16):
SDPA flash and SDPA cuDNN (causal, no bias: the yardsticks; SDPA's default order tries
FlashAttention-2 first, and cuDNN's fused attention is the faster one on Hopper by published
measurements), flex_attention with the per-key bias as a score_mod
(the read's previous CUDA path) and the Triton kernel, forward and forward + backward. Each row
holds the median ms, the achieved TFLOP/s on causal attention's FLOPs (forward 2 B H T^2 d,
backward 2.5x that: the count flash attention quotes) and the Triton kernel's arithmetic floor:
its own matmul FLOPs (2 block matmuls a block pair forward, 7 backward: dQ recomputes the scores
and dP instead of adding with atomics) over the measured bf16 matmul rate. A last row gives the
ratios. `--shapes` times other (B, T) at H 20, d 128: a 16K or 32K row is the long-context
update's shape (B 2 x T 16384, B 1 x T 32768, the same 32,768 tokens). `--sweep` times tile
variants of each kernel instead, each checked against the reference first.
Run: `python bench/pool_attention.py [--out rows.jsonl] [--quick] [--shapes 8x4096,1x32768] [--sweep]`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

# The repository root first: run as a script, bench/ would lead sys.path and its kernels.py
# would shadow the kernels package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kernels import time_ms  # noqa: E402
from engine.models.ns.pool_read import pool_read_flex, pool_read_kernel  # noqa: E402
from kernels import pool_attention as pool_attention_module  # noqa: E402
from kernels.pool_attention import Blocks, pool_attention, pool_attention_reference  # noqa: E402

ROWS: list[dict] = []


def emit(**row) -> dict:
    ROWS.append(row)
    print(json.dumps(row), flush=True)
    return row


def matmul_tflops() -> float:
    """The card's bf16 matmul rate, TFLOP/s, on one 8192^3 product."""
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ms = time_ms(lambda: a @ b)
    rate = 2 * 8192**3 / ms / 1e9
    emit(kernel="matmul", size="8192^3 bf16", impl="torch", ms=round(ms, 4), TFLOP_s=round(rate, 1))
    return rate


def read_inputs(batch: int, heads: int, length: int, head_dim: int) -> dict[str, torch.Tensor]:
    """Leaves of one read, as a layer hands them over (bf16 q, k, v; fp32 tags, clocks, rates)."""
    generator = torch.Generator(device="cuda").manual_seed(0)

    def leaf(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=generator, device="cuda", dtype=torch.float32).to(dtype)

    q, k, v = (leaf(batch, heads, length, head_dim) for _ in range(3))
    log_tag = torch.nn.functional.logsigmoid(leaf(batch, heads, length, dtype=torch.float32))
    clock = (torch.rand(batch, heads, length, generator=generator, device="cuda") * 2).cumsum(-1)
    rate = torch.linspace(0.002, 0.5, heads, device="cuda")
    leaves = {"q": q, "k": k, "v": v, "log_tag": log_tag, "clock": clock, "rate": rate}
    return {name: tensor.requires_grad_() for name, tensor in leaves.items()}


def causal_gflop(batch: int, heads: int, length: int, head_dim: int) -> float:
    """Forward FLOPs of causal attention, GFLOP: two matmuls of T x T x d, half of them masked."""
    return 2 * batch * heads * length * length * head_dim / 1e9


def training_call(read: Callable[[], torch.Tensor], grad: torch.Tensor, leaves: dict) -> Callable[[], None]:
    def call() -> None:
        for tensor in leaves.values():
            tensor.grad = None
        read().backward(grad)

    return call


def bench_shape(batch: int, heads: int, length: int, head_dim: int, rate_tflops: float) -> None:
    size = f"B {batch} H {heads} T {length} d {head_dim} bf16"
    leaves = read_inputs(batch, heads, length, head_dim)
    q, k, v = leaves["q"], leaves["k"], leaves["v"]
    bias_args = (leaves["log_tag"], leaves["clock"], leaves["rate"])
    grad = torch.randn_like(q)
    forward_gflop = causal_gflop(batch, heads, length, head_dim)
    reads: dict[str, Callable[[], torch.Tensor]] = {
        "sdpa_flash": lambda: _sdpa(q, k, v, "FLASH_ATTENTION"),
        "sdpa_cudnn": lambda: _sdpa(q, k, v, "CUDNN_ATTENTION"),
        "flex_score_mod": lambda: pool_read_flex(q, k, v, *bias_args),
        "triton": lambda: pool_read_kernel(q, k, v, *bias_args),
    }
    times: dict[str, float] = {}
    for impl, read in reads.items():
        try:
            with torch.no_grad():
                times[f"{impl}_fwd"] = time_ms(read)
            times[f"{impl}_fwd_bwd"] = time_ms(training_call(read, grad, leaves))
        except Exception as failure:  # one path's failure must not hide the others' figures
            emit(kernel="pool_attention", size=size, impl=impl, error=f"{type(failure).__name__}: {failure}"[:2000])
            continue
        for mode, gflop, kernel_gflop in (
            ("fwd", forward_gflop, forward_gflop),
            ("fwd_bwd", 3.5 * forward_gflop, 4.5 * forward_gflop),
        ):
            ms = times[f"{impl}_{mode}"]
            row = {"kernel": "pool_attention", "size": size, "impl": f"{impl}_{mode}", "ms": round(ms, 4),
                   "TFLOP_s": round(gflop / ms, 1)}
            if impl == "triton":
                # The floor counts the kernel's own block matmuls (7 backward, not flash's 5).
                row["floor_ms"] = round(kernel_gflop / rate_tflops, 4)
                row["frac_of_matmul_rate"] = round(kernel_gflop / ms / rate_tflops, 3)
            emit(**row)
    summary = {"kernel": "pool_attention", "size": size, "impl": "ratio"}
    for mode in ("fwd", "fwd_bwd"):
        for other in ("sdpa_flash", "sdpa_cudnn", "flex_score_mod"):
            if f"triton_{mode}" in times and f"{other}_{mode}" in times:
                summary[f"triton_over_{other}_{mode}"] = round(times[f"triton_{mode}"] / times[f"{other}_{mode}"], 3)
    emit(**summary)
    torch.cuda.empty_cache()


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str) -> torch.Tensor:
    """Causal SDPA without a bias through one backend: FLASH_ATTENTION (FlashAttention-2, SDPA's
    first choice by default) or CUDNN_ATTENTION (cuDNN's fused attention)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(getattr(SDPBackend, backend)):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def _check_error(generator_seed: int = 1) -> float:
    """The kernel's largest relative error over output and gradients at a ragged bf16 shape,
    against the float32 reference (a tile variant must be right before it is timed)."""
    generator = torch.Generator(device="cuda").manual_seed(generator_seed)
    shape = (2, 3, 1000, 128)
    q, k, v, grad = (torch.randn(*shape, generator=generator, device="cuda").bfloat16() for _ in range(4))
    bias = -torch.rand(2, 3, 1000, generator=generator, device="cuda") * 50
    results = []
    for attention, cast in ((pool_attention, None), (pool_attention_reference, torch.float32)):
        leaves = [(t.to(cast) if cast else t).detach().requires_grad_() for t in (q, k, v, bias)]
        out, _ = attention(*leaves)
        out.backward(grad.to(out.dtype))
        results.append([out] + [leaf.grad for leaf in leaves])
    errors = []
    for got, want in zip(*results):
        want = want.detach().double()
        errors.append(float((got.detach().double() - want).abs().max() / want.abs().max()))
    return max(errors)


def sweep(rate_tflops: float) -> None:
    """Tile variants of each kernel at B 8, H 20, T 4096, d 128, bf16: forward variants timed
    forward only, backward variants forward + backward (the forward at the table's tiles)."""
    batch, heads, length, head_dim = 8, 20, 4096, 128
    table = pool_attention_module._blocks(128, 2)
    # The table's own first in each list; the rest as bench/sass_report.py's sm_90 compile sees
    # them: key side 64 x 128 spills 112 bytes, 64 x 64 (4 warps) 136, the others none.
    forward = [table.forward, (128, 128, 8, 3), (128, 64, 8, 4), (128, 32, 8, 3), (64, 64, 4, 3)]
    key_side = [table.key_side, (32, 128, 8, 3), (64, 128, 8, 2), (32, 64, 4, 3), (64, 64, 4, 3)]
    query_side = [table.query_side, (128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3)]
    variants = ([Blocks(f, table.key_side, table.query_side) for f in forward]
                + [Blocks(table.forward, ks, table.query_side) for ks in key_side]
                + [Blocks(table.forward, table.key_side, qs) for qs in query_side])
    leaves = read_inputs(batch, heads, length, head_dim)
    q, k, v = leaves["q"], leaves["k"], leaves["v"]
    bias_args = (leaves["log_tag"], leaves["clock"], leaves["rate"])
    grad = torch.randn_like(q)
    forward_gflop = causal_gflop(batch, heads, length, head_dim)
    original = pool_attention_module._blocks
    for blocks in dict.fromkeys(variants):
        pool_attention_module._blocks = lambda *_args, blocks=blocks: blocks
        config = f"fwd {blocks.forward} key side {blocks.key_side} query side {blocks.query_side}"
        try:
            error = _check_error()
            with torch.no_grad():
                forward_ms = time_ms(lambda: pool_read_kernel(q, k, v, *bias_args))
            both_ms = time_ms(training_call(lambda: pool_read_kernel(q, k, v, *bias_args), grad, leaves))
            emit(kernel="sweep_pool_attention", size=config, impl="triton", fwd_ms=round(forward_ms, 4),
                 fwd_bwd_ms=round(both_ms, 4), bwd_ms=round(both_ms - forward_ms, 4),
                 fwd_TFLOP_s=round(forward_gflop / forward_ms, 1),
                 bwd_TFLOP_s=round(2.5 * forward_gflop / (both_ms - forward_ms), 1),
                 frac_of_matmul_rate=round(4.5 * forward_gflop / both_ms / rate_tflops, 3), rel_err=error)
        except Exception as failure:
            emit(kernel="sweep_pool_attention", size=config, error=f"{type(failure).__name__}: {failure}"[:1000])
    pool_attention_module._blocks = original


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, help="also write the rows here as JSON lines")
    parser.add_argument("--quick", action="store_true", help="a small shape (a smoke run)")
    parser.add_argument("--sweep", action="store_true", help="also time tile variants of the kernels")
    parser.add_argument("--shapes", default="8x4096", help="comma-separated BxT at H 20, d 128 (default 8x4096)")
    args = parser.parse_args()
    shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",")]
    if not torch.cuda.is_available():
        print("bench/pool_attention.py needs a CUDA GPU", file=sys.stderr)
        return 2
    emit(device=torch.cuda.get_device_name(), torch=torch.__version__,
         date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    rate = matmul_tflops()
    emit(kernel="pool_attention", impl="check", size="B 2 H 3 T 1000 d 128 bf16", rel_err=_check_error())
    if args.quick:
        bench_shape(2, 4, 1024, 128, rate)
    for batch, length in [] if args.quick else shapes:
        bench_shape(batch, 20, length, 128, rate)
    if args.sweep:
        sweep(rate)
    if args.out:
        args.out.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
