"""The PLIF scan's backward (kernels/plif.py has the forward, the reference and the math).

Once the forward's v_pre is known the adjoint is linear in p_t = dL/dv_pre_t:

    p_t = e_t + beta (1 - v_th sg_t) g_t,   g_t = dL/dv_t = beta p_{t+1},   e_t = dL/dv_pre_t + dL/ds_t sg_t

(sg the surrogate), so whole chunks of _BACKWARD_CHUNK_T steps go at once: (CHUNK_T, channels)
tiles with the chunk's steps in each thread's registers and one scan a chunk. And with few rows,
segments of time go at once too: a flow pass finds how each segment's first p depends on what
arrives at its end, a short sequential pass over segments gives what arrives at each, and the
main pass runs every segment from its own.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels._dispatch import new_buffer

_BACKWARD_CHUNK_T = 8
"""Steps a backward chunk (see `_plif_backward_kernel`): 8 a thread's registers hold with room
for the loads in flight; 16 spill registers (sm_90) and are slower, and 4 are slower too."""

_BACKWARD_STAGES = 4
"""Chunks whose loads are in flight in the backward (the pipeliner's stages): hiding the memory
latency is the whole game for a chain of steps. With many rows 3 and 4 stages run alike; a long
row of few programs needs 4, and more gain little."""

_SEGMENT_CHUNKS = 32
"""The fewest chunks a backward segment when the backward is split along time
(`_backward_segment_chunks`); long rows take longer ones, _SEGMENTS of them."""
_SEGMENTS = 32
"""Segments a long row is split into (`_backward_segment_chunks`)."""


def _backward_channels(batch: int, channels: int, segments: int, element_size: int) -> int:
    """Channels a backward program (one warp, one or two channels a thread, a chunk's steps in its
    registers): 64 when rows are many (Bt x D >= 8192, the forward's threshold) or segments run at
    once, or when the gradients are 2-byte (bf16 models: one channel a thread would load them 2
    bytes at a time, which Triton's pipeliner does not keep in flight; kernels/plif.py
    `_channels_per_program`), 32 for one segment of few fp32 rows. The scan's access pattern
    alone, with no arithmetic (bench/stream_pattern.py), streams closer to copy bandwidth with
    64-channel rows, and the backward follows wherever there are programs enough; one segment of
    few rows has few programs, and 32 channels a program, twice as many programs, is faster
    there. The gradients are bitwise equal either way."""
    return 64 if segments > 1 or batch * channels >= 8192 or element_size < 4 else 32


def _backward_segment_chunks(batch: int, channels: int, seq_len: int) -> int:
    """Chunks a backward segment for few rows (Bt x D below 6144): _SEGMENTS segments of a long
    row, at least _SEGMENT_CHUNKS chunks each; else all of them (one segment). Few rows leave the
    SMs idle when one program walks all of T, so segments run at once; the flow pass that chains
    them reads the row's v_pre and gradients a second time, which pays only while rows are few
    (at Bt x D 7680 one segment is faster), and segments shorter than _SEGMENT_CHUNKS chunks are
    slower. `plif_backward` keeps one segment unless T is whole segments. When T is whole chunks
    but not whole segments of that length, the segment is the divisor of T's chunks nearest to it
    (T 32760 is 4095 chunks: 35 segments of 117), one segment if no divisor of at least
    _SEGMENT_CHUNKS leaves two."""
    return _segment_chunks_at(batch, channels, seq_len, _BACKWARD_CHUNK_T)


@functools.cache
def _segment_chunks_at(batch: int, channels: int, seq_len: int, chunk_t: int) -> int:
    """`_backward_segment_chunks` at a chunk length (in the cache's key: a chunk length set by a
    test or a sweep must not be answered with another length's choice)."""
    chunks = max(seq_len // chunk_t, 1)
    if batch * channels >= 6144:
        return chunks
    target = max(_SEGMENT_CHUNKS, chunks // _SEGMENTS)
    divisors = [size for size in range(_SEGMENT_CHUNKS, chunks // 2 + 1) if chunks % size == 0]
    return min(divisors, key=lambda size: (abs(size - target), size)) if divisors else chunks


@triton.jit
def channel_block(channels_arg, CHANNELS: tl.constexpr, BLOCK_D: tl.constexpr):
    """The program's channels (BLOCK_D,) and the row width: the compile-time constant CHANNELS when
    it is > 0 (two channels a thread or more; the channels a thread holds marked contiguous), else
    channels_arg as given at run time. Shared by the PLIF kernels of both directions."""
    channel = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    if CHANNELS > 0:
        tl.static_assert(BLOCK_D >= 64, "a constant row width needs two channels a thread or more")
        channels = CHANNELS
        channel = tl.max_contiguous(channel, BLOCK_D // 32)  # one warp a program
    else:
        channels = channels_arg
    return channel, channels


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


@triton.jit
def _chunk_scan(v_pres, outer_spike, outer_v_pre, grad_v, beta, threshold, alpha, last_step):
    """A chunk's adjoint (rows backwards in time: row 0 its last step) from its v_pre and outer
    gradients (CHUNK_T, BLOCK_D) and grad_v (BLOCK_D,), dL/dv arriving at its last step. Returns
    the tiles gain (at the first step: dp_first / dgrad_v), p, the threshold's and the leak's
    scanned sums (whole-chunk values at the first step's row), the threshold terms each step adds
    itself, and v after each step's reset."""
    zeros = tl.zeros(v_pres.shape, dtype=tl.float32)
    above = v_pres - threshold[None, :]
    spike = (above > 0).to(tl.float32)
    sig = tl.sigmoid(alpha * above)
    surrogate = alpha * sig * (1.0 - sig)
    # p_t = e_t + (1 - v_th sg_t) g_t with g_t = beta p_{t+1}; the last step takes the arriving
    # grad_v as its g directly, so its decay multiplies nothing: it holds (1 - v_th sg) alone, and
    # the decays' product at the first step is then p_first's gain on grad_v.
    through = 1.0 - threshold[None, :] * surrogate
    local = outer_v_pre + outer_spike * surrogate + tl.where(last_step, through * grad_v[None, :], 0.0)
    # dL/dv_th = -sum_t (dL/ds_t sg_t + g_t w_t); dL/dbeta (1 - beta) = sum_t p_t (v_{t-1} - v_pre_t),
    # and sum_t p_t v_{t-1} pairs each step's reset membrane v_s with p_{s+1}: both sums of
    # weights times the next step's p, taken in the scan (no step-before load).
    weight = spike - threshold[None, :] * surrogate
    v_after = v_pres - threshold[None, :] * spike
    gain, grad_v_pres, _, threshold_sum, _, beta_sum = tl.associative_scan(
        (tl.where(last_step, through, beta[None, :] * through), local,
         tl.where(last_step, 0.0, beta[None, :] * weight), zeros, tl.where(last_step, 0.0, v_after), zeros),
        0, _adjoint_combine,
    )
    own_threshold = outer_spike * surrogate + tl.where(last_step, weight * grad_v[None, :], 0.0)
    return gain, grad_v_pres, threshold_sum, beta_sum, own_threshold, v_after


@triton.jit
def _chunk_loads(v_pre_ptr, grad_spikes_ptr, grad_v_pre_ptr, at, tile_ok,
                 HAS_GRAD_SPIKES: tl.constexpr, HAS_GRAD_V_PRE: tl.constexpr, MASKED: tl.constexpr):
    """A chunk's v_pre and outer gradients at the (CHUNK_T, BLOCK_D) offsets `at` (zero where absent)."""
    zeros = tl.zeros(at.shape, dtype=tl.float32)
    outer_spike = zeros
    outer_v_pre = zeros
    if MASKED:
        v_pres = tl.load(v_pre_ptr + at, mask=tile_ok, other=0.0)
        if HAS_GRAD_SPIKES:
            outer_spike = tl.load(grad_spikes_ptr + at, mask=tile_ok, other=0.0).to(tl.float32)
        if HAS_GRAD_V_PRE:
            outer_v_pre = tl.load(grad_v_pre_ptr + at, mask=tile_ok, other=0.0).to(tl.float32)
    else:
        v_pres = tl.load(v_pre_ptr + at)
        if HAS_GRAD_SPIKES:
            outer_spike = tl.load(grad_spikes_ptr + at).to(tl.float32)
        if HAS_GRAD_V_PRE:
            outer_v_pre = tl.load(grad_v_pre_ptr + at).to(tl.float32)
    return v_pres, outer_spike, outer_v_pre


@triton.jit
def _chunk_frame(batch, segment, channel, channel_ok, channels, seq_len, segment_steps, CHUNK_T: tl.constexpr):
    """What a segment's chunk loop is laid out by (rows backwards in time, row 0 a chunk's last
    step): the last and first steps' rows (CHUNK_T, 1), the tile's mask and its elements' offsets
    relative to its last step (CHUNK_T, BLOCK_D; loop-invariant int32, so each chunk's addresses are
    one scalar added, not a 64-bit product an element), and the segment's last step's row."""
    rows = tl.arange(0, CHUNK_T)
    last_step = (rows == 0)[:, None]
    first_step = (rows == CHUNK_T - 1)[:, None]
    tile_ok = (rows >= 0)[:, None] & channel_ok[None, :]
    tile = channel[None, :] - rows[:, None] * channels
    row_last = batch.to(tl.int64) * seq_len + (segment + 1) * segment_steps - 1
    return last_step, first_step, tile_ok, tile, row_last


@triton.jit
def _first_step(tile, first_step):
    """The first step's row of a chunk tile (a masked sum: right in any layout, where a take-last
    reduction is not once steps span lanes, since warps reduce by butterfly)."""
    return tl.sum(tl.where(first_step, tile, 0.0), 0)


@triton.jit(do_not_specialize=["channels_arg"])
def _plif_backward_kernel(
    beta_ptr, threshold_ptr, v0_ptr, v_pre_ptr,
    grad_spikes_ptr, grad_v_pre_ptr, grad_v_last_ptr, carry_ptr, p_after_ptr,
    grad_x_ptr, grad_beta_ptr, grad_threshold_ptr, grad_v0_ptr,
    seq_len, channels_arg, segments, segment_steps, alpha, CHANNELS: tl.constexpr,
    HAS_V0: tl.constexpr, HAS_GRAD_SPIKES: tl.constexpr, HAS_GRAD_V_PRE: tl.constexpr,
    HAS_GRAD_V_LAST: tl.constexpr, HAS_CARRY: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK_T: tl.constexpr,
    STAGES: tl.constexpr, MASKED: tl.constexpr,
):
    """One segment of segment_steps steps (all whole chunks when there is one) for a block of
    channels, from its last step back, from what arrives at its end (carry: dL/dv; p_after: p of
    the step after it; with one segment, dL/dv_last and none). With one segment the last
    seq_len % CHUNK_T steps go first, one at a time (_backward_step). Writes dL/dx and the
    segment's shares of dL/dbeta and dL/dv_th, and dL/dv leaving its first step (dL/dv0 for the
    first segment).

    The row width is a compile-time constant when CHANNELS > 0 (else `channels_arg`, unspecialised):
    each row of a chunk is then an immediate offset from one address, not a 64-bit add an element.
    Only with two channels a thread (BLOCK_D 64): its contiguity is capped at them, and Triton then
    keeps a chunk's steps in each thread's registers. With one channel a thread and a constant
    width, Triton can spread a chunk's steps over 8 lanes (shuffles in every step's chain, much
    slower), and told the width's divisibility it vectorises 4 channels a thread and spreads them
    over 4 lanes; so BLOCK_D 32 takes the width at run time, unspecialised, where the steps stay in
    registers. A take-last reduction would return the wrong step in any of those spread layouts
    (warps reduce by butterfly), so values are picked by masked sums."""
    batch = tl.program_id(0)
    channel, channels = channel_block(channels_arg, CHANNELS, BLOCK_D)  # (BLOCK_D,), the row width
    segment = tl.program_id(2)
    channel_ok = channel < channels
    state_offsets = batch * channels + channel
    segment_offsets = (batch * segments + segment) * channels + channel
    beta = tl.load(beta_ptr + channel, mask=channel_ok, other=0.5).to(tl.float32)
    threshold = tl.load(threshold_ptr + channel, mask=channel_ok, other=1.0).to(tl.float32)
    if HAS_V0:
        v_initial = tl.load(v0_ptr + state_offsets, mask=channel_ok, other=0.0).to(tl.float32)
    else:
        v_initial = tl.zeros([BLOCK_D], dtype=tl.float32)
    # grad_v: dL/dv_t through everything after step t; p_after: p at the step after the chunk.
    p_after = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_CARRY:
        grad_v = tl.load(carry_ptr + segment_offsets, mask=channel_ok, other=0.0)
        p_after = tl.load(p_after_ptr + segment_offsets, mask=channel_ok, other=0.0)
    elif HAS_GRAD_V_LAST:
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
    last_step, first_step, tile_ok, tile, row_last = _chunk_frame(
        batch, segment, channel, channel_ok, channels, seq_len, segment_steps, CHUNK_T)
    for back in tl.range(0, segment_steps, CHUNK_T, num_stages=STAGES):
        shift = (row_last - back) * channels
        v_pres, outer_spike, outer_v_pre = _chunk_loads(
            v_pre_ptr, grad_spikes_ptr, grad_v_pre_ptr, shift + tile, tile_ok, HAS_GRAD_SPIKES, HAS_GRAD_V_PRE, MASKED)
        _, grad_v_pres, threshold_sum, beta_sum, own_threshold, v_after = _chunk_scan(
            v_pres, outer_spike, outer_v_pre, grad_v, beta, threshold, alpha, last_step)
        grad_threshold -= _first_step(threshold_sum, first_step) + tl.sum(own_threshold, 0)
        grad_beta_scaled += _first_step(beta_sum, first_step) + tl.sum(
            tl.where(last_step, v_after * p_after[None, :], 0.0) - grad_v_pres * v_pres, 0)
        grad_x = grad_v_pres * (1.0 - beta)[None, :]
        if MASKED:
            tl.store(grad_x_ptr + shift + tile, grad_x.to(grad_x_ptr.dtype.element_ty), mask=tile_ok)
        else:
            tl.store(grad_x_ptr + shift + tile, grad_x.to(grad_x_ptr.dtype.element_ty))
        p_after = _first_step(grad_v_pres, first_step)
        grad_v = beta * p_after
    # The first step's p pairs with v0 (when chunks reached it; a short T did it step by step).
    grad_beta_scaled += tl.where(whole > 0, tl.where(segment == 0, p_after * v_initial, 0.0), 0.0)
    tl.store(grad_v0_ptr + segment_offsets, grad_v, mask=channel_ok)
    tl.store(grad_beta_ptr + segment_offsets, grad_beta_scaled / (1.0 - beta), mask=channel_ok)
    tl.store(grad_threshold_ptr + segment_offsets, grad_threshold, mask=channel_ok)


@triton.jit(do_not_specialize=["channels"])
def _segment_flow_kernel(
    beta_ptr, threshold_ptr, v_pre_ptr, grad_spikes_ptr, grad_v_pre_ptr, p_offset_ptr, p_gain_ptr,
    seq_len, channels, segments, segment_steps, alpha,
    HAS_GRAD_SPIKES: tl.constexpr, HAS_GRAD_V_PRE: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK_T: tl.constexpr,
    STAGES: tl.constexpr, MASKED: tl.constexpr,
):
    """For segment program_id(2) + 1 (the first one's is not needed): p at its first step as
    p_offset + p_gain x (dL/dv arriving at its end)."""
    batch = tl.program_id(0)
    channel = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    segment = tl.program_id(2) + 1
    channel_ok = channel < channels
    beta = tl.load(beta_ptr + channel, mask=channel_ok, other=0.5).to(tl.float32)
    threshold = tl.load(threshold_ptr + channel, mask=channel_ok, other=1.0).to(tl.float32)
    last_step, first_step, tile_ok, tile, row_last = _chunk_frame(
        batch, segment, channel, channel_ok, channels, seq_len, segment_steps, CHUNK_T)
    # What arrives at the current chunk's end = offset + gain x what arrives at the segment's end.
    offset = tl.zeros([BLOCK_D], dtype=tl.float32)
    gain = tl.full([BLOCK_D], 1.0, tl.float32)
    p_offset = offset
    p_gain = gain
    for back in tl.range(0, segment_steps, CHUNK_T, num_stages=STAGES):
        v_pres, outer_spike, outer_v_pre = _chunk_loads(
            v_pre_ptr, grad_spikes_ptr, grad_v_pre_ptr, (row_last - back) * channels + tile, tile_ok,
            HAS_GRAD_SPIKES, HAS_GRAD_V_PRE, MASKED)
        chunk_gain, grad_v_pres, _, _, _, _ = _chunk_scan(
            v_pres, outer_spike, outer_v_pre, offset, beta, threshold, alpha, last_step)
        p_offset = _first_step(grad_v_pres, first_step)
        p_gain = _first_step(chunk_gain, first_step) * gain
        offset = beta * p_offset
        gain = beta * p_gain
    at = (batch * segments + segment) * channels + channel
    tl.store(p_offset_ptr + at, p_offset, mask=channel_ok)
    tl.store(p_gain_ptr + at, p_gain, mask=channel_ok)


@triton.jit
def _segment_carries_kernel(
    beta_ptr, grad_v_last_ptr, p_offset_ptr, p_gain_ptr, carry_ptr, p_after_ptr, channels, segments,
    HAS_GRAD_V_LAST: tl.constexpr, BLOCK: tl.constexpr,
):
    """From the last segment back, what arrives at each segment's end: dL/dv (carry) and p of the
    step after it (p_after), sequential over segments (few of them)."""
    batch = tl.program_id(0)
    channel = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = channel < channels
    beta = tl.load(beta_ptr + channel, mask=ok, other=0.5).to(tl.float32)
    if HAS_GRAD_V_LAST:
        grad_v = tl.load(grad_v_last_ptr + batch * channels + channel, mask=ok, other=0.0).to(tl.float32)
    else:
        grad_v = tl.zeros([BLOCK], dtype=tl.float32)
    p_after = tl.zeros([BLOCK], dtype=tl.float32)
    for back in tl.range(0, segments - 1):
        at = (batch * segments + segments - 1 - back) * channels + channel
        tl.store(carry_ptr + at, grad_v, mask=ok)
        tl.store(p_after_ptr + at, p_after, mask=ok)
        p_after = tl.load(p_offset_ptr + at, mask=ok, other=0.0) + tl.load(p_gain_ptr + at, mask=ok, other=0.0) * grad_v
        grad_v = beta * p_after
    tl.store(carry_ptr + batch * segments * channels + channel, grad_v, mask=ok)
    tl.store(p_after_ptr + batch * segments * channels + channel, p_after, mask=ok)


def plif_backward(
    beta: torch.Tensor, v_th: torch.Tensor, v0: torch.Tensor | None, v_pre_f32: torch.Tensor,
    grad_spikes: torch.Tensor | None, grad_v_pre: torch.Tensor | None, grad_v_last: torch.Tensor | None,
    alpha: float, x_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """dL/dx (x_dtype), dL/dbeta, dL/dv_th and dL/dv0 (None without v0) from the forward's fp32
    v_pre (Bt, T, D) and the outputs' gradients (None: zero)."""
    batch, seq_len, channels = v_pre_f32.shape
    device = v_pre_f32.device
    whole = seq_len - seq_len % _BACKWARD_CHUNK_T
    segment_steps = _backward_segment_chunks(batch, channels, seq_len) * _BACKWARD_CHUNK_T
    # Segments only when T is whole segments (so no step-by-step steps) and at least two.
    segments = seq_len // segment_steps if seq_len % segment_steps == 0 and seq_len >= 2 * segment_steps else 1
    if segments == 1:
        segment_steps = whole
    grad_x = new_buffer(v_pre_f32.shape, x_dtype, device)
    grad_v0 = new_buffer((batch, segments, channels), torch.float32, device)
    grad_beta = new_buffer((batch, segments, channels), torch.float32, device)
    grad_threshold = new_buffer((batch, segments, channels), torch.float32, device)

    def pointer(grad: torch.Tensor | None) -> torch.Tensor:
        return grad.contiguous() if grad is not None else v_pre_f32

    beta, v_th = beta.contiguous(), v_th.contiguous()
    outer = dict(HAS_GRAD_SPIKES=grad_spikes is not None, HAS_GRAD_V_PRE=grad_v_pre is not None)
    element_size = min([grad.element_size() for grad in (grad_spikes, grad_v_pre) if grad is not None], default=4)
    block = _backward_channels(batch, channels, segments, element_size)
    tiles = dict(BLOCK_D=block, CHUNK_T=_BACKWARD_CHUNK_T, STAGES=_BACKWARD_STAGES, MASKED=channels % block != 0,
                 num_warps=1)
    blocks = triton.cdiv(channels, block)
    carry = p_after = None
    if segments > 1:
        # 1. How each segment's first p depends on what arrives at its end.
        p_offset = new_buffer((batch, segments, channels), torch.float32, device)
        p_gain = new_buffer((batch, segments, channels), torch.float32, device)
        _segment_flow_kernel[(batch, blocks, segments - 1)](
            beta, v_th, v_pre_f32, pointer(grad_spikes), pointer(grad_v_pre), p_offset, p_gain,
            seq_len, channels, segments, segment_steps, float(alpha), **outer, **tiles,
        )
        # 2. What arrives at each segment's end (sequential over segments, short).
        carry = new_buffer((batch, segments, channels), torch.float32, device)
        p_after = new_buffer((batch, segments, channels), torch.float32, device)
        _segment_carries_kernel[(batch, triton.cdiv(channels, 1024))](
            beta, pointer(grad_v_last), p_offset, p_gain, carry, p_after, channels, segments,
            HAS_GRAD_V_LAST=grad_v_last is not None, BLOCK=1024, num_warps=4,
        )
    # 3. Every segment at once.
    _plif_backward_kernel[(batch, blocks, segments)](
        beta, v_th, v0.contiguous() if v0 is not None else v_pre_f32, v_pre_f32,
        pointer(grad_spikes), pointer(grad_v_pre), pointer(grad_v_last),
        carry if carry is not None else v_pre_f32, p_after if p_after is not None else v_pre_f32,
        grad_x, grad_beta, grad_threshold, grad_v0,
        seq_len, channels, segments, segment_steps, float(alpha), CHANNELS=channels if block >= 64 else 0,
        HAS_V0=v0 is not None, HAS_GRAD_V_LAST=grad_v_last is not None, HAS_CARRY=carry is not None,
        **outer, **tiles,
    )
    # Partials over rows and segments summed here in a fixed order (no atomics: deterministic).
    return (
        grad_x,
        grad_beta.sum((0, 1)),
        grad_threshold.sum((0, 1)),
        grad_v0[:, 0] if v0 is not None else None,
    )
