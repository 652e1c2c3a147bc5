"""The selective scan's backward (kernels/selective_scan.py has the forward, the reference and
the layout): per chunk from the end, the chunk's states recomputed from the state the forward saved
at its start, the adjoint by a scan backwards in time (forward over the chunk's rows flipped),
every gradient from the two; for few rows, in segments of time at once."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._dispatch import new_buffer
from kernels._scan_tiles import (
    LOG2_E,
    chunk_addresses,
    chunk_adjoint,
    chunk_start_mask,
    chunk_states,
    is_even,
    load_f32,
    program_tile,
    segment_carries_kernel,
    store_masked,
    sum_pair_over_channels,
)

_BACKWARD_BLOCK_D = 8
"""Channels per backward program (one warp; 4 threads a channel, 4 states each). dB and dC are
summed over these blocks afterwards. Wider programs spill registers and are much slower."""
_BACKWARD_STAGES = 3
_SEGMENT_CHUNKS = (8, 64)
"""The fewest and the most chunks a backward segment when the backward is split along time: an
eighth of the row between the two (`_backward_segment_chunks`). A segment's loop runs all its
chunks, masked past the end of T, so a short row must not get long segments; on long rows,
longer segments are faster up to 64 chunks (`python bench/kernels.py --sweep --only
scan_segments`)."""


def _backward_segment_chunks(batch: int, channels: int, chunks: int) -> int:
    """Chunks per backward segment. With few rows one program a channel block walking all of T
    leaves too few programs to hide their latency, so the backward runs segments of time at once
    (each an eighth of the row, within _SEGMENT_CHUNKS' bounds): a first pass finds what each
    segment's adjoint sends to the segment before it (from zero at its end) and the product of its
    decays, a short sequential pass over segments turns those into each segment's incoming
    adjoint, and the main pass walks every segment from its end in parallel. The first pass reads
    delta, C and dy a second time and redoes their exponentials, which is repaid only while rows
    are few: so segments up to Bt x Dm = 2048, one segment above."""
    if batch * channels > 2048:
        return max(chunks, 1)
    shortest, longest = _SEGMENT_CHUNKS
    return min(longest, max(shortest, chunks // 8), max(chunks, 1))


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
    batch = tl.program_id(0)
    segment = tl.program_id(2)
    group, block, within, channel, channel_ok, n, n_ok, state_mask, state_offsets = program_tile(
        channels, groups, state_size, BLOCK_D, N_PAD)
    A2 = tl.load(A_T_ptr + state_offsets, mask=state_mask, other=0.0).to(tl.float32) * log2_e
    first_row = batch.to(tl.int64) * seq_len
    flow = tl.zeros([N_PAD, BLOCK_D], dtype=tl.float32)
    total_delta = tl.zeros([BLOCK_D], dtype=tl.float32)
    for back in tl.range(0, segment_chunks, num_stages=STAGES):
        chunk = (segment + 1) * segment_chunks - 1 - back
        offsets, bc, mask, bc_mask = chunk_addresses(
            chunk, first_row, seq_len, channel, channel_ok, group, n, n_ok, channels, groups, state_size, CHUNK_T)
        # Rows past the end (or chunks past the last) add nothing and pass the flow on.
        deltas = load_f32(delta_ptr + offsets, mask, EVEN)
        grad_ys = load_f32(grad_y_ptr + offsets, mask, EVEN)
        Cs = load_f32(C_ptr + bc, bc_mask, EVEN)
        decay = tl.exp2(deltas[:, None, :] * A2[None, :, :])  # (CHUNK_T, N_PAD, BLOCK_D)
        _, flow = chunk_adjoint(decay, Cs[:, :, None] * grad_ys[:, None, :], flow, CHUNK_T)
        total_delta += tl.sum(deltas, axis=0)
    segment_state = (batch.to(tl.int64) * segments + segment) * channels * state_size + state_offsets
    tl.store(flow_ptr + segment_state, flow, mask=state_mask)
    tl.store(gain_ptr + segment_state, tl.exp2(total_delta[None, :] * A2), mask=state_mask)


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
    batch = tl.program_id(0)
    segment = tl.program_id(2)
    group, block, within, channel, channel_ok, n, n_ok, state_mask, state_offsets = program_tile(
        channels, groups, state_size, BLOCK_D, N_PAD)
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
    first_row = batch.to(tl.int64) * seq_len
    chunk_base = chunk_start_ptr + batch.to(tl.int64) * chunks * channels * state_size + state_offsets
    partials = block.to(tl.int64) * batches * seq_len * groups * state_size
    for back in tl.range(0, segment_chunks, num_stages=STAGES):
        chunk = (segment + 1) * segment_chunks - 1 - back
        if EVEN:
            h_start = tl.load(chunk_base + chunk * channels * state_size)
        else:  # a chunk past the last one: every row masked, the carry passes through
            chunk_mask = chunk_start_mask(chunk, chunks, within, n_ok, channels // groups)
            h_start = tl.load(chunk_base + chunk * channels * state_size, mask=chunk_mask, other=0.0)
        offsets, bc, mask, bc_mask = chunk_addresses(
            chunk, first_row, seq_len, channel, channel_ok, group, n, n_ok, channels, groups, state_size, CHUNK_T)
        xs = load_f32(x_ptr + offsets, mask, EVEN)
        deltas = load_f32(delta_ptr + offsets, mask, EVEN)
        grad_ys = load_f32(grad_y_ptr + offsets, mask, EVEN)
        Bs = load_f32(B_ptr + bc, bc_mask, EVEN)
        Cs = load_f32(C_ptr + bc, bc_mask, EVEN)
        # Rows past the end: delta 0 and gy 0, so decay 1, drive 0 and nothing added.
        decay = tl.exp2(deltas[:, None, :] * A2[None, :, :])  # (CHUNK_T, N_PAD, BLOCK_D)
        dx = deltas * xs  # (CHUNK_T, BLOCK_D)
        drive = Bs[:, :, None] * dx[:, None, :]
        states = chunk_states(decay, drive, h_start, CHUNK_T)
        # carry becomes decay_0 g_0, what flows into the chunk before.
        adjoint, carry = chunk_adjoint(decay, Cs[:, :, None] * grad_ys[:, None, :], carry, CHUNK_T)
        # dL/d(decay_t) h_{t-1} = g_t decay_t h_{t-1}; decay_t h_{t-1} is the state without its drive.
        through_decay = adjoint * (states - drive)  # (CHUNK_T, N_PAD, BLOCK_D)
        # sum_n g B, shared by dx (times delta) and ddelta (times x): with the decay's share
        # ddelta = sum_n A g decay h_{t-1} + x sum_n g B, one multiply-add an element each.
        through_drive = tl.sum(adjoint * Bs[:, :, None], axis=1)  # (CHUNK_T, BLOCK_D)
        grad_deltas = tl.sum(A[None, :, :] * through_decay, axis=1) + xs * through_drive
        grad_xs = through_drive * deltas
        if HAS_D:
            grad_xs += D_vec[None, :] * grad_ys
            grad_D += tl.sum(grad_ys * xs, axis=0)
        grad_A += tl.sum(deltas[:, None, :] * through_decay, axis=0)
        # This block's share of dB and dC (summed over the blocks afterwards, in a fixed order).
        grad_Bs, grad_Cs = sum_pair_over_channels(adjoint * dx[:, None, :], grad_ys[:, None, :] * states, BLOCK_D)
        store_masked(grad_x_ptr + offsets, grad_xs, mask, EVEN)
        store_masked(grad_delta_ptr + offsets, grad_deltas, mask, EVEN)
        store_masked(grad_B_ptr + partials + bc, grad_Bs, bc_mask, EVEN)
        store_masked(grad_C_ptr + partials + bc, grad_Cs, bc_mask, EVEN)
    tl.store(flow_out_ptr + segment_state, carry, mask=state_mask)
    # This segment's share of dA and dD (summed over segments and rows afterwards).
    tl.store(grad_A_T_ptr + segment_state, grad_A, mask=state_mask)
    if HAS_D:
        tl.store(grad_D_ptr + (batch.to(tl.int64) * segments + segment) * channels + channel, grad_D, mask=channel_ok)


def scan_backward(
    x: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: torch.Tensor | None, chunk_start_T: torch.Tensor, grad_y: torch.Tensor | None,
    grad_h_last: torch.Tensor | None, chunk_t: int, has_h0: bool,
) -> tuple[torch.Tensor | None, ...]:
    """The gradients of x, delta, A, B, C, D and h0 (None for D and h0 when absent), from the
    forward's inputs (x, delta, B, C contiguous), its chunk starts (Bt, chunks, N, Dm) saved every
    chunk_t steps, and the gradients of y and h_last (None: zero)."""
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
        tiles = dict(BLOCK_D=_BACKWARD_BLOCK_D, N_PAD=triton.next_power_of_2(state_size), CHUNK_T=chunk_t,
                     STAGES=_BACKWARD_STAGES, num_warps=1)
        even = chunks % segment_chunks == 0 and is_even(seq_len, chunk_t, per_group, _BACKWARD_BLOCK_D, state_size)
        grid = (batch, groups * blocks, segments)
        carry = grad_h_last_T  # (Bt, N, Dm): the one segment's incoming adjoint
        if segments > 1:
            # 1. What each segment sends to the one before it, and its decays' product.
            flow = new_buffer((batch, segments, state_size, channels), torch.float32, x.device)
            gain = new_buffer((batch, segments, state_size, channels), torch.float32, x.device)
            _segment_flow_kernel[grid](
                delta, A_T, C, grad_y, flow, gain, seq_len, chunks, segments, segment_chunks, LOG2_E,
                **shape, EVEN=even, **tiles,
            )
            # 2. The adjoint arriving at each segment's end (sequential over segments, short).
            carry = new_buffer((batch, segments, state_size, channels), torch.float32, x.device)
            state_elements = state_size * channels
            segment_carries_kernel[(batch, triton.cdiv(state_elements, 1024))](
                flow, gain, grad_h_last_T if grad_h_last_T is not None else flow, carry,
                segments, state_elements, HAS_INITIAL=grad_h_last is not None, FORWARD=False, BLOCK=1024,
                num_warps=4,
            )
        # 3. Every segment's gradients at once.
        _selective_scan_backward_kernel[grid](
            x, delta, A_T, B, C, D if D is not None else x, chunk_start_T, grad_y,
            carry if carry is not None else x, grad_x, grad_delta, grad_A_T, grad_B, grad_C, grad_D, flow_out,
            batch, seq_len, chunks, segments, segment_chunks, LOG2_E, **shape,
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
        flow_out[:, 0].transpose(1, 2).contiguous() if has_h0 else None,
    )
