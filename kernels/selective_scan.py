"""Selective scan (Mamba-style diagonal SSM) over a sequence, with a carried state.

    h_t[d, n] = exp(delta_t[d] A[d, n]) h_{t-1}[d, n] + delta_t[d] B_t[g(d), n] x_t[d]
    y_t[d]    = sum_n C_t[g(d), n] h_t[d, n] + D[d] x_t[d]

where channel d reads group g(d) = d // (Dm // G) of B and C. The state is kept in fp32
whatever the input dtype; y comes back in x's dtype, h_last in fp32 so that TBPTT chunks chain
(the scan of T equals the scan of T1 followed by the scan of T2 from the first's h_last).

The kernels walk time in chunks of _CHUNK_T steps. A program owns a block of channels of one
batch row; its tiles are (CHUNK_T, N, channels) with each thread holding the chunk's time steps
and a few of one channel's N states in its registers, so the scan along time and most of the
sum over N stay inside a thread (no shuffles), and every load and store in the loop runs along
channels, the contiguous axis. That is why the state-shaped buffers inside (A, h0, h_last, the
saved chunk starts) are (N, Dm)-major here. `tl.range(..., num_stages=S)` keeps the next
chunks' loads in flight. The forward saves the state entering each chunk (only when a gradient
is wanted); the backward recomputes each chunk's states from it and runs the adjoint's reverse
scan, for few rows in segments of time at once (_backward_segment_chunks). On the H200
(bench/RESULTS.md) this is 2x the forward and 2x the forward + backward of the (chunk, channel,
N)-tiled kernels it replaced (3.6x forward + backward for a single 32K row); the scan is still far
from memory bound (a sequential chain per channel and state, 16 exponentials per 12 bytes of x,
delta and y).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels._dispatch import compute_dtype, new_buffer, wants_triton

_LOG2_E = 1.0 / math.log(2.0)

_CHUNK_T = 8
"""Time steps per chunk. Measured on the H200 (Bt 8, T 4096, Dm 1024, N 16, fp32;
bench/scan_variants.py of commit bee4480; `python bench/kernels.py --sweep --only scan`): 16-step
chunks make the forward a little faster but the backward's chunk tiles then spill registers (3.38
against 2.98 ms forward + backward in the sweep)."""
_FORWARD_STAGES = 5
"""Chunks whose loads are in flight in the forward (one warp, 16 channels, the size above): 2
stages 0.79 ms, 3 0.55, 4 0.53, 5 0.45 in the experiment; in the sweep 4, 5 and 6 stages are
within 4 % of each other (0.355-0.370 ms)."""
_BACKWARD_BLOCK_D = 8
"""Channels per backward program (one warp; 4 threads a channel, 4 states each). dB and dC are
summed over these blocks afterwards. Forward + backward in the experiment: 8 channels 3.4 ms, 16
channels 4.5 (register spills), 32 channels 15.5."""
_BACKWARD_STAGES = 3
_SEGMENT_CHUNKS = 8
"""Chunks per backward segment when the backward is split along time (_backward_segment_chunks)."""


def _backward_segment_chunks(batch: int, channels: int, chunks: int) -> int:
    """Chunks per backward segment. With few rows one program a channel block walking all of T
    leaves too few programs to hide their latency, so the backward runs segments of
    _SEGMENT_CHUNKS chunks at once: a first pass finds what each segment's adjoint sends to the
    segment before it (from zero at its end) and the product of its decays, a short sequential pass
    over segments turns those into each segment's incoming adjoint, and the main pass walks every
    segment from its end in parallel. Measured on the H200 (forward + backward, N 16, 2026-11-29),
    segmented against one segment: Bt 1 x T 32768 x Dm 1024 5.6 against 10.5 ms; Bt 1 x T 8192 x
    Dm 1024 1.66 against 2.90; Bt 2 x T 4096 x Dm 1024 1.51 against 1.82; Bt 4 x T 4096 x Dm 768
    1.89 against 1.83; Bt 8 x T 4096 x Dm 1024 4.1 against 3.1 (the first pass's cost is then not
    repaid). So segments up to Bt x Dm = 2048, one segment above."""
    return _SEGMENT_CHUNKS if batch * channels <= 2048 else max(chunks, 1)


def _forward_block_d(batch: int, channels: int) -> int:
    """Channels per forward program (one warp): 16 (2 threads a channel, 8 states each) when there
    are many rows; 8 (4 threads a channel) when few, to have enough programs (Bt 1, T 32768: 1.5
    against 2.7 ms)."""
    return 16 if batch * channels >= 8192 else 8


def selective_scan_reference(
    x: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    h0: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan step by step in plain PyTorch autograd (the definition the kernel is tested against).

    x, delta (Bt, T, Dm); A (Dm, N); B, C (Bt, T, G, N); D (Dm,) or None; h0 (Bt, Dm, N) or None.
    Returns y (Bt, T, Dm) in x's dtype and h_last (Bt, Dm, N) in fp32 (fp64 for fp64 inputs).
    """
    batch, seq_len, channels = x.shape
    groups, state_size = B.shape[2], B.shape[3]
    if channels % groups:
        raise ValueError(f"selective_scan: Dm={channels} is not a multiple of G={groups}")
    dtype = compute_dtype(x, delta, A, B, C, D, h0)
    channels_per_group = channels // groups
    xf, deltaf, Af = x.to(dtype), delta.to(dtype), A.to(dtype)
    # Each channel reads its group's B and C: (Bt, T, G, N) -> (Bt, T, Dm, N); one group
    # broadcasts as it is.
    B_per_channel, C_per_channel = B.to(dtype), C.to(dtype)
    if groups > 1:
        B_per_channel = B_per_channel.repeat_interleave(channels_per_group, dim=2)
        C_per_channel = C_per_channel.repeat_interleave(channels_per_group, dim=2)
    h = h0.to(dtype) if h0 is not None else x.new_zeros(batch, channels, state_size, dtype=dtype)
    # Everything but the recurrence itself is computed for all steps at once, and the steps are
    # taken with unbind: indexing [:, t] in the loop makes autograd's backward scatter into a
    # full-size zero tensor at every step, which dominated training time on CPU.
    decays = torch.exp(deltaf[..., None] * Af).unbind(1)  # T x (Bt, Dm, N)
    drives = ((deltaf * xf)[..., None] * B_per_channel).unbind(1)  # T x (Bt, Dm, N)
    readouts = C_per_channel.unbind(1)  # T x (Bt, Dm or 1, N)
    outputs = []
    for decay, drive, readout in zip(decays, drives, readouts):
        h = decay * h + drive
        outputs.append((h * readout).sum(-1))  # (Bt, Dm)
    y = torch.stack(outputs, dim=1) if outputs else xf.new_zeros(batch, 0, channels)  # (Bt, T, Dm)
    if D is not None:
        y = y + D.to(dtype) * xf
    return y.to(x.dtype), h


@triton.jit
def _affine_combine(decay_left, drive_left, decay_right, drive_right):
    """Compose h -> decay h + drive maps: apply the left map first, then the right one."""
    return decay_left * decay_right, decay_right * drive_left + drive_right


@triton.jit
def _reverse_combine(later_decay, later_value, later_gain, decay, value, gain):
    """The adjoint's reverse scan without a shifted decay. A segment of rows [t..u] is
    (decay_t, V, G) with g_t = V + G (decay_{u+1} g_{u+1}): joined with the segment after it,
    that segment's first decay carries what flows in. One row alone is (decay_t, local_t, 1)."""
    through = gain * later_decay
    return decay, value + through * later_value, through * later_gain


@triton.jit
def _take_first(first, second):
    return first


@triton.jit
def _take_last(first, second):
    return second


@triton.jit
def _state_tile(group, block, per_group, channels: tl.constexpr, state_size: tl.constexpr,
                BLOCK_D: tl.constexpr, N_PAD: tl.constexpr):
    """A program's channels (block `block` of group `group`) and the (N_PAD, BLOCK_D) offsets of
    their states in an (N, Dm) buffer: within, channel, channel_ok (BLOCK_D,); n, n_ok (N_PAD,);
    state_mask, state_offsets (N_PAD, BLOCK_D)."""
    within = block * BLOCK_D + tl.arange(0, BLOCK_D)
    channel = group * per_group + within
    channel_ok = within < per_group
    n = tl.arange(0, N_PAD)
    n_ok = n < state_size
    state_mask = n_ok[:, None] & channel_ok[None, :]
    state_offsets = n[:, None] * channels + channel[None, :]
    return within, channel, channel_ok, n, n_ok, state_mask, state_offsets


@triton.jit
def _selective_scan_forward_kernel(
    x_ptr, delta_ptr, A_T_ptr, B_ptr, C_ptr, D_ptr, h0_T_ptr, y_ptr, h_last_T_ptr, chunk_start_ptr,
    seq_len, chunks, log2_e, channels: tl.constexpr, groups: tl.constexpr, state_size: tl.constexpr,
    HAS_D: tl.constexpr, HAS_H0: tl.constexpr, SAVE: tl.constexpr, EVEN: tl.constexpr,
    BLOCK_D: tl.constexpr, N_PAD: tl.constexpr, CHUNK_T: tl.constexpr, STAGES: tl.constexpr,
):
    per_group: tl.constexpr = channels // groups
    batch = tl.program_id(0)
    group = tl.program_id(1)
    within, channel, channel_ok, n, n_ok, state_mask, state_offsets = _state_tile(
        group, tl.program_id(2), per_group, channels, state_size, BLOCK_D, N_PAD)
    # exp(delta A) as exp2(delta A log2 e): the multiply folded into A once.
    A2 = tl.load(A_T_ptr + state_offsets, mask=state_mask, other=0.0).to(tl.float32) * log2_e
    batch_state = batch.to(tl.int64) * channels * state_size
    if HAS_H0:
        h = tl.load(h0_T_ptr + batch_state + state_offsets, mask=state_mask, other=0.0)
    else:
        h = tl.zeros([N_PAD, BLOCK_D], dtype=tl.float32)
    if HAS_D:
        D_vec = tl.load(D_ptr + channel, mask=channel_ok, other=0.0).to(tl.float32)
    rows = tl.arange(0, CHUNK_T)
    first_row = batch.to(tl.int64) * seq_len
    chunk_base = chunk_start_ptr + batch.to(tl.int64) * chunks * channels * state_size + state_offsets
    for chunk in tl.range(0, chunks, num_stages=STAGES):
        if SAVE:  # the state entering the chunk, for the backward
            tl.store(chunk_base + chunk * channels * state_size, h, mask=state_mask)
        times = chunk * CHUNK_T + rows  # (CHUNK_T,)
        row = first_row + times
        offsets = row[:, None] * channels + channel[None, :]  # (CHUNK_T, BLOCK_D)
        bc = (row[:, None] * groups + group) * state_size + n[None, :]  # (CHUNK_T, N_PAD)
        mask = (times < seq_len)[:, None] & channel_ok[None, :]
        if EVEN:  # no ragged edge anywhere: no masks in the loop
            xs = tl.load(x_ptr + offsets).to(tl.float32)
            deltas = tl.load(delta_ptr + offsets).to(tl.float32)
            Bs = tl.load(B_ptr + bc).to(tl.float32)
            Cs = tl.load(C_ptr + bc).to(tl.float32)
        else:
            bc_mask = (times < seq_len)[:, None] & n_ok[None, :]
            xs = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            deltas = tl.load(delta_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            Bs = tl.load(B_ptr + bc, mask=bc_mask, other=0.0).to(tl.float32)
            Cs = tl.load(C_ptr + bc, mask=bc_mask, other=0.0).to(tl.float32)
        # Rows past the end have delta 0: decay 1 and drive 0 keep the last real state.
        decay = tl.exp2(deltas[:, None, :] * A2[None, :, :])  # (CHUNK_T, N_PAD, BLOCK_D)
        drive = Bs[:, :, None] * (deltas * xs)[:, None, :]
        # The chunk's start state enters through the first row's drive; the scan's decay
        # products are then unused and the compiler drops them.
        drive += tl.where(rows[:, None, None] == 0, decay * h[None, :, :], 0.0)
        _, states = tl.associative_scan((decay, drive), 0, _affine_combine)
        ys = tl.sum(states * Cs[:, :, None], axis=1)  # (CHUNK_T, BLOCK_D)
        if HAS_D:
            ys += D_vec[None, :] * xs
        if EVEN:
            tl.store(y_ptr + offsets, ys.to(y_ptr.dtype.element_ty))
        else:
            tl.store(y_ptr + offsets, ys.to(y_ptr.dtype.element_ty), mask=mask)
        h = tl.reduce(states, 0, _take_last)  # the chunk's last row: a register, no arithmetic
    tl.store(h_last_T_ptr + batch_state + state_offsets, h, mask=state_mask)


@triton.jit
def _segment_flow_kernel(
    delta_ptr, A_T_ptr, C_ptr, grad_y_ptr, flow_ptr, gain_ptr,
    seq_len, chunks, segments, segment_chunks, log2_e,
    channels: tl.constexpr, groups: tl.constexpr, state_size: tl.constexpr,
    EVEN: tl.constexpr, BLOCK_D: tl.constexpr, N_PAD: tl.constexpr, CHUNK_T: tl.constexpr, STAGES: tl.constexpr,
):
    """For one segment: flow = decay_a g_a at its first row a with nothing arriving at its end (what
    it sends to the segment before), and gain = the product of its decays (how what arrives at its
    end reaches the segment before: exp(A * the sum of its deltas))."""
    per_group: tl.constexpr = channels // groups
    blocks: tl.constexpr = (per_group + BLOCK_D - 1) // BLOCK_D
    batch = tl.program_id(0)
    group = tl.program_id(1) // blocks
    segment = tl.program_id(2)
    within, channel, channel_ok, n, n_ok, state_mask, state_offsets = _state_tile(
        group, tl.program_id(1) % blocks, per_group, channels, state_size, BLOCK_D, N_PAD)
    A2 = tl.load(A_T_ptr + state_offsets, mask=state_mask, other=0.0).to(tl.float32) * log2_e
    rows = tl.arange(0, CHUNK_T)
    first_row = batch.to(tl.int64) * seq_len
    flow = tl.zeros([N_PAD, BLOCK_D], dtype=tl.float32)
    total_delta = tl.zeros([BLOCK_D], dtype=tl.float32)
    for back in tl.range(0, segment_chunks, num_stages=STAGES):
        chunk = (segment + 1) * segment_chunks - 1 - back
        times = chunk * CHUNK_T + rows  # (CHUNK_T,)
        row = first_row + times
        offsets = row[:, None] * channels + channel[None, :]  # (CHUNK_T, BLOCK_D)
        bc = (row[:, None] * groups + group) * state_size + n[None, :]  # (CHUNK_T, N_PAD)
        if EVEN:
            deltas = tl.load(delta_ptr + offsets).to(tl.float32)
            grad_ys = tl.load(grad_y_ptr + offsets).to(tl.float32)
            Cs = tl.load(C_ptr + bc).to(tl.float32)
        else:  # rows past the end (or chunks past the last) add nothing and pass the flow on
            mask = (times < seq_len)[:, None] & channel_ok[None, :]
            deltas = tl.load(delta_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            grad_ys = tl.load(grad_y_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            Cs = tl.load(C_ptr + bc, mask=(times < seq_len)[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        decay = tl.exp2(deltas[:, None, :] * A2[None, :, :])  # (CHUNK_T, N_PAD, BLOCK_D)
        last = tl.where(rows[:, None, None] == CHUNK_T - 1, flow[None, :, :], 0.0)
        local = Cs[:, :, None] * grad_ys[:, None, :] + last
        ones = tl.full(local.shape, 1.0, tl.float32)
        _, adjoint, _ = tl.associative_scan((decay, local, ones), 0, _reverse_combine, reverse=True)
        flow = tl.reduce(decay * adjoint, 0, _take_first)
        total_delta += tl.sum(deltas, axis=0)
    segment_state = (batch.to(tl.int64) * segments + segment) * channels * state_size + state_offsets
    tl.store(flow_ptr + segment_state, flow, mask=state_mask)
    tl.store(gain_ptr + segment_state, tl.exp2(total_delta[None, :] * A2), mask=state_mask)


@triton.jit
def _segment_carries_kernel(
    flow_ptr, gain_ptr, grad_h_last_T_ptr, carry_ptr, segments, state_elements,
    HAS_GRAD_H_LAST: tl.constexpr, BLOCK: tl.constexpr,
):
    """From the last segment back, the adjoint arriving at each segment's end:
    carry_{s-1} = flow_s + gain_s carry_s, from carry_last = dL/dh_last."""
    batch = tl.program_id(0)
    index = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = index < state_elements
    state = batch.to(tl.int64) * state_elements + index
    if HAS_GRAD_H_LAST:
        carry = tl.load(grad_h_last_T_ptr + state, mask=ok, other=0.0)
    else:
        carry = tl.zeros([BLOCK], dtype=tl.float32)
    first_segment = batch.to(tl.int64) * segments * state_elements + index
    for back in tl.range(0, segments - 1):
        segment = first_segment + (segments - 1 - back) * state_elements
        tl.store(carry_ptr + segment, carry, mask=ok)
        carry = tl.load(flow_ptr + segment, mask=ok, other=0.0) + tl.load(gain_ptr + segment, mask=ok, other=0.0) * carry
    tl.store(carry_ptr + first_segment, carry, mask=ok)


@triton.jit
def _selective_scan_backward_kernel(
    x_ptr, delta_ptr, A_T_ptr, B_ptr, C_ptr, D_ptr, chunk_start_ptr, grad_y_ptr, carry_ptr,
    grad_x_ptr, grad_delta_ptr, grad_A_T_ptr, grad_B_ptr, grad_C_ptr, grad_D_ptr, flow_out_ptr,
    batches, seq_len, chunks, segments, segment_chunks, log2_e, channels: tl.constexpr, groups: tl.constexpr,
    state_size: tl.constexpr, HAS_D: tl.constexpr, HAS_CARRY: tl.constexpr, EVEN: tl.constexpr,
    BLOCK_D: tl.constexpr, N_PAD: tl.constexpr, CHUNK_T: tl.constexpr, STAGES: tl.constexpr,
):
    """One segment, chunk by chunk from its end, from the adjoint arriving there (carry): the
    chunk's states recomputed from its saved start (a scan), the adjoint g_t = dL/dh_t = C_t gy_t +
    decay_{t+1} g_{t+1} by a reverse scan, then every gradient from the two. What flows out of the
    segment's first row goes to flow_out (for the first segment: dL/dh0)."""
    per_group: tl.constexpr = channels // groups
    blocks: tl.constexpr = (per_group + BLOCK_D - 1) // BLOCK_D
    batch = tl.program_id(0)
    group = tl.program_id(1) // blocks
    block = tl.program_id(1) % blocks
    segment = tl.program_id(2)
    within, channel, channel_ok, n, n_ok, state_mask, state_offsets = _state_tile(
        group, block, per_group, channels, state_size, BLOCK_D, N_PAD)
    A = tl.load(A_T_ptr + state_offsets, mask=state_mask, other=0.0).to(tl.float32)
    A2 = A * log2_e
    segment_state = (batch.to(tl.int64) * segments + segment) * channels * state_size + state_offsets
    # carry: what flows into the chunk's last row from everything after it (decay_{t+1} g_{t+1}).
    if HAS_CARRY:
        carry = tl.load(carry_ptr + segment_state, mask=state_mask, other=0.0)
    else:
        carry = tl.zeros([N_PAD, BLOCK_D], dtype=tl.float32)
    if HAS_D:
        D_vec = tl.load(D_ptr + channel, mask=channel_ok, other=0.0).to(tl.float32)
    grad_A = tl.zeros([N_PAD, BLOCK_D], dtype=tl.float32)
    grad_D = tl.zeros([BLOCK_D], dtype=tl.float32)
    rows = tl.arange(0, CHUNK_T)
    first_row = batch.to(tl.int64) * seq_len
    chunk_base = chunk_start_ptr + batch.to(tl.int64) * chunks * channels * state_size + state_offsets
    partials = block.to(tl.int64) * batches * seq_len * groups * state_size
    for back in tl.range(0, segment_chunks, num_stages=STAGES):
        chunk = (segment + 1) * segment_chunks - 1 - back
        if EVEN:
            h_start = tl.load(chunk_base + chunk * channels * state_size)
        else:  # a chunk past the last one: every row masked, the carry passes through
            chunk_mask = n_ok[:, None] & (within < tl.where(chunk < chunks, per_group, 0))[None, :]
            h_start = tl.load(chunk_base + chunk * channels * state_size, mask=chunk_mask, other=0.0)
        times = chunk * CHUNK_T + rows  # (CHUNK_T,)
        row = first_row + times
        offsets = row[:, None] * channels + channel[None, :]  # (CHUNK_T, BLOCK_D)
        bc = (row[:, None] * groups + group) * state_size + n[None, :]  # (CHUNK_T, N_PAD)
        mask = (times < seq_len)[:, None] & channel_ok[None, :]
        bc_mask = (times < seq_len)[:, None] & n_ok[None, :]
        if EVEN:
            xs = tl.load(x_ptr + offsets).to(tl.float32)
            deltas = tl.load(delta_ptr + offsets).to(tl.float32)
            grad_ys = tl.load(grad_y_ptr + offsets).to(tl.float32)
            Bs = tl.load(B_ptr + bc).to(tl.float32)
            Cs = tl.load(C_ptr + bc).to(tl.float32)
        else:
            xs = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            deltas = tl.load(delta_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            grad_ys = tl.load(grad_y_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            Bs = tl.load(B_ptr + bc, mask=bc_mask, other=0.0).to(tl.float32)
            Cs = tl.load(C_ptr + bc, mask=bc_mask, other=0.0).to(tl.float32)
        # Rows past the end: delta 0 and gy 0, so decay 1, drive 0 and nothing added.
        decay = tl.exp2(deltas[:, None, :] * A2[None, :, :])  # (CHUNK_T, N_PAD, BLOCK_D)
        dx = deltas * xs  # (CHUNK_T, BLOCK_D)
        drive = Bs[:, :, None] * dx[:, None, :]
        first = tl.where(rows[:, None, None] == 0, decay * h_start[None, :, :], 0.0)
        _, states = tl.associative_scan((decay, drive + first), 0, _affine_combine)
        last = tl.where(rows[:, None, None] == CHUNK_T - 1, carry[None, :, :], 0.0)
        local = Cs[:, :, None] * grad_ys[:, None, :] + last
        ones = tl.full(local.shape, 1.0, tl.float32)
        _, adjoint, _ = tl.associative_scan((decay, local, ones), 0, _reverse_combine, reverse=True)
        carried = states - drive  # decay_t h_{t-1}, without a shifted state
        grad_deltas = tl.sum(adjoint * (A[None, :, :] * carried + Bs[:, :, None] * xs[:, None, :]), axis=1)
        grad_xs = tl.sum(adjoint * Bs[:, :, None], axis=1) * deltas  # (CHUNK_T, BLOCK_D)
        if HAS_D:
            grad_xs += D_vec[None, :] * grad_ys
            grad_D += tl.sum(grad_ys * xs, axis=0)
        grad_A += tl.sum(adjoint * deltas[:, None, :] * carried, axis=0)
        # This block's share of dB and dC (summed over the blocks afterwards, in a fixed order).
        grad_Bs = tl.sum(adjoint * dx[:, None, :], axis=2)  # (CHUNK_T, N_PAD)
        grad_Cs = tl.sum(grad_ys[:, None, :] * states, axis=2)
        if EVEN:
            tl.store(grad_x_ptr + offsets, grad_xs.to(grad_x_ptr.dtype.element_ty))
            tl.store(grad_delta_ptr + offsets, grad_deltas.to(grad_delta_ptr.dtype.element_ty))
            tl.store(grad_B_ptr + partials + bc, grad_Bs)
            tl.store(grad_C_ptr + partials + bc, grad_Cs)
        else:
            tl.store(grad_x_ptr + offsets, grad_xs.to(grad_x_ptr.dtype.element_ty), mask=mask)
            tl.store(grad_delta_ptr + offsets, grad_deltas.to(grad_delta_ptr.dtype.element_ty), mask=mask)
            tl.store(grad_B_ptr + partials + bc, grad_Bs, mask=bc_mask)
            tl.store(grad_C_ptr + partials + bc, grad_Cs, mask=bc_mask)
        carry = tl.reduce(decay * adjoint, 0, _take_first)  # decay_0 g_0 flows into the chunk before
    tl.store(flow_out_ptr + segment_state, carry, mask=state_mask)
    # This segment's share of dA and dD (summed over segments and rows afterwards).
    tl.store(grad_A_T_ptr + segment_state, grad_A, mask=state_mask)
    if HAS_D:
        tl.store(grad_D_ptr + (batch.to(tl.int64) * segments + segment) * channels + channel, grad_D, mask=channel_ok)


def _is_even(seq_len: int, per_group: int, block_d: int, state_size: int) -> bool:
    """No ragged edge: whole chunks, whole channel blocks, N a power of two."""
    return seq_len % _CHUNK_T == 0 and per_group % block_d == 0 and state_size == triton.next_power_of_2(state_size)


def _scan_forward(
    x: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: torch.Tensor | None, h0: torch.Tensor | None, save: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward kernel on contiguous x, delta, B, C: y, h_last (Bt, Dm, N) and, with save, the
    state entering each chunk (Bt, chunks, N, Dm) for the backward (else an empty buffer)."""
    batch, seq_len, channels = x.shape
    groups, state_size = B.shape[2], B.shape[3]
    per_group = channels // groups
    chunks = triton.cdiv(seq_len, _CHUNK_T)
    # The state-shaped buffers the kernels read and write are (N, Dm)-major (module docstring).
    A_T = A.t().contiguous()
    h0_T = h0.float().transpose(1, 2).contiguous() if h0 is not None else None
    y = new_buffer(x.shape, x.dtype, x.device)
    h_last_T = new_buffer((batch, state_size, channels), torch.float32, x.device)
    chunk_start_T = new_buffer((batch, chunks if save else 0, state_size, channels), torch.float32, x.device)
    if seq_len == 0:
        h_last_T.copy_(h0_T if h0_T is not None else torch.zeros_like(h_last_T))
    else:
        block_d = _forward_block_d(batch, channels)
        _selective_scan_forward_kernel[(batch, groups, triton.cdiv(per_group, block_d))](
            x, delta, A_T, B, C, D if D is not None else x, h0_T if h0_T is not None else h_last_T,
            y, h_last_T, chunk_start_T if save else h_last_T, seq_len, chunks, _LOG2_E,
            channels=channels, groups=groups, state_size=state_size,
            HAS_D=D is not None, HAS_H0=h0 is not None, SAVE=save,
            EVEN=_is_even(seq_len, per_group, block_d, state_size),
            BLOCK_D=block_d, N_PAD=triton.next_power_of_2(state_size), CHUNK_T=_CHUNK_T, STAGES=_FORWARD_STAGES,
            num_warps=1,
        )
    return y, h_last_T.transpose(1, 2).contiguous(), chunk_start_T


class _SelectiveScan(torch.autograd.Function):
    """The Triton forward (saving chunk-start states) and backward (recomputing each chunk's
    states from them)."""

    @staticmethod
    def forward(ctx, x, delta, A, B, C, D, h0):
        x, delta, B, C = (t.contiguous() for t in (x, delta, B, C))
        D = D.contiguous() if D is not None else None
        y, h_last, chunk_start_T = _scan_forward(x, delta, A, B, C, D, h0, save=True)
        ctx.save_for_backward(x, delta, A, B, C, D, chunk_start_T)
        ctx.has_h0 = h0 is not None
        ctx.set_materialize_grads(False)
        return y, h_last

    @staticmethod
    def backward(ctx, grad_y, grad_h_last):
        x, delta, A, B, C, D, chunk_start_T = ctx.saved_tensors
        batch, seq_len, channels = x.shape
        groups, state_size = B.shape[2], B.shape[3]
        per_group = channels // groups
        chunks = chunk_start_T.shape[1]
        segment_chunks = _backward_segment_chunks(batch, channels, chunks)
        segments = triton.cdiv(chunks, segment_chunks) if chunks else 1
        blocks = triton.cdiv(per_group, _BACKWARD_BLOCK_D)
        grad_y = grad_y.contiguous() if grad_y is not None else torch.zeros_like(x)
        grad_h_last_T = grad_h_last.transpose(1, 2).contiguous() if grad_h_last is not None else None
        grad_x = new_buffer(x.shape, x.dtype, x.device)
        grad_delta = new_buffer(delta.shape, delta.dtype, delta.device)
        grad_A_T = new_buffer((batch, segments, state_size, channels), torch.float32, x.device)
        grad_B = new_buffer((blocks, *B.shape), torch.float32, x.device)
        grad_C = new_buffer((blocks, *C.shape), torch.float32, x.device)
        grad_D = new_buffer((batch, segments, channels), torch.float32, x.device)
        # What flows out of each segment's first row; the first segment's is dL/dh0.
        flow_out = new_buffer((batch, segments, state_size, channels), torch.float32, x.device)
        if seq_len == 0:
            flow_out.copy_(grad_h_last_T[:, None] if grad_h_last_T is not None else torch.zeros_like(flow_out))
            for partial in (grad_A_T, grad_B, grad_C, grad_D):
                partial.zero_()
        else:
            A_T = A.t().contiguous()
            shape = dict(channels=channels, groups=groups, state_size=state_size)
            tiles = dict(BLOCK_D=_BACKWARD_BLOCK_D, N_PAD=triton.next_power_of_2(state_size), CHUNK_T=_CHUNK_T,
                         STAGES=_BACKWARD_STAGES, num_warps=1)
            even = chunks % segment_chunks == 0 and _is_even(seq_len, per_group, _BACKWARD_BLOCK_D, state_size)
            grid = (batch, groups * blocks, segments)
            carry = grad_h_last_T  # (Bt, N, Dm): the one segment's incoming adjoint
            if segments > 1:
                # 1. What each segment sends to the one before it, and its decays' product.
                flow = new_buffer((batch, segments, state_size, channels), torch.float32, x.device)
                gain = new_buffer((batch, segments, state_size, channels), torch.float32, x.device)
                _segment_flow_kernel[grid](
                    delta, A_T, C, grad_y, flow, gain, seq_len, chunks, segments, segment_chunks, _LOG2_E,
                    **shape, EVEN=even, **tiles,
                )
                # 2. The adjoint arriving at each segment's end (sequential over segments, short).
                carry = new_buffer((batch, segments, state_size, channels), torch.float32, x.device)
                state_elements = state_size * channels
                _segment_carries_kernel[(batch, triton.cdiv(state_elements, 1024))](
                    flow, gain, grad_h_last_T if grad_h_last_T is not None else flow, carry,
                    segments, state_elements, HAS_GRAD_H_LAST=grad_h_last is not None, BLOCK=1024, num_warps=4,
                )
            # 3. Every segment's gradients at once.
            _selective_scan_backward_kernel[grid](
                x, delta, A_T, B, C, D if D is not None else x, chunk_start_T, grad_y,
                carry if carry is not None else x, grad_x, grad_delta, grad_A_T, grad_B, grad_C, grad_D, flow_out,
                batch, seq_len, chunks, segments, segment_chunks, _LOG2_E, **shape,
                HAS_D=D is not None, HAS_CARRY=carry is not None, EVEN=even, **tiles,
            )
        # Partials over batch rows, segments and channel blocks are summed here in a fixed order
        # (no atomics: deterministic).
        return (
            grad_x,
            grad_delta,
            grad_A_T.sum((0, 1)).t().to(A.dtype),
            grad_B.sum(0).to(B.dtype),
            grad_C.sum(0).to(C.dtype),
            grad_D.sum((0, 1)).to(D.dtype) if D is not None else None,
            flow_out[:, 0].transpose(1, 2).contiguous() if ctx.has_h0 else None,
        )


def selective_scan(
    x: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    h0: torch.Tensor | None = None,
    *,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan (see the module docstring): Triton on CUDA, the reference elsewhere.

    use_triton: None picks Triton on CUDA; True forces it (off CUDA only under
    TRITON_INTERPRET=1); False forces the reference.
    """
    if wants_triton(x, use_triton):
        if x.shape[2] % B.shape[2]:
            raise ValueError(f"selective_scan: Dm={x.shape[2]} is not a multiple of G={B.shape[2]}")
        inputs = (x, delta, A, B, C, D, h0)
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
            return _SelectiveScan.apply(*inputs)
        # No gradient wanted (validation, generation): no chunk starts to save.
        y, h_last, _ = _scan_forward(x.contiguous(), delta.contiguous(), A, B.contiguous(), C.contiguous(),
                                     D.contiguous() if D is not None else None, h0, save=False)
        return y, h_last
    return selective_scan_reference(x, delta, A, B, C, D, h0)
