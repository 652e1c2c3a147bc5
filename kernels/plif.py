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
from kernels.plif_backward import channel_block, plif_backward


def _channels_per_program(batch: int, channels: int, element_size: int) -> int:
    """One warp a program: 32 channels (one a thread) when rows are few (Bt x D below 8192), so that
    more programs share the SMs (Bt 1 x D 2560: 80 programs); 64 (two a thread, wider loads, faster
    once there are programs enough) when they are many, and always for 2-byte inputs: Triton's
    pipeliner keeps a load in flight ahead of its use only through an asynchronous copy of 4 bytes
    or more a thread (LDGSTS on sm_90), so a bf16 input with one channel a thread would be loaded
    step by step, each step waiting out the memory's latency."""
    return 64 if batch * channels >= 8192 or element_size < 4 else 32


def _forward_unroll_and_stages(batch: int, channels: int) -> tuple[int, int]:
    """The forward's (UNROLL, STAGES): UNROLL steps a loop iteration, the loads of STAGES iterations
    in flight. The loads do not depend on the membrane, so a thread has about UNROLL x (STAGES - 1)
    steps' loads in flight ahead of its chain (one step an iteration at 12 stages: 11), and hiding
    the memory latency is the whole game. Many rows (64 channels a program) take (8, 6), at which
    the forward runs as fast as its access pattern alone (bench/stream_pattern.py); few rows (32
    channels a program, few programs: bytes in flight are all there is) take (16, 4), the fastest
    of the sweep there (`python bench/kernels.py --sweep --only plif`; figures in bench/RESULTS.md).
    The threshold is `_channels_per_program`'s."""
    return (8, 6) if batch * channels >= 8192 else (16, 4)


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
    seq_len, channels_arg, row_stride, x_row_stride, x_step_stride,
    HAS_V0: tl.constexpr, SAVE_F32: tl.constexpr, WRITE_SPIKES: tl.constexpr, BLOCK_D: tl.constexpr,
    UNROLL: tl.constexpr, STAGES: tl.constexpr, EVEN: tl.constexpr, CHANNELS: tl.constexpr,
):
    """The row width is a compile-time constant when CHANNELS > 0 (two channels a thread or more,
    `_channels_per_program`): a width that is not a multiple of 16 (an ns-2b layer's 20 write-gate
    neurons) then still tells Triton that each thread's pair of channels is aligned, so that a
    2-byte input is loaded 4 bytes at a time, which the pipeliner needs (see _PlifScan.forward).

    x may be a slice of a wider tensor (an FFN's gate half of one product): x_row_stride and
    x_step_stride are its strides between rows and steps (its channels contiguous); the outputs
    are contiguous, row_stride apart."""
    batch = tl.program_id(0)
    channel, channels = channel_block(channels_arg, CHANNELS, BLOCK_D)  # (BLOCK_D,): one or more a thread
    channel_ok = channel < channels
    beta = tl.load(beta_ptr + channel, mask=channel_ok, other=0.5).to(tl.float32)
    threshold = tl.load(threshold_ptr + channel, mask=channel_ok, other=1.0).to(tl.float32)
    if HAS_V0:
        v = tl.load(v0_ptr + batch * channels + channel, mask=channel_ok, other=0.0).to(tl.float32)
    else:
        v = tl.zeros([BLOCK_D], dtype=tl.float32)
    # row_stride: elements between batch rows (the whole buffer's T x D; a launch may walk a slice
    # of T starting at the pointers given).
    base = batch.to(tl.int64) * row_stride + channel  # (BLOCK_D,) int64
    x_base = batch.to(tl.int64) * x_row_stride + channel  # (BLOCK_D,) int64
    # UNROLL steps an iteration; the loads do not depend on v, so the pipeliner keeps STAGES
    # iterations' loads in flight ahead of the chain (see _forward_unroll_and_stages).
    for t0 in tl.range(0, seq_len, UNROLL, num_stages=STAGES):
        for i in tl.static_range(UNROLL):
            t = t0 + i
            offsets = base + t * channels
            x_offsets = x_base + t * x_step_stride
            if EVEN:  # whole iterations and channel blocks: no masks (half the loop's instructions)
                x_t = tl.load(x_ptr + x_offsets).to(tl.float32)
                v_pre = beta * v + (1.0 - beta) * x_t
                spike = (v_pre - threshold > 0).to(tl.float32)
                if WRITE_SPIKES:
                    tl.store(spikes_ptr + offsets, spike.to(spikes_ptr.dtype.element_ty))
                tl.store(v_pre_ptr + offsets, v_pre.to(v_pre_ptr.dtype.element_ty))
                if SAVE_F32:
                    tl.store(v_pre_f32_ptr + offsets, v_pre)
                v = v_pre - threshold * spike
            else:
                # The last iteration of a ragged T runs past the end: those steps load and store
                # nothing and leave v as it is.
                live = channel < tl.where(t < seq_len, channels, 0)  # (BLOCK_D,)
                x_t = tl.load(x_ptr + x_offsets, mask=live, other=0.0).to(tl.float32)
                v_pre = beta * v + (1.0 - beta) * x_t
                spike = (v_pre - threshold > 0).to(tl.float32)
                if WRITE_SPIKES:
                    tl.store(spikes_ptr + offsets, spike.to(spikes_ptr.dtype.element_ty), mask=live)
                tl.store(v_pre_ptr + offsets, v_pre.to(v_pre_ptr.dtype.element_ty), mask=live)
                if SAVE_F32:
                    tl.store(v_pre_f32_ptr + offsets, v_pre, mask=live)
                v = tl.where(t < seq_len, v_pre - threshold * spike, v)
    tl.store(v_last_ptr + batch * channels + channel, v, mask=channel_ok)


def _reads_in_place(x: torch.Tensor) -> bool:
    """Whether the forward reads x where it lies: contiguous, or a slice of a wider tensor (the FFN's
    gate and up halves of one product: a copy of each cost a read and a write of the half) whose
    rows and steps start 16-element aligned. A misaligned slice is copied first: its loads could
    not be vectorised and pipelined, and each step would wait out the memory's latency."""
    if x.is_contiguous():
        return True
    aligned = x.stride(0) % 16 == 0 and x.stride(1) % 16 == 0 and x.data_ptr() % 16 == 0
    return x.stride(-1) == 1 and aligned


class _PlifScan(torch.autograd.Function):
    """The Triton forward (one pass over the sequence) and surrogate backward (kernels/plif_backward.py:
    one pass, or for few rows two over time segments and a short one between)."""

    @staticmethod
    def forward(ctx, x, beta, v_th, v0, alpha, with_spikes):
        batch, seq_len, channels = x.shape
        x = x if _reads_in_place(x) else x.contiguous()
        v_pre = new_buffer(x.shape, x.dtype, x.device)
        # Without with_spikes no spike is stored (a third of an fp32 forward's traffic).
        spikes = new_buffer(x.shape, x.dtype, x.device) if with_spikes else v_pre
        # The backward rebuilds the membrane from v_pre, so it keeps an fp32 copy for bf16 inputs.
        save_f32 = x.dtype != torch.float32
        v_pre_f32 = new_buffer(x.shape, torch.float32, x.device) if save_f32 else v_pre
        v_last = new_buffer((batch, channels), torch.float32, x.device)
        block = _channels_per_program(batch, channels, x.element_size())
        unroll, stages = _forward_unroll_and_stages(batch, channels)
        grid = (batch, triton.cdiv(channels, block))
        beta_arg, v_th_arg = beta.contiguous(), v_th.contiguous()
        # A ragged T runs as two launches: its whole iterations unmasked, then the last few steps
        # masked from the first launch's v_last, because one masked loop over all of T (every
        # step's loads, stores and reset behind a mask) is much slower.
        whole = seq_len - seq_len % unroll
        pieces = [(0, whole), (whole, seq_len - whole)] if 0 < whole < seq_len else [(0, seq_len)]
        v0_arg = v0.contiguous() if v0 is not None else v_last
        for start, steps in pieces:
            _plif_forward_kernel[grid](
                x[:, start:], beta_arg, v_th_arg, v0_arg if start == 0 else v_last,
                spikes[:, start:], v_pre[:, start:], v_pre_f32[:, start:], v_last,
                steps, channels, seq_len * channels, x.stride(0), x.stride(1),
                HAS_V0=start > 0 or v0 is not None, SAVE_F32=save_f32, WRITE_SPIKES=with_spikes, BLOCK_D=block,
                UNROLL=unroll, STAGES=stages,
                EVEN=steps % unroll == 0 and channels % block == 0, CHANNELS=channels if block >= 64 else 0,
                num_warps=1,
                # beta v + (1 - beta) x rounded as the reference rounds it (two products, then the
                # sum), not fused into an FMA: a membrane one rounding apart can cross the threshold
                # the other way and send the channel on another spike train (with fusion v_pre is
                # off by a relative 8e-5 at Bt 8 x T 4096 x D 2560).
                enable_fp_fusion=False,
            )
        # x is not kept: the backward needs only v_pre (see _backward_step).
        ctx.save_for_backward(beta, v_th, v0, v_pre_f32)
        ctx.x_dtype = x.dtype
        ctx.alpha = alpha
        ctx.set_materialize_grads(False)
        return (spikes if with_spikes else None), v_pre, v_last

    @staticmethod
    def backward(ctx, grad_spikes, grad_v_pre, grad_v_last):
        beta, v_th, v0, v_pre_f32 = ctx.saved_tensors
        grad_x, grad_beta, grad_threshold, grad_v0 = plif_backward(
            beta, v_th, v0, v_pre_f32, grad_spikes, grad_v_pre, grad_v_last, ctx.alpha, ctx.x_dtype)
        return (
            grad_x,
            grad_beta.to(beta.dtype),
            grad_threshold.to(v_th.dtype),
            grad_v0.to(v0.dtype) if v0 is not None else None,
            None,
            None,
        )


class _PlifScanTorch(torch.autograd.Function):
    """The scan without a GPU: the reference's forward values (the same operations in the same
    order), and the Triton kernel's backward as one reverse loop of plain tensor operations.

    The reference runs every step through autograd: about twenty small graph nodes a step, whose
    bookkeeping would be most of a CPU step of the NS models. Here the forward keeps v_pre and
    the backward is four operations a step; everything that does not chain in time is done for
    all steps at once.
    """

    @staticmethod
    def forward(ctx, x, beta, v_th, v0, alpha, with_spikes):
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
        spikes = (v_pre - thresholdf > 0).to(x.dtype) if with_spikes else None
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
    return _scan_function(x, use_triton).apply(x, beta, v_th, v0, alpha, True)


def plif_membrane(
    x: torch.Tensor,
    beta: torch.Tensor,
    v_th: torch.Tensor,
    v0: torch.Tensor | None = None,
    alpha: float = 4.0,
    *,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`plif_scan` without the spikes: v_pre (Bt, T, D) and v_last (Bt, D), the same values and
    gradients. For callers that read only the membrane (the NS layers in training): an fp32 scan's
    forward then writes 8 bytes a step and channel instead of 12."""
    _, v_pre, v_last = _scan_function(x, use_triton).apply(x, beta, v_th, v0, alpha, False)
    return v_pre, v_last


def _scan_function(x: torch.Tensor, use_triton: bool | None) -> type[torch.autograd.Function]:
    """The Triton scan where `wants_triton` says so, else the plain-PyTorch one."""
    return _PlifScan if wants_triton(x, use_triton) else _PlifScanTorch
