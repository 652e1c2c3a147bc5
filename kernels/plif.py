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

_BACKWARD_CHUNK_T = 8
"""Steps a backward chunk (see `_plif_backward_kernel`): 8 a thread's registers hold with room
for the loads in flight; 16 spills (sm_90 SASS) and was slower, 4 slower (bench/RESULTS.md,
session 5)."""

_BACKWARD_CHANNELS = 32
"""Channels a backward program: one warp, one channel a thread, the chunk's steps in its registers.
Measured on the H200 (fwd + bwd, Bt 8 x T 4096 x D 2560): 32 and 64 channels about the same,
128 (four a thread) 1.5x slower; Bt 1 x T 32768: 32 channels 1.3-1.5x faster than 64."""

_BACKWARD_STAGES = 4
"""Chunks whose loads are in flight in the backward (the pipeliner's stages): hiding the memory
latency is the whole game for a chain of steps. Measured side by side (bench/RESULTS.md, session
5): Bt 8 x T 4096, 3 and 4 stages alike (0.84-0.95 ms fwd + bwd, repeats included); Bt 1 x T
32768, 4 stages 2.83-2.86 ms against 3.46-3.47 with 3 (6: 2.75)."""


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
    (8, 4) 0.343 ms; Bt 1 x T 32768, 32 channels a program (80 programs: bytes in flight are all
    there is): one step x 12 stages 3.89 ms, (8, 4) 1.76 ms, then in session 5 (8, 4) 1.15-1.18 ms,
    (8, 8) 1.07, (8, 12) 1.37, (16, 6) 0.92, (16, 4) 0.82. The threshold is `_channels_per_program`'s."""
    return (4, 8) if batch * channels >= 8192 else (16, 4)


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
def _backward_step(
    t, offsets, channels, channel_ok, v_pre, grad_v, grad_beta_scaled, grad_threshold,
    v_initial, beta, threshold, alpha,
    v_pre_ptr, grad_spikes_ptr, grad_v_pre_ptr, grad_x_ptr,
    HAS_GRAD_SPIKES: tl.constexpr, HAS_GRAD_V_PRE: tl.constexpr, MASKED: tl.constexpr,
):
    """One step t of the adjoint, given v_pre_t (carried from the step after) and dL/dv_t.
    Returns v_pre_{t-1} (the next step's v_pre) and the updated sums."""
    outer_spike = tl.zeros_like(grad_v)
    outer_v_pre = tl.zeros_like(grad_v)
    # At t = 0 the step before is v0: the load reads this step's own row (a valid address) and
    # its value is not used, so no step needs a mask for it.
    before = offsets - tl.where(t > 0, channels, 0)
    if MASKED:
        if HAS_GRAD_SPIKES:
            outer_spike = tl.load(grad_spikes_ptr + offsets, mask=channel_ok, other=0.0).to(tl.float32)
        if HAS_GRAD_V_PRE:
            outer_v_pre = tl.load(grad_v_pre_ptr + offsets, mask=channel_ok, other=0.0).to(tl.float32)
        v_pre_before = tl.load(v_pre_ptr + before, mask=channel_ok, other=0.0)
    else:
        if HAS_GRAD_SPIKES:
            outer_spike = tl.load(grad_spikes_ptr + offsets).to(tl.float32)
        if HAS_GRAD_V_PRE:
            outer_v_pre = tl.load(grad_v_pre_ptr + offsets).to(tl.float32)
        v_pre_before = tl.load(v_pre_ptr + before)
    # The membrane before this step, rebuilt from the step before's v_pre (soft reset).
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
    # dv_pre/dbeta = v_before - x_t = (v_before - v_pre) / (1 - beta): x is not read at all (a
    # fifth of the backward's traffic); the division happens once, after the loop.
    grad_beta_scaled += grad_v_pre * (v_before - v_pre)
    grad_x = grad_v_pre * (1.0 - beta)
    if MASKED:
        tl.store(grad_x_ptr + offsets, grad_x.to(grad_x_ptr.dtype.element_ty), mask=channel_ok)
    else:
        tl.store(grad_x_ptr + offsets, grad_x.to(grad_x_ptr.dtype.element_ty))
    return v_pre_before, grad_v_pre * beta, grad_beta_scaled, grad_threshold


@triton.jit
def _adjoint_combine(later_decay, later_value, later_weight_a, later_sum_a, later_weight_b, later_sum_b,
                     decay, value, weight_a, sum_a, weight_b, sum_b):
    """The backward's scan, from a chunk's last step back. A run of steps [t..u] maps p_{u+1}
    (dL/dv_pre of the step after it) to p_t = value + decay p_{u+1}, and to two sums over its steps s
    of m_s p_{s+1} (weights m_s: one per sum) = weight p_{u+1} + sum. One step alone is
    (beta (1 - v_th sg_t), e_t, m_t, 0, m'_t, 0); joined with the run after it in time (`later`):"""
    return (decay * later_decay, value + decay * later_value,
            later_weight_a + weight_a * later_decay, later_sum_a + sum_a + weight_a * later_value,
            later_weight_b + weight_b * later_decay, later_sum_b + sum_b + weight_b * later_value)


@triton.jit(do_not_specialize=["channels"])
def _plif_backward_kernel(
    beta_ptr, threshold_ptr, v0_ptr, v_pre_ptr,
    grad_spikes_ptr, grad_v_pre_ptr, grad_v_last_ptr,
    grad_x_ptr, grad_beta_ptr, grad_threshold_ptr, grad_v0_ptr,
    seq_len, channels, alpha,
    HAS_V0: tl.constexpr, HAS_GRAD_SPIKES: tl.constexpr, HAS_GRAD_V_PRE: tl.constexpr,
    HAS_GRAD_V_LAST: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK_T: tl.constexpr,
    STAGES: tl.constexpr, MASKED: tl.constexpr,
):
    """The adjoint from the last step back. Its recursion is linear in dL/dv_pre (v_pre is known),
    p_t = e_t + beta (1 - v_th sg_t) p_{t+1} with e_t = dL/dv_pre_t + dL/ds_t sg_t (sg the
    surrogate), so whole chunks of CHUNK_T steps go at once: (CHUNK_T, BLOCK_D) tiles, time in each
    thread's registers, one scan a chunk (about 52 sm_90 instructions a step against 131 for the
    one-step loop it replaced). The last seq_len % CHUNK_T steps go first, one at a time
    (_backward_step).

    `channels` is not specialised: told that it divides by 16, Triton vectorises 4 channels a
    thread and spreads a chunk's steps over 4 lanes (shuffles in every scan step; and a take-last
    reduction then returns the wrong step, butterfly order, which cost a debugging run)."""
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
    grad_beta_scaled = tl.zeros([BLOCK_D], dtype=tl.float32)  # grad_beta x (1 - beta)
    grad_threshold = tl.zeros([BLOCK_D], dtype=tl.float32)
    base = batch.to(tl.int64) * seq_len * channels + channel
    has_last = channel < tl.where(seq_len > 0, channels, 0)
    v_pre = tl.load(v_pre_ptr + base + (seq_len - 1) * channels, mask=has_last, other=0.0)
    whole = seq_len - seq_len % CHUNK_T
    for back in tl.range(0, seq_len - whole):
        t = seq_len - 1 - back
        v_pre, grad_v, grad_beta_scaled, grad_threshold = _backward_step(
            t, base + t * channels, channels, channel_ok, v_pre, grad_v, grad_beta_scaled,
            grad_threshold, v_initial, beta, threshold, alpha,
            v_pre_ptr, grad_spikes_ptr, grad_v_pre_ptr, grad_x_ptr,
            HAS_GRAD_SPIKES, HAS_GRAD_V_PRE, MASKED,
        )
    # A chunk's rows run backwards in time (row 0 its last step), so the reverse-time recursion is
    # a forward scan (Triton lowers reverse=True with a lane-reversing shuffle a value).
    rows = tl.arange(0, CHUNK_T)
    last_step = (rows == 0)[:, None]  # (CHUNK_T, 1)
    first_step = (rows == CHUNK_T - 1)[:, None]
    tile_ok = (rows >= 0)[:, None] & channel_ok[None, :]  # (CHUNK_T, BLOCK_D)
    # A chunk's elements relative to its last step's: loop-invariant int32, so each chunk's
    # addresses are one scalar added (not a 64-bit product an element).
    tile = channel[None, :] - rows[:, None] * channels  # (CHUNK_T, BLOCK_D)
    row_last = batch.to(tl.int64) * seq_len + whole - 1  # the first chunk's last step's row
    p_after = tl.zeros([BLOCK_D], dtype=tl.float32)  # p at the step after the chunk (0: none)
    for back in tl.range(0, whole, CHUNK_T, num_stages=STAGES):
        shift = (row_last - back) * channels
        zeros = tl.zeros([CHUNK_T, BLOCK_D], dtype=tl.float32)
        outer_spike = zeros
        outer_v_pre = zeros
        if MASKED:
            v_pres = tl.load(v_pre_ptr + shift + tile, mask=tile_ok, other=0.0)
            if HAS_GRAD_SPIKES:
                outer_spike = tl.load(grad_spikes_ptr + shift + tile, mask=tile_ok, other=0.0).to(tl.float32)
            if HAS_GRAD_V_PRE:
                outer_v_pre = tl.load(grad_v_pre_ptr + shift + tile, mask=tile_ok, other=0.0).to(tl.float32)
        else:
            v_pres = tl.load(v_pre_ptr + shift + tile)
            if HAS_GRAD_SPIKES:
                outer_spike = tl.load(grad_spikes_ptr + shift + tile).to(tl.float32)
            if HAS_GRAD_V_PRE:
                outer_v_pre = tl.load(grad_v_pre_ptr + shift + tile).to(tl.float32)
        above = v_pres - threshold[None, :]
        spike = (above > 0).to(tl.float32)
        sig = tl.sigmoid(alpha * above)
        surrogate = alpha * sig * (1.0 - sig)
        # p_t = e_t + (1 - v_th sg_t) g_t with g_t = dL/dv_t = beta p_{t+1}; the chunk's last step
        # takes the arriving grad_v as its g directly.
        through = 1.0 - threshold[None, :] * surrogate
        local = outer_v_pre + outer_spike * surrogate + tl.where(last_step, through * grad_v[None, :], 0.0)
        # dL/dv_th = -sum_t (dL/ds_t sg_t + g_t w_t); dL/dbeta (1 - beta) = sum_t p_t (v_{t-1} - v_pre_t),
        # and sum_t p_t v_{t-1} pairs each step's reset membrane v_s with p_{s+1}: both sums of
        # weights times the next step's p, taken in the scan (no step-before load).
        weight = spike - threshold[None, :] * surrogate
        v_after = v_pres - threshold[None, :] * spike
        _, grad_v_pres, _, threshold_sum, _, beta_sum = tl.associative_scan(
            (beta[None, :] * through, local, tl.where(last_step, 0.0, beta[None, :] * weight), zeros,
             tl.where(last_step, 0.0, v_after), zeros),
            0, _adjoint_combine,
        )
        # Whole-chunk values sit in the first step's row; picked by a masked sum, which is right in
        # any layout (a take-last reduction is not once time spans lanes: warps reduce by butterfly).
        grad_threshold -= tl.sum(tl.where(first_step, threshold_sum, 0.0) + outer_spike * surrogate
                                 + tl.where(last_step, weight * grad_v[None, :], 0.0), 0)
        grad_beta_scaled += tl.sum(tl.where(first_step, beta_sum, 0.0) - grad_v_pres * v_pres
                                   + tl.where(last_step, v_after * p_after[None, :], 0.0), 0)
        grad_x = grad_v_pres * (1.0 - beta)[None, :]
        if MASKED:
            tl.store(grad_x_ptr + shift + tile, grad_x.to(grad_x_ptr.dtype.element_ty), mask=tile_ok)
        else:
            tl.store(grad_x_ptr + shift + tile, grad_x.to(grad_x_ptr.dtype.element_ty))
        p_after = tl.sum(tl.where(first_step, grad_v_pres, 0.0), 0)
        grad_v = beta * p_after
    # The first step's p pairs with v0 (when the chunks reached it; a short T did it step by step).
    grad_beta_scaled += tl.where(whole > 0, p_after * v_initial, 0.0)
    tl.store(grad_v0_ptr + state_offsets, grad_v, mask=channel_ok)
    tl.store(grad_beta_ptr + state_offsets, grad_beta_scaled / (1.0 - beta), mask=channel_ok)
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
        # x is not kept: the backward needs only v_pre (see _backward_step).
        ctx.save_for_backward(beta, v_th, v0, v_pre_f32)
        ctx.x_dtype = x.dtype
        ctx.alpha = alpha
        ctx.set_materialize_grads(False)
        return spikes, v_pre, v_last

    @staticmethod
    def backward(ctx, grad_spikes, grad_v_pre, grad_v_last):
        beta, v_th, v0, v_pre_f32 = ctx.saved_tensors
        batch, seq_len, channels = v_pre_f32.shape
        device = v_pre_f32.device
        grad_x = new_buffer(v_pre_f32.shape, ctx.x_dtype, device)
        grad_v0 = new_buffer((batch, channels), torch.float32, device)
        grad_beta = new_buffer((batch, channels), torch.float32, device)
        grad_threshold = new_buffer((batch, channels), torch.float32, device)

        def pointer(grad: torch.Tensor | None) -> torch.Tensor:
            return grad.contiguous() if grad is not None else v_pre_f32

        block = _BACKWARD_CHANNELS
        grid = (batch, triton.cdiv(channels, block))
        _plif_backward_kernel[grid](
            beta.contiguous(), v_th.contiguous(), v0.contiguous() if v0 is not None else v_pre_f32, v_pre_f32,
            pointer(grad_spikes), pointer(grad_v_pre), pointer(grad_v_last),
            grad_x, grad_beta, grad_threshold, grad_v0,
            seq_len, channels, float(ctx.alpha),
            HAS_V0=v0 is not None, HAS_GRAD_SPIKES=grad_spikes is not None,
            HAS_GRAD_V_PRE=grad_v_pre is not None, HAS_GRAD_V_LAST=grad_v_last is not None,
            BLOCK_D=block, CHUNK_T=_BACKWARD_CHUNK_T, STAGES=_BACKWARD_STAGES,
            MASKED=channels % block != 0, num_warps=1,
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
