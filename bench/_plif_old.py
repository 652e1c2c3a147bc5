"""PLIF (parametric leaky integrate-and-fire) spike scan with a soft reset and a surrogate gradient.

    v_pre_t = beta v_{t-1} + (1 - beta) x_t
    s_t     = 1[v_pre_t - v_th > 0]
    v_t     = v_pre_t - v_th s_t            (soft reset; the reset is part of the graph)

The Heaviside step has no useful derivative, so the backward uses a sigmoid surrogate:
ds/dv_pre = alpha sig(alpha (v_pre - v_th)) (1 - sig(alpha (v_pre - v_th))). Gradients reach
x, beta, v_th and v0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._dispatch import compute_dtype, new_buffer, wants_triton

_BACKWARD_STAGES = 12
"""Time steps in flight in the backward: the loads of the next steps issue while this one computes
(a channel is a sequential chain, so hiding the memory latency is the whole game). Measured on the
H200 when both directions walked one step an iteration with it (Bt 8, T 4096, D 2560, fp32;
bench/RESULTS.md): 1 stage 0.44x the tiled kernel this replaced, 4 stages 0.94x, 8 stages 1.5x,
12 stages 1.7x; 16 no better. Unrolling the backward's steps as the forward's
(`_forward_unroll_and_stages`) was slower at Bt 8 x T 4096 (bench/plif_variants.py of commit
bee4480, 2026-11-29), so the backward keeps one step an iteration."""


def _channels_per_program(batch: int, channels: int) -> int:
    """One warp a program: 32 channels (one a thread) when rows are few, so that more programs share
    the SMs (Bt 1 x D 2560: 80 programs); 64 (two a thread) when they are many (Bt 8: 10 % faster)."""
    return 64 if batch * channels >= 8192 else 32


def _forward_unroll_and_stages(batch: int, channels: int) -> tuple[int, int]:
    """The forward's (UNROLL, STAGES): UNROLL steps a loop iteration, the loads of STAGES iterations
    in flight. The loads do not depend on the membrane, so a thread has about UNROLL x (STAGES - 1)
    steps' loads in flight ahead of its chain (one step an iteration at 12 stages: 11), and hiding
    the memory latency is the whole game. Measured side by side on the H200 (2026-11-29,
    `python bench/kernels.py --sweep --only plif`), D 2560, fp32, forward: Bt 8 x T 4096, 64
    channels a program: one step x 12 stages 0.534 ms (44 % of copy), (4, 8) 0.340 ms (69 %),
    (8, 4) 0.343 ms; Bt 1 x T 32768, 32 channels a program: one step x 12 stages 3.89 ms,
    (8, 4) 1.76 ms, (4, 8) with 64 channels 2.37 ms. The threshold is `_channels_per_program`'s."""
    return (4, 8) if batch * channels >= 8192 else (8, 4)


def spike_with_surrogate(v_minus_threshold: torch.Tensor, alpha: float) -> torch.Tensor:
    """Heaviside step forward, sigmoid-surrogate derivative backward, in plain autograd.

    The forward value is exactly the step: surrogate - surrogate.detach() is exactly 0.
    """
    surrogate = torch.sigmoid(alpha * v_minus_threshold)
    step = (v_minus_threshold > 0).to(v_minus_threshold.dtype)
    return step + (surrogate - surrogate.detach())


def plif_scan_reference(
    x: torch.Tensor,
    beta: torch.Tensor,
    v_th: torch.Tensor,
    v0: torch.Tensor | None = None,
    alpha: float = 4.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The scan step by step in plain PyTorch autograd (the definition the kernel is tested against).

    x (Bt, T, D); beta (D,) in (0, 1); v_th (D,) > 0; v0 (Bt, D) or None (zeros).
    Returns spikes and v_pre (Bt, T, D) in x's dtype and v_last (Bt, D) in fp32 (fp64 for fp64 inputs).
    """
    batch, seq_len, channels = x.shape
    dtype = compute_dtype(x, beta, v_th, v0)
    xf, betaf, thresholdf = x.to(dtype), beta.to(dtype), v_th.to(dtype)
    v = v0.to(dtype) if v0 is not None else x.new_zeros(batch, channels, dtype=dtype)
    spikes, potentials = [], []
    for t in range(seq_len):
        v_pre = betaf * v + (1 - betaf) * xf[:, t]  # (Bt, D)
        spike = spike_with_surrogate(v_pre - thresholdf, alpha)  # (Bt, D)
        v = v_pre - thresholdf * spike
        spikes.append(spike)
        potentials.append(v_pre)
    if seq_len == 0:
        empty = x.new_zeros(batch, 0, channels)
        return empty, empty.clone(), v
    return torch.stack(spikes, 1).to(x.dtype), torch.stack(potentials, 1).to(x.dtype), v


@triton.jit
def _plif_forward_kernel(
    x_ptr, beta_ptr, threshold_ptr, v0_ptr, spikes_ptr, v_pre_ptr, v_pre_f32_ptr, v_last_ptr,
    seq_len, channels,
    HAS_V0: tl.constexpr, SAVE_F32: tl.constexpr, BLOCK_D: tl.constexpr, UNROLL: tl.constexpr,
    STAGES: tl.constexpr, EVEN: tl.constexpr,
):
    batch = tl.program_id(0)
    channel = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # (BLOCK_D,): one per thread
    channel_ok = channel < channels
    beta = tl.load(beta_ptr + channel, mask=channel_ok, other=0.5).to(tl.float32)
    threshold = tl.load(threshold_ptr + channel, mask=channel_ok, other=1.0).to(tl.float32)
    if HAS_V0:
        v = tl.load(v0_ptr + batch * channels + channel, mask=channel_ok, other=0.0).to(tl.float32)
    else:
        v = tl.zeros([BLOCK_D], dtype=tl.float32)
    base = batch.to(tl.int64) * seq_len * channels + channel  # (BLOCK_D,) int64
    # UNROLL steps an iteration; the loads do not depend on v, so the pipeliner keeps STAGES
    # iterations' loads in flight ahead of the chain (see _forward_unroll_and_stages).
    for t0 in tl.range(0, seq_len, UNROLL, num_stages=STAGES):
        for i in tl.static_range(UNROLL):
            t = t0 + i
            offsets = base + t * channels
            if EVEN:  # whole iterations and channel blocks: no masks (half the loop's instructions)
                x_t = tl.load(x_ptr + offsets).to(tl.float32)
                v_pre = beta * v + (1.0 - beta) * x_t
                spike = (v_pre - threshold > 0).to(tl.float32)
                tl.store(spikes_ptr + offsets, spike.to(spikes_ptr.dtype.element_ty))
                tl.store(v_pre_ptr + offsets, v_pre.to(v_pre_ptr.dtype.element_ty))
                if SAVE_F32:
                    tl.store(v_pre_f32_ptr + offsets, v_pre)
                v = v_pre - threshold * spike
            else:
                # The last iteration of a ragged T runs past the end: those steps load and store
                # nothing and leave v as it is.
                live = channel < tl.where(t < seq_len, channels, 0)  # (BLOCK_D,)
                x_t = tl.load(x_ptr + offsets, mask=live, other=0.0).to(tl.float32)
                v_pre = beta * v + (1.0 - beta) * x_t
                spike = (v_pre - threshold > 0).to(tl.float32)
                tl.store(spikes_ptr + offsets, spike.to(spikes_ptr.dtype.element_ty), mask=live)
                tl.store(v_pre_ptr + offsets, v_pre.to(v_pre_ptr.dtype.element_ty), mask=live)
                if SAVE_F32:
                    tl.store(v_pre_f32_ptr + offsets, v_pre, mask=live)
                v = tl.where(t < seq_len, v_pre - threshold * spike, v)
    tl.store(v_last_ptr + batch * channels + channel, v, mask=channel_ok)


@triton.jit
def _plif_backward_kernel(
    x_ptr, beta_ptr, threshold_ptr, v0_ptr, v_pre_ptr,
    grad_spikes_ptr, grad_v_pre_ptr, grad_v_last_ptr,
    grad_x_ptr, grad_beta_ptr, grad_threshold_ptr, grad_v0_ptr,
    seq_len, channels, alpha,
    HAS_V0: tl.constexpr, HAS_GRAD_SPIKES: tl.constexpr, HAS_GRAD_V_PRE: tl.constexpr,
    HAS_GRAD_V_LAST: tl.constexpr, BLOCK_D: tl.constexpr, STAGES: tl.constexpr,
):
    batch = tl.program_id(0)
    channel = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    channel_ok = channel < channels
    state_offsets = batch * channels + channel
    beta = tl.load(beta_ptr + channel, mask=channel_ok, other=0.5).to(tl.float32)
    threshold = tl.load(threshold_ptr + channel, mask=channel_ok, other=1.0).to(tl.float32)
    if HAS_V0:
        v_initial = tl.load(v0_ptr + state_offsets, mask=channel_ok, other=0.0).to(tl.float32)
    else:
        v_initial = tl.zeros([BLOCK_D], dtype=tl.float32)
    # grad_v: dL/dv_t through everything after step t; starts at dL/dv_last.
    if HAS_GRAD_V_LAST:
        grad_v = tl.load(grad_v_last_ptr + state_offsets, mask=channel_ok, other=0.0).to(tl.float32)
    else:
        grad_v = tl.zeros([BLOCK_D], dtype=tl.float32)
    grad_beta = tl.zeros([BLOCK_D], dtype=tl.float32)
    grad_threshold = tl.zeros([BLOCK_D], dtype=tl.float32)
    base = batch.to(tl.int64) * seq_len * channels + channel
    has_last = channel < tl.where(seq_len > 0, channels, 0)
    v_pre = tl.load(v_pre_ptr + base + (seq_len - 1) * channels, mask=has_last, other=0.0)
    for back in tl.range(0, seq_len, num_stages=STAGES):
        t = seq_len - 1 - back
        offsets = base + t * channels
        x_t = tl.load(x_ptr + offsets, mask=channel_ok, other=0.0).to(tl.float32)
        outer_spike = tl.zeros([BLOCK_D], dtype=tl.float32)
        if HAS_GRAD_SPIKES:
            outer_spike = tl.load(grad_spikes_ptr + offsets, mask=channel_ok, other=0.0).to(tl.float32)
        outer_v_pre = tl.zeros([BLOCK_D], dtype=tl.float32)
        if HAS_GRAD_V_PRE:
            outer_v_pre = tl.load(grad_v_pre_ptr + offsets, mask=channel_ok, other=0.0).to(tl.float32)
        # The membrane before this step, rebuilt from the step before's v_pre (soft reset); the
        # next iteration's v_pre, carried instead of loaded twice.
        has_before = channel < tl.where(t > 0, channels, 0)
        v_pre_before = tl.load(v_pre_ptr + offsets - channels, mask=has_before, other=0.0)
        v_before = v_pre_before - threshold * (v_pre_before - threshold > 0).to(tl.float32)
        v_before = tl.where(t > 0, v_before, v_initial)
        above = v_pre - threshold
        spike = (above > 0).to(tl.float32)
        sig = tl.sigmoid(alpha * above)
        surrogate = alpha * sig * (1.0 - sig)
        # Everything that reaches s_t: its own output gradient and the reset in v_t.
        grad_spike = outer_spike - threshold * grad_v
        grad_v_pre = outer_v_pre + grad_v + grad_spike * surrogate
        grad_threshold += -grad_v * spike - grad_spike * surrogate
        grad_beta += grad_v_pre * (v_before - x_t)
        grad_x = grad_v_pre * (1.0 - beta)
        tl.store(grad_x_ptr + offsets, grad_x.to(grad_x_ptr.dtype.element_ty), mask=channel_ok)
        grad_v = grad_v_pre * beta
        v_pre = v_pre_before
    tl.store(grad_v0_ptr + state_offsets, grad_v, mask=channel_ok)
    tl.store(grad_beta_ptr + state_offsets, grad_beta, mask=channel_ok)
    tl.store(grad_threshold_ptr + state_offsets, grad_threshold, mask=channel_ok)


class _PlifScan(torch.autograd.Function):
    """The Triton forward and surrogate backward, one pass over the sequence each."""

    @staticmethod
    def forward(ctx, x, beta, v_th, v0, alpha):
        batch, seq_len, channels = x.shape
        x = x.contiguous()
        spikes = new_buffer(x.shape, x.dtype, x.device)
        v_pre = new_buffer(x.shape, x.dtype, x.device)
        # The backward rebuilds the membrane from v_pre, so it keeps an fp32 copy for bf16 inputs.
        save_f32 = x.dtype != torch.float32
        v_pre_f32 = new_buffer(x.shape, torch.float32, x.device) if save_f32 else v_pre
        v_last = new_buffer((batch, channels), torch.float32, x.device)
        v0_arg = v0.contiguous() if v0 is not None else v_last
        block = _channels_per_program(batch, channels)
        unroll, stages = _forward_unroll_and_stages(batch, channels)
        grid = (batch, triton.cdiv(channels, block))
        _plif_forward_kernel[grid](
            x, beta.contiguous(), v_th.contiguous(), v0_arg, spikes, v_pre, v_pre_f32, v_last,
            seq_len, channels,
            HAS_V0=v0 is not None, SAVE_F32=save_f32, BLOCK_D=block, UNROLL=unroll, STAGES=stages,
            EVEN=seq_len % unroll == 0 and channels % block == 0, num_warps=1,
        )
        ctx.save_for_backward(x, beta, v_th, v0, v_pre_f32)
        ctx.alpha = alpha
        ctx.set_materialize_grads(False)
        return spikes, v_pre, v_last

    @staticmethod
    def backward(ctx, grad_spikes, grad_v_pre, grad_v_last):
        x, beta, v_th, v0, v_pre_f32 = ctx.saved_tensors
        batch, seq_len, channels = x.shape
        grad_x = new_buffer(x.shape, x.dtype, x.device)
        grad_v0 = new_buffer((batch, channels), torch.float32, x.device)
        grad_beta = new_buffer((batch, channels), torch.float32, x.device)
        grad_threshold = new_buffer((batch, channels), torch.float32, x.device)

        def pointer(grad: torch.Tensor | None) -> torch.Tensor:
            return grad.contiguous() if grad is not None else x

        block = _channels_per_program(batch, channels)
        grid = (batch, triton.cdiv(channels, block))
        _plif_backward_kernel[grid](
            x, beta.contiguous(), v_th.contiguous(), v0.contiguous() if v0 is not None else x, v_pre_f32,
            pointer(grad_spikes), pointer(grad_v_pre), pointer(grad_v_last),
            grad_x, grad_beta, grad_threshold, grad_v0,
            seq_len, channels, float(ctx.alpha),
            HAS_V0=v0 is not None, HAS_GRAD_SPIKES=grad_spikes is not None,
            HAS_GRAD_V_PRE=grad_v_pre is not None, HAS_GRAD_V_LAST=grad_v_last is not None,
            BLOCK_D=block, STAGES=_BACKWARD_STAGES, num_warps=1,
        )
        # Per-row partials summed here in a fixed order (no atomics: deterministic).
        return (
            grad_x,
            grad_beta.sum(0).to(beta.dtype),
            grad_threshold.sum(0).to(v_th.dtype),
            grad_v0.to(v0.dtype) if v0 is not None else None,
            None,
        )


class _PlifScanTorch(torch.autograd.Function):
    """The scan without a GPU: the reference's forward values (the same operations in the same
    order), and the Triton kernel's backward as one reverse loop of plain tensor operations.

    The reference runs every step through autograd: about twenty small graph nodes a step, and
    their bookkeeping was most of a CPU step of the NS models. Here the forward keeps v_pre and
    the backward is four operations a step; everything that does not chain in time is done for
    all steps at once.
    """

    @staticmethod
    def forward(ctx, x, beta, v_th, v0, alpha):
        batch, seq_len, channels = x.shape
        dtype = compute_dtype(x, beta, v_th, v0)
        betaf, thresholdf = beta.to(dtype), v_th.to(dtype)
        drive = (1 - betaf) * x.to(dtype)  # (Bt, T, D): the reference's (1 - beta) x_t, all steps
        v = v0.to(dtype) if v0 is not None else x.new_zeros(batch, channels, dtype=dtype)
        v_pre = torch.empty(batch, seq_len, channels, dtype=dtype, device=x.device)
        for t in range(seq_len):
            step = betaf * v + drive[:, t]  # (Bt, D)
            v_pre[:, t] = step
            v = step - thresholdf * (step - thresholdf > 0).to(dtype)
        spikes = (v_pre - thresholdf > 0).to(x.dtype)
        ctx.save_for_backward(x, beta, v_th, v0, v_pre)
        ctx.alpha = alpha
        ctx.set_materialize_grads(False)
        return spikes, v_pre.to(x.dtype), v

    @staticmethod
    def backward(ctx, grad_spikes, grad_v_pre, grad_v_last):
        x, beta, v_th, v0, v_pre = ctx.saved_tensors
        batch, seq_len, channels = x.shape
        dtype, alpha = v_pre.dtype, ctx.alpha
        betaf, thresholdf = beta.to(dtype), v_th.to(dtype)
        above = v_pre - thresholdf  # (Bt, T, D)
        spikes = (above > 0).to(dtype)
        sig = torch.sigmoid(alpha * above)
        surrogate = alpha * sig * (1 - sig)  # ds/dv_pre
        outer_spikes = grad_spikes.to(dtype) if grad_spikes is not None else torch.zeros_like(v_pre)
        outer_v_pre = grad_v_pre.to(dtype) if grad_v_pre is not None else torch.zeros_like(v_pre)
        # dL/dv_t through everything after step t, starting at dL/dv_last.
        grad_v = grad_v_last.to(dtype) if grad_v_last is not None else x.new_zeros(batch, channels, dtype=dtype)
        grad_v_after = torch.empty_like(v_pre)  # (Bt, T, D): dL/dv_t as step t sees it
        total_v_pre = torch.empty_like(v_pre)  # (Bt, T, D): dL/dv_pre_t, everything included
        for t in range(seq_len - 1, -1, -1):
            grad_v_after[:, t] = grad_v
            grad_spike = outer_spikes[:, t] - thresholdf * grad_v  # s_t's own gradient and the reset's
            total = outer_v_pre[:, t] + grad_v + grad_spike * surrogate[:, t]
            total_v_pre[:, t] = total
            grad_v = total * betaf
        grad_spike_all = outer_spikes - thresholdf * grad_v_after
        initial = v0.to(dtype) if v0 is not None else x.new_zeros(batch, channels, dtype=dtype)
        v_before = torch.cat([initial[:, None], (v_pre - thresholdf * spikes)[:, :-1]], dim=1)  # v_{t-1}
        grad_beta = (total_v_pre * (v_before - x.to(dtype))).sum((0, 1))
        grad_threshold = (-grad_v_after * spikes - grad_spike_all * surrogate).sum((0, 1))
        return (
            (total_v_pre * (1 - betaf)).to(x.dtype),
            grad_beta.to(beta.dtype),
            grad_threshold.to(v_th.dtype),
            grad_v.to(v0.dtype) if v0 is not None else None,
            None,
        )


def plif_scan(
    x: torch.Tensor,
    beta: torch.Tensor,
    v_th: torch.Tensor,
    v0: torch.Tensor | None = None,
    alpha: float = 4.0,
    *,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The PLIF scan (see the module docstring): Triton on CUDA, elsewhere the reference's forward
    with a hand-written backward (`_PlifScanTorch`).

    use_triton: None picks Triton on CUDA; True forces it (off CUDA only under
    TRITON_INTERPRET=1); False forces the plain-PyTorch path.
    """
    if wants_triton(x, use_triton):
        return _PlifScan.apply(x, beta, v_th, v0, alpha)
    return _PlifScanTorch.apply(x, beta, v_th, v0, alpha)
