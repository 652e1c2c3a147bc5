"""An experiment for issue 5: the PLIF scan as one time step per loop iteration, software-pipelined.

The kernel in kernels/plif.py loads a (CHUNK_T, BLOCK_D) tile and pulls each row out of it with a
masked sum: CHUNK_T operations (and cross-thread shuffles when the tile's rows lie in different
threads) for every element. Here each thread owns one channel and walks time one step per
iteration; `tl.range(..., num_stages=S)` lets the compiler issue the loads of the next S - 1 steps
while the current one computes (the loads do not depend on the membrane), which is what hides the
memory latency of a sequential chain.

Checks each variant against kernels.plif on the same inputs (spikes exactly, everything else to
fp32 rounding), then times forward and forward + backward against it. One JSON row per result.

    python bench/plif_variants.py [--quick]            (CUDA; TRITON_INTERPRET=1 runs it on a CPU)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.plif import plif_scan  # noqa: E402


@triton.jit
def _forward_steps(
    x_ptr, beta_ptr, threshold_ptr, spikes_ptr, v_pre_ptr, v_last_ptr, seq_len, channels,
    BLOCK_D: tl.constexpr, STAGES: tl.constexpr,
):
    batch = tl.program_id(0)
    channel = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # (BLOCK_D,): one per thread
    ok = channel < channels
    beta = tl.load(beta_ptr + channel, mask=ok, other=0.5).to(tl.float32)
    threshold = tl.load(threshold_ptr + channel, mask=ok, other=1.0).to(tl.float32)
    v = tl.zeros([BLOCK_D], dtype=tl.float32)
    base = batch.to(tl.int64) * seq_len * channels + channel
    for t in tl.range(0, seq_len, num_stages=STAGES):
        offsets = base + t * channels
        x_t = tl.load(x_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
        v_pre = beta * v + (1.0 - beta) * x_t
        spike = (v_pre - threshold > 0).to(tl.float32)
        v = v_pre - threshold * spike
        tl.store(spikes_ptr + offsets, spike.to(spikes_ptr.dtype.element_ty), mask=ok)
        tl.store(v_pre_ptr + offsets, v_pre.to(v_pre_ptr.dtype.element_ty), mask=ok)
    tl.store(v_last_ptr + batch * channels + channel, v, mask=ok)


@triton.jit
def _backward_steps(
    x_ptr, beta_ptr, threshold_ptr, v_pre_ptr, grad_spikes_ptr, grad_v_pre_ptr,
    grad_x_ptr, grad_beta_ptr, grad_threshold_ptr, grad_v0_ptr, seq_len, channels, alpha,
    BLOCK_D: tl.constexpr, STAGES: tl.constexpr,
):
    batch = tl.program_id(0)
    channel = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = channel < channels
    state = batch * channels + channel
    beta = tl.load(beta_ptr + channel, mask=ok, other=0.5).to(tl.float32)
    threshold = tl.load(threshold_ptr + channel, mask=ok, other=1.0).to(tl.float32)
    grad_v = tl.zeros([BLOCK_D], dtype=tl.float32)  # dL/dv_t from everything after step t
    grad_beta = tl.zeros([BLOCK_D], dtype=tl.float32)
    grad_threshold = tl.zeros([BLOCK_D], dtype=tl.float32)
    base = batch.to(tl.int64) * seq_len * channels + channel
    v_pre = tl.load(v_pre_ptr + base + (seq_len - 1) * channels, mask=ok, other=0.0)  # seq_len >= 1
    for back in tl.range(0, seq_len, num_stages=STAGES):
        t = seq_len - 1 - back
        offsets = base + t * channels
        x_t = tl.load(x_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
        outer_spike = tl.load(grad_spikes_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
        outer_v_pre = tl.load(grad_v_pre_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
        # The membrane before this step, rebuilt from the step before's v_pre (v0 = 0 here).
        v_pre_previous = tl.load(v_pre_ptr + offsets - channels, mask=channel < tl.where(t > 0, channels, 0), other=0.0)
        v_previous = v_pre_previous - threshold * (v_pre_previous - threshold > 0).to(tl.float32)
        above = v_pre - threshold
        spike = (above > 0).to(tl.float32)
        sig = tl.sigmoid(alpha * above)
        surrogate = alpha * sig * (1.0 - sig)
        grad_spike = outer_spike - threshold * grad_v
        total = outer_v_pre + grad_v + grad_spike * surrogate
        grad_threshold += -grad_v * spike - grad_spike * surrogate
        grad_beta += total * (v_previous - x_t)
        tl.store(grad_x_ptr + offsets, (total * (1.0 - beta)).to(grad_x_ptr.dtype.element_ty), mask=ok)
        grad_v = total * beta
        v_pre = v_pre_previous
    tl.store(grad_v0_ptr + state, grad_v, mask=ok)
    tl.store(grad_beta_ptr + state, grad_beta, mask=ok)
    tl.store(grad_threshold_ptr + state, grad_threshold, mask=ok)


def forward(x, beta, threshold, block_d, stages):
    batch, seq_len, channels = x.shape
    spikes, v_pre = torch.empty_like(x), torch.empty_like(x)
    v_last = x.new_empty(batch, channels)
    grid = (batch, triton.cdiv(channels, block_d))
    _forward_steps[grid](x, beta, threshold, spikes, v_pre, v_last, seq_len, channels,
                         BLOCK_D=block_d, STAGES=stages, num_warps=max(1, block_d // 32))
    return spikes, v_pre, v_last


def backward(x, beta, threshold, v_pre, grad_spikes, grad_v_pre, alpha, block_d, stages):
    batch, seq_len, channels = x.shape
    grad_x = torch.empty_like(x)
    partial = [x.new_empty(batch, channels) for _ in range(3)]
    grid = (batch, triton.cdiv(channels, block_d))
    _backward_steps[grid](x, beta, threshold, v_pre, grad_spikes, grad_v_pre, grad_x, *partial,
                          seq_len, channels, alpha, BLOCK_D=block_d, STAGES=stages,
                          num_warps=max(1, block_d // 32))
    return grad_x, partial[0].sum(0), partial[1].sum(0)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def check(variant: tuple[int, int], device: str) -> float:
    """Largest relative error against kernels.plif on odd sizes (spikes must agree exactly)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 203, 97, generator=generator).to(device)
    beta = (torch.rand(97, generator=generator) * 0.8 + 0.1).to(device)
    threshold = (torch.rand(97, generator=generator) + 0.5).to(device)
    grads = [torch.randn(3, 203, 97, generator=generator).to(device) for _ in range(2)]
    leaves = [t.clone().requires_grad_() for t in (x, beta, threshold)]
    want = plif_scan(*leaves, use_triton=True)
    torch.autograd.backward(want[:2], grads)
    got = forward(x, beta, threshold, *variant)
    assert torch.equal(got[0], want[0]), "spikes differ"
    got_grads = backward(x, beta, threshold, got[1], *grads, 4.0, *variant)
    pairs = list(zip(got[1:], want[1:])) + list(zip(got_grads, [leaf.grad for leaf in leaves]))
    return max(relative_error(a, b.detach()) for a, b in pairs)


def time_size(batch: int, steps: int, variants: list, time_ms, copy_gbs: float) -> None:
    x = torch.randn(batch, steps, 2560, device="cuda")
    beta = torch.rand(2560, device="cuda") * 0.8 + 0.1
    threshold = torch.rand(2560, device="cuda") + 0.5
    grads = [torch.randn_like(x), torch.randn_like(x)]
    io_forward = x.numel() * 4 * 3  # x in, spikes and v_pre out
    io_backward = x.numel() * 4 * 5  # x, v_pre and two gradients in, grad_x out
    size = f"Bt {batch} T {steps} D 2560 fp32"
    with torch.no_grad():
        ms = time_ms(lambda: plif_scan(x, beta, threshold))
    leaves = [t.clone().requires_grad_() for t in (x, beta, threshold)]
    both_ms = time_ms(lambda: torch.autograd.backward(plif_scan(*leaves)[:2], grads))
    row = {"size": size, "impl": "kernels.plif", "fwd_ms": round(ms, 4), "fwd_bwd_ms": round(both_ms, 4)}
    row["fwd_of_copy"] = round(io_forward / ms / 1e6 / copy_gbs, 3)
    print(json.dumps(row), flush=True)
    for variant in variants:
        fwd_ms = time_ms(lambda v=variant: forward(x, beta, threshold, *v))
        _, v_pre, _ = forward(x, beta, threshold, *variant)
        bwd_ms = time_ms(lambda v=variant, v_pre=v_pre: backward(x, beta, threshold, v_pre, *grads, 4.0, *v))
        print(json.dumps({
            "size": size, "impl": f"steps block {variant[0]} stages {variant[1]}",
            "fwd_ms": round(fwd_ms, 4), "fwd_of_copy": round(io_forward / fwd_ms / 1e6 / copy_gbs, 3),
            "bwd_ms": round(bwd_ms, 4), "bwd_of_copy": round(io_backward / bwd_ms / 1e6 / copy_gbs, 3),
            "speedup_fwd": round(ms / fwd_ms, 2), "speedup_fwd_bwd": round(both_ms / (fwd_ms + bwd_ms), 2),
        }), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="check the variants only (no timing)")
    args = parser.parse_args()
    device = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
    variants = [(32, 1), (32, 4), (32, 8), (64, 4), (128, 4), (128, 8)]
    checked = []
    for variant in variants:
        try:
            error = check(variant, device)
            checked.append(variant)
            print(json.dumps({"variant": variant, "check_rel_err": error}), flush=True)
        except Exception as failure:  # noqa: BLE001 - report and go on with the others
            print(json.dumps({"variant": variant, "error": str(failure)[:300]}), flush=True)
    if args.quick or device == "cpu":
        return 0
    spec = importlib.util.spec_from_file_location("bench_kernels", Path(__file__).with_name("kernels.py"))
    bench_kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_kernels)
    copy_bandwidth, time_ms = bench_kernels.copy_bandwidth, bench_kernels.time_ms
    copy_gbs = copy_bandwidth()
    for batch, steps in [(8, 4096), (1, 32768)]:
        time_size(batch, steps, checked, time_ms, copy_gbs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
