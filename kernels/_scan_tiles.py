"""Pieces the selective scan's forward and backward kernels share: the scans' combine functions,
the last/first-row picks, a program's channel and state tile (kernels/selective_scan.py's
docstring says how the tiles are laid out) and the pass that chains time segments."""

from __future__ import annotations

import math

import triton
import triton.language as tl

LOG2_E = 1.0 / math.log(2.0)


def is_even(seq_len: int, chunk_t: int, per_group: int, block_d: int, state_size: int) -> bool:
    """No ragged edge: whole chunks, whole channel blocks, N a power of two (the loops drop their
    masks)."""
    return seq_len % chunk_t == 0 and per_group % block_d == 0 and state_size == triton.next_power_of_2(state_size)


@triton.jit
def affine_combine(decay_left, drive_left, decay_right, drive_right):
    """Compose h -> decay h + drive maps: apply the left map first, then the right one."""
    return decay_left * decay_right, decay_right * drive_left + drive_right


@triton.jit
def adjoint_combine(earlier_decay, earlier_value, earlier_gain, decay, value, gain):
    """The adjoint's scan without a shifted decay, on rows flipped in time (row 0 a chunk's last
    step), so that it is a forward scan. A run of flipped rows [a..b] is (decay_b, V, G) with
    g_b = V + G (decay_{a-1} g_{a-1}), row a-1 being the step after the run in time: joined after
    the run before it (`earlier`), that run's last decay carries what flows in. One row alone is
    (decay_t, local_t, 1)."""
    through = gain * earlier_decay
    return decay, value + through * earlier_value, through * earlier_gain


@triton.jit
def take_first(first, second):
    return first


@triton.jit
def take_last(first, second):
    return second


@triton.jit
def state_tile(group, block, per_group, channels: tl.constexpr, state_size: tl.constexpr,
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
def program_tile(channels: tl.constexpr, groups: tl.constexpr, state_size: tl.constexpr,
                 BLOCK_D: tl.constexpr, N_PAD: tl.constexpr):
    """The tile of the program at (batch row, group x blocks + block, segment) in the scans' grids:
    its group and block, then `state_tile`'s values for them."""
    per_group: tl.constexpr = channels // groups
    blocks: tl.constexpr = (per_group + BLOCK_D - 1) // BLOCK_D
    group = tl.program_id(1) // blocks
    block = tl.program_id(1) % blocks
    within, channel, channel_ok, n, n_ok, state_mask, state_offsets = state_tile(
        group, block, per_group, channels, state_size, BLOCK_D, N_PAD)
    return group, block, within, channel, channel_ok, n, n_ok, state_mask, state_offsets


@triton.jit
def chunk_addresses(chunk, first_row, seq_len, channel, channel_ok, group, n, n_ok,
                    channels: tl.constexpr, groups: tl.constexpr, state_size: tl.constexpr, CHUNK_T: tl.constexpr):
    """A chunk's offsets into the (Bt, T, Dm) buffers (CHUNK_T, BLOCK_D) and into B and C
    (CHUNK_T, N_PAD), each with its mask for rows past the end of T."""
    times = chunk * CHUNK_T + tl.arange(0, CHUNK_T)  # (CHUNK_T,)
    row = first_row + times
    offsets = row[:, None] * channels + channel[None, :]
    bc = (row[:, None] * groups + group) * state_size + n[None, :]
    mask = (times < seq_len)[:, None] & channel_ok[None, :]
    bc_mask = (times < seq_len)[:, None] & n_ok[None, :]
    return offsets, bc, mask, bc_mask


@triton.jit
def load_f32(pointers, mask, EVEN: tl.constexpr):
    """fp32 values at `pointers`; masked (0 where off) unless nothing is ragged anywhere (EVEN)."""
    if EVEN:
        values = tl.load(pointers)
    else:
        values = tl.load(pointers, mask=mask, other=0.0)
    return values.to(tl.float32)


@triton.jit
def store_masked(pointers, values, mask, EVEN: tl.constexpr):
    """Stores `values` at `pointers` in their element type; masked unless nothing is ragged (EVEN)."""
    if EVEN:
        tl.store(pointers, values.to(pointers.dtype.element_ty))
    else:
        tl.store(pointers, values.to(pointers.dtype.element_ty), mask=mask)


@triton.jit
def chunk_start_mask(chunk, chunks, within, n_ok, per_group):
    """The state tile's mask for a chunk's saved start state: nothing for a chunk past the last."""
    return n_ok[:, None] & (within < tl.where(chunk < chunks, per_group, 0))[None, :]


@triton.jit
def chunk_states(decay, drive, h_start, CHUNK_T: tl.constexpr):
    """The chunk's states h_t (CHUNK_T, N_PAD, BLOCK_D) from its start h_start (N_PAD, BLOCK_D):
    the start enters through the first row's drive, so the scan's decay products are unused and
    the compiler drops them (a sequential chain inside each thread)."""
    rows = tl.arange(0, CHUNK_T)
    first = tl.where(rows[:, None, None] == 0, decay * h_start[None, :, :], 0.0)
    _, states = tl.associative_scan((decay, drive + first), 0, affine_combine)
    return states


@triton.jit
def chunk_adjoint(decay, local, carry, CHUNK_T: tl.constexpr):
    """The adjoint g_t = local_t + decay_{t+1} g_{t+1} over the chunk (CHUNK_T, N_PAD, BLOCK_D),
    with `carry` (decay g of the row after the chunk) arriving at its last row, and what flows out
    of its first row into the chunk before (decay_0 g_0). The scan runs forward on the rows
    flipped in time: Triton lowers `reverse=True` with a lane-reversing shuffle for every value,
    even along an axis held in registers, while `tl.flip` along an axis in registers compiles to
    no instruction at all (its xor-sums fold into register renaming)."""
    rows = tl.arange(0, CHUNK_T)
    local += tl.where(rows[:, None, None] == CHUNK_T - 1, carry[None, :, :], 0.0)
    ones = tl.full(local.shape, 1.0, tl.float32)
    _, flipped, _ = tl.associative_scan((tl.flip(decay, 0), tl.flip(local, 0), ones), 0, adjoint_combine)
    adjoint = tl.flip(flipped, 0)
    return adjoint, tl.reduce(decay * adjoint, 0, take_first)


@triton.jit
def segment_carries_kernel(
    flow_ptr, gain_ptr, initial_ptr, carry_ptr, segments, state_elements,
    HAS_INITIAL: tl.constexpr, FORWARD: tl.constexpr, BLOCK: tl.constexpr,
):
    """What enters each time segment when segments run at once, sequential over segments (few of
    them): carry_next = flow_s + gain_s carry_s, where flow_s is what segment s sends on from a
    zero start and gain_s how what enters it reaches the next one. FORWARD (the forward's state)
    goes from the first segment, starting at initial (h0); otherwise (the backward's adjoint) from
    the last, starting at initial (dL/dh_last). Buffers (Bt, segments, N, Dm); initial (Bt, N, Dm)."""
    batch = tl.program_id(0)
    index = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = index < state_elements
    state = batch.to(tl.int64) * state_elements + index
    if HAS_INITIAL:
        carry = tl.load(initial_ptr + state, mask=ok, other=0.0)
    else:
        carry = tl.zeros([BLOCK], dtype=tl.float32)
    first_segment = batch.to(tl.int64) * segments * state_elements + index
    for step in tl.range(0, segments - 1):
        segment = first_segment + (step if FORWARD else segments - 1 - step) * state_elements
        tl.store(carry_ptr + segment, carry, mask=ok)
        carry = tl.load(flow_ptr + segment, mask=ok, other=0.0) + tl.load(gain_ptr + segment, mask=ok, other=0.0) * carry
    tl.store(carry_ptr + first_segment + (segments - 1 if FORWARD else 0) * state_elements, carry, mask=ok)


@triton.jit
def sum_pair_over_channels(first, second, BLOCK_D: tl.constexpr):
    """The sums over the last axis (BLOCK_D channels, a power of two, spread over lanes) of two
    (rows, cols, BLOCK_D) tensors, as two (rows, cols) tensors, by a reduce-scatter: the two are
    joined, and each level splits off one bit of the channel index and adds the halves, Triton
    moving the half a lane does not keep to the lane that does; the last pair of channels is
    summed by tl.sum. `tl.sum` over all the channel lanes would take a butterfly instead, a
    shuffle and an add for every value at every lane bit. The closing tl.sum matters: its result
    is a slice layout that no store layout can be pushed back through, while with a split last
    Triton can carry the store's layout back up the whole chunk, redoing the scans with time
    across lanes and spilling registers."""
    rows: tl.constexpr = first.shape[0]
    cols: tl.constexpr = first.shape[1]
    both = tl.join(first, second)  # (rows, cols, BLOCK_D, 2)
    for level in tl.static_range(1, 16):
        if (BLOCK_D >> level) > 1:
            # (rows, cols, width, 2 channel halves, 2 tensors) -> the halves last, split and added.
            halves = tl.permute(tl.reshape(both, (rows, cols, BLOCK_D >> level, 2, 2)), (0, 1, 2, 4, 3))
            lower, upper = tl.split(halves)
            both = lower + upper  # (rows, cols, BLOCK_D >> level, 2)
    return tl.split(tl.sum(both, axis=2))
