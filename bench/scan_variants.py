"""An experiment for issue 5: the selective scan's forward as one time step per loop iteration.

What made the PLIF scan 3x faster (bench/RESULTS.md): a step loop whose loads run `num_stages`
steps ahead (`tl.range(..., num_stages=S)`), in place of a chunk tile scanned with
`tl.associative_scan`. Here the same for the selective scan's forward: a program holds a
(BLOCK_D, N) state in registers; per step it loads x and delta (BLOCK_D), B and C (N), takes one
exp2 per state, updates the state with one FMA (the only dependent chain) and reduces over N
for y. It stores the chunk-start states the existing backward recomputes from, so the backward
of kernels/selective_scan.py runs unchanged after it.

Checks each variant against kernels.selective_scan on odd sizes (y, h_last and the gradients
through the unchanged backward), then times the forward and forward + backward against it.

    python bench/scan_variants.py              (CUDA; under TRITON_INTERPRET=1 it only checks, on a CPU)

Not yet run on a GPU (written in session 3 after the device time was spent).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels._dispatch import new_buffer  # noqa: E402

# The module, not the function of the same name that kernels/__init__.py exports.
scan_module = importlib.import_module("kernels.selective_scan")

LOG2_E = 1.0 / math.log(2.0)


@triton.jit
def _forward_steps(
    x_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, h0_ptr, y_ptr, h_last_ptr, chunk_start_ptr,
    seq_len, channels, groups, per_group, state_size, chunks, log2_e,
    HAS_D: tl.constexpr, HAS_H0: tl.constexpr,
    BLOCK_D: tl.constexpr, N_PAD: tl.constexpr, CHUNK_T: tl.constexpr, STAGES: tl.constexpr,
):
    batch = tl.program_id(0)
    group = tl.program_id(1)
    within = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    channel = group * per_group + within  # (BLOCK_D,)
    channel_ok = within < per_group
    n = tl.arange(0, N_PAD)
    n_ok = n < state_size
    state_mask = channel_ok[:, None] & n_ok[None, :]
    state_offsets = channel[:, None] * state_size + n[None, :]  # (BLOCK_D, N_PAD)
    # exp(delta A) as exp2(delta A log2 e): one multiply folded into A once.
    A2 = tl.load(A_ptr + state_offsets, mask=state_mask, other=0.0).to(tl.float32) * log2_e
    batch_state = batch.to(tl.int64) * channels * state_size
    if HAS_H0:
        h = tl.load(h0_ptr + batch_state + state_offsets, mask=state_mask, other=0.0)
    else:
        h = tl.zeros([BLOCK_D, N_PAD], dtype=tl.float32)
    if HAS_D:
        D_vec = tl.load(D_ptr + channel, mask=channel_ok, other=0.0).to(tl.float32)
    first_row = batch.to(tl.int64) * seq_len
    for t in tl.range(0, seq_len, num_stages=STAGES):
        row = first_row + t
        x_t = tl.load(x_ptr + row * channels + channel, mask=channel_ok, other=0.0).to(tl.float32)
        delta_t = tl.load(delta_ptr + row * channels + channel, mask=channel_ok, other=0.0).to(tl.float32)
        bc = (row * groups + group) * state_size + n  # (N_PAD,)
        B_t = tl.load(B_ptr + bc, mask=n_ok, other=0.0).to(tl.float32)
        C_t = tl.load(C_ptr + bc, mask=n_ok, other=0.0).to(tl.float32)
        # The state entering each chunk, for the backward's recomputation.
        at_chunk_start = (within < tl.where(t % CHUNK_T == 0, per_group, 0))[:, None] & n_ok[None, :]
        chunk_state = (batch.to(tl.int64) * chunks + t // CHUNK_T) * channels * state_size
        tl.store(chunk_start_ptr + chunk_state + state_offsets, h, mask=at_chunk_start)
        decay = tl.exp2(delta_t[:, None] * A2)  # (BLOCK_D, N_PAD)
        h = decay * h + (delta_t * x_t)[:, None] * B_t[None, :]
        y_t = tl.sum(h * C_t[None, :], axis=1)  # (BLOCK_D,)
        if HAS_D:
            y_t += D_vec * x_t
        tl.store(y_ptr + row * channels + channel, y_t.to(y_ptr.dtype.element_ty), mask=channel_ok)
    tl.store(h_last_ptr + batch_state + state_offsets, h, mask=state_mask)


@triton.jit
def _exp2_on_fma(x):
    """2^x for x <= 0 on the FMA pipe: round x to an integer with the 1.5 * 2^23 trick, a degree-5
    polynomial for 2^f on [-0.5, 0.5] (relative error 2.2e-7, as MUFU.EX2's), and the integer
    added into the exponent bits. Under -126 it returns about 2^-126, not 0 (a decay that small
    erases the state either way)."""
    x = tl.maximum(x, -126.0)
    shifted = x + 12582912.0  # the rounded integer sits in the low mantissa bits
    whole = shifted - 12582912.0
    f = x - whole
    p = 0.0013266970636323094 * f + 0.009675459936261177
    p = p * f + 0.05550742521882057
    p = p * f + 0.24022121727466583
    p = p * f + 0.6931469440460205
    p = p * f + 1.0000001192092896
    bits = p.to(tl.int32, bitcast=True) + (shifted.to(tl.int32, bitcast=True) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _forward_split(
    x_ptr, delta_ptr, A_T_ptr, B_ptr, C_ptr, D_ptr, h0_T_ptr, y_ptr, h_last_T_ptr, chunk_start_ptr,
    seq_len, chunks, log2_e, channels: tl.constexpr, groups: tl.constexpr, state_size: tl.constexpr,
    HAS_D: tl.constexpr, HAS_H0: tl.constexpr,
    BLOCK_D: tl.constexpr, ROWS: tl.constexpr, SPLIT: tl.constexpr, N_PAD: tl.constexpr, CHUNK_T: tl.constexpr, UNROLL: tl.constexpr,
    POLY_EVERY: tl.constexpr, STAGES: tl.constexpr, EVEN: tl.constexpr,
):
    per_group: tl.constexpr = channels // groups
    batch = tl.program_id(0)
    group = tl.program_id(1)
    within = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    channel = group * per_group + within  # (BLOCK_D,)
    channel_ok = within < per_group
    # n = split * ROWS + row: the tile (ROWS, SPLIT, BLOCK_D) puts SPLIT threads on a channel, each
    # holding ROWS consecutive states (so B and C reach it in 16-byte reads).
    n = (tl.arange(0, SPLIT)[None, :] * ROWS + tl.arange(0, ROWS)[:, None])[:, :, None]  # (ROWS, SPLIT, 1)
    n_ok = n < state_size
    state_mask = n_ok & channel_ok[None, None, :]
    state_offsets = n * channels + channel[None, None, :]  # (ROWS, SPLIT, BLOCK_D)
    A2 = tl.load(A_T_ptr + state_offsets, mask=state_mask, other=0.0).to(tl.float32) * log2_e
    batch_state = batch.to(tl.int64) * channels * state_size
    if HAS_H0:
        h = tl.load(h0_T_ptr + batch_state + state_offsets, mask=state_mask, other=0.0)
    else:
        h = tl.zeros([ROWS, SPLIT, BLOCK_D], dtype=tl.float32)
    if HAS_D:
        D_vec = tl.load(D_ptr + channel, mask=channel_ok, other=0.0).to(tl.float32)
    first_row = batch.to(tl.int64) * seq_len
    chunk_base = chunk_start_ptr + batch.to(tl.int64) * chunks * channels * state_size + state_offsets
    x_rows = x_ptr + first_row * channels + channel  # (BLOCK_D,) pointers at t = 0
    delta_rows = delta_ptr + first_row * channels + channel
    y_rows = y_ptr + first_row * channels + channel
    bc_rows = (first_row * groups + group) * state_size + n  # (ROWS, SPLIT, 1) at t = 0
    for t0 in tl.range(0, seq_len, UNROLL, num_stages=STAGES):
        if t0 % CHUNK_T == 0:  # the state entering each chunk, for the backward
            tl.store(chunk_base + (t0 // CHUNK_T) * channels * state_size, h, mask=state_mask)
        for i in tl.static_range(UNROLL):
            t = t0 + i
            live = within < tl.where(t < seq_len, per_group, 0)  # (BLOCK_D,)
            bc = bc_rows + t * groups * state_size
            if EVEN:
                x_t = tl.load(x_rows + t * channels).to(tl.float32)
                delta_t = tl.load(delta_rows + t * channels).to(tl.float32)
                B_t = tl.load(B_ptr + bc).to(tl.float32)
                C_t = tl.load(C_ptr + bc).to(tl.float32)
            else:
                x_t = tl.load(x_rows + t * channels, mask=live, other=0.0).to(tl.float32)
                delta_t = tl.load(delta_rows + t * channels, mask=live, other=0.0).to(tl.float32)
                B_t = tl.load(B_ptr + bc, mask=n_ok, other=0.0).to(tl.float32)
                C_t = tl.load(C_ptr + bc, mask=n_ok, other=0.0).to(tl.float32)
            exponent = delta_t[None, None, :] * A2  # (N_PAD, BLOCK_D), <= 0
            if i % POLY_EVERY == POLY_EVERY - 1:
                decay = _exp2_on_fma(exponent)
            else:
                decay = tl.exp2(exponent)
            # Past the end delta is 0: decay 1, drive 0, the state stays.
            h = decay * h + B_t * (delta_t * x_t)[None, None, :]
            y_t = tl.sum(tl.sum(h * C_t, axis=0), axis=0)  # (BLOCK_D,)
            if HAS_D:
                y_t += D_vec * x_t
            if EVEN:
                tl.store(y_rows + t * channels, y_t.to(y_ptr.dtype.element_ty))
            else:
                tl.store(y_rows + t * channels, y_t.to(y_ptr.dtype.element_ty), mask=live)
    tl.store(h_last_T_ptr + batch_state + state_offsets, h, mask=state_mask)


@triton.jit
def _take_last(left, right):
    return right


@triton.jit
def _forward_chunks(
    x_ptr, delta_ptr, A_T_ptr, B_ptr, C_ptr, D_ptr, h0_T_ptr, y_ptr, h_last_T_ptr, chunk_start_ptr,
    seq_len, chunks, log2_e, channels: tl.constexpr, groups: tl.constexpr, state_size: tl.constexpr,
    HAS_D: tl.constexpr, HAS_H0: tl.constexpr,
    BLOCK_D: tl.constexpr, N_PAD: tl.constexpr, CHUNK_T: tl.constexpr, STAGES: tl.constexpr, EVEN: tl.constexpr,
    SAVE: tl.constexpr,
):
    per_group: tl.constexpr = channels // groups
    batch = tl.program_id(0)
    group = tl.program_id(1)
    within = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    channel = group * per_group + within  # (BLOCK_D,)
    channel_ok = within < per_group
    n = tl.arange(0, N_PAD)
    n_ok = n < state_size
    state_mask = n_ok[:, None] & channel_ok[None, :]
    state_offsets = n[:, None] * channels + channel[None, :]  # (N_PAD, BLOCK_D)
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
        if SAVE:  # the state entering each chunk, for the backward
            tl.store(chunk_base + chunk * channels * state_size, h, mask=state_mask)
        times = chunk * CHUNK_T + rows  # (CHUNK_T,)
        row = first_row + times
        offsets = row[:, None] * channels + channel[None, :]  # (CHUNK_T, BLOCK_D)
        bc = (row[:, None] * groups + group) * state_size + n[None, :]  # (CHUNK_T, N_PAD)
        if EVEN:
            xs = tl.load(x_ptr + offsets).to(tl.float32)
            deltas = tl.load(delta_ptr + offsets).to(tl.float32)
            Bs = tl.load(B_ptr + bc).to(tl.float32)
            Cs = tl.load(C_ptr + bc).to(tl.float32)
        else:
            mask = (times < seq_len)[:, None] & channel_ok[None, :]
            bc_mask = (times < seq_len)[:, None] & n_ok[None, :]
            xs = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            deltas = tl.load(delta_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            Bs = tl.load(B_ptr + bc, mask=bc_mask, other=0.0).to(tl.float32)
            Cs = tl.load(C_ptr + bc, mask=bc_mask, other=0.0).to(tl.float32)
        # Rows past the end have delta 0: decay 1, drive 0, the state kept.
        decay = tl.exp2(deltas[:, None, :] * A2[None, :, :])  # (CHUNK_T, N_PAD, BLOCK_D)
        drive = Bs[:, :, None] * (deltas * xs)[:, None, :]
        # The chunk's start state enters through the first row's drive; the scan's decay products
        # are then unused (and dropped by the compiler).
        drive += tl.where(rows[:, None, None] == 0, decay * h[None, :, :], 0.0)
        _, states = tl.associative_scan((decay, drive), 0, scan_module._affine_combine)
        ys = tl.sum(states * Cs[:, :, None], axis=1)  # (CHUNK_T, BLOCK_D)
        if HAS_D:
            ys += D_vec[None, :] * xs
        if EVEN:
            tl.store(y_ptr + offsets, ys.to(y_ptr.dtype.element_ty))
        else:
            tl.store(y_ptr + offsets, ys.to(y_ptr.dtype.element_ty), mask=mask)
        h = tl.reduce(states, 0, _take_last)
    tl.store(h_last_T_ptr + batch_state + state_offsets, h, mask=state_mask)


@triton.jit
def _reverse_combine(later_decay, later_value, later_gain, decay, value, gain):
    """The adjoint's reverse scan without a shifted decay: a segment [t..u] is (decay_t, V, G) with
    g_t = V + G * (decay_{u+1} g_{u+1}); joined with the segment after it, whose first decay
    multiplies what flows in. (A row alone is (decay_t, local_t, 1).)"""
    through = gain * later_decay
    return decay, value + through * later_value, through * later_gain


@triton.jit
def _take_first(left, right):
    return left


@triton.jit
def _backward_chunks(
    x_ptr, delta_ptr, A_T_ptr, B_ptr, C_ptr, D_ptr, chunk_start_ptr, grad_y_ptr, grad_h_last_T_ptr,
    grad_x_ptr, grad_delta_ptr, grad_A_T_ptr, grad_B_ptr, grad_C_ptr, grad_D_ptr, grad_h0_T_ptr,
    batches, seq_len, chunks, log2_e, channels: tl.constexpr, groups: tl.constexpr, state_size: tl.constexpr,
    HAS_D: tl.constexpr, HAS_GRAD_H_LAST: tl.constexpr,
    BLOCK_D: tl.constexpr, N_PAD: tl.constexpr, CHUNK_T: tl.constexpr, STAGES: tl.constexpr, EVEN: tl.constexpr,
):
    """Chunk by chunk from the end, time in each thread's registers: the chunk's states recomputed
    from its saved start (a scan), the adjoint g_t = C_t gy_t + decay_{t+1} g_{t+1} by a reverse
    scan, then every gradient from the two."""
    per_group: tl.constexpr = channels // groups
    batch = tl.program_id(0)
    group = tl.program_id(1)
    block = tl.program_id(2)
    within = block * BLOCK_D + tl.arange(0, BLOCK_D)
    channel = group * per_group + within  # (BLOCK_D,)
    channel_ok = within < per_group
    n = tl.arange(0, N_PAD)
    n_ok = n < state_size
    state_mask = n_ok[:, None] & channel_ok[None, :]
    state_offsets = n[:, None] * channels + channel[None, :]  # (N_PAD, BLOCK_D)
    A = tl.load(A_T_ptr + state_offsets, mask=state_mask, other=0.0).to(tl.float32)
    A2 = A * log2_e
    batch_state = batch.to(tl.int64) * channels * state_size
    if HAS_GRAD_H_LAST:
        carry = tl.load(grad_h_last_T_ptr + batch_state + state_offsets, mask=state_mask, other=0.0)
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
    for chunk_back in tl.range(0, chunks, num_stages=STAGES):
        chunk = chunks - 1 - chunk_back
        h_start = tl.load(chunk_base + chunk * channels * state_size, mask=state_mask, other=0.0)
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
        _, states = tl.associative_scan(
            (decay, drive + tl.where(rows[:, None, None] == 0, decay * h_start[None, :, :], 0.0)), 0,
            scan_module._affine_combine)
        local = Cs[:, :, None] * grad_ys[:, None, :] + tl.where(rows[:, None, None] == CHUNK_T - 1, carry[None, :, :], 0.0)
        _, adjoint, _ = tl.associative_scan((decay, local, tl.full(local.shape, 1.0, tl.float32)), 0,
                                            _reverse_combine, reverse=True)
        carried = states - drive  # decay_t h_{t-1}
        grad_deltas = tl.sum(adjoint * (A[None, :, :] * carried + Bs[:, :, None] * xs[:, None, :]), axis=1)
        grad_xs = tl.sum(adjoint * Bs[:, :, None], axis=1) * deltas  # (CHUNK_T, BLOCK_D)
        if HAS_D:
            grad_xs += D_vec[None, :] * grad_ys
            grad_D += tl.sum(grad_ys * xs, axis=0)
        if EVEN:
            tl.store(grad_x_ptr + offsets, grad_xs.to(grad_x_ptr.dtype.element_ty))
            tl.store(grad_delta_ptr + offsets, grad_deltas.to(grad_delta_ptr.dtype.element_ty))
        else:
            tl.store(grad_x_ptr + offsets, grad_xs.to(grad_x_ptr.dtype.element_ty), mask=mask)
            tl.store(grad_delta_ptr + offsets, grad_deltas.to(grad_delta_ptr.dtype.element_ty), mask=mask)
        grad_A += tl.sum(adjoint * deltas[:, None, :] * carried, axis=0)
        # This block's share of dB and dC (summed over the blocks afterwards, in a fixed order).
        grad_Bs = tl.sum(adjoint * dx[:, None, :], axis=2)  # (CHUNK_T, N_PAD)
        grad_Cs = tl.sum(grad_ys[:, None, :] * states, axis=2)
        if EVEN:
            tl.store(grad_B_ptr + partials + bc, grad_Bs)
            tl.store(grad_C_ptr + partials + bc, grad_Cs)
        else:
            tl.store(grad_B_ptr + partials + bc, grad_Bs, mask=bc_mask)
            tl.store(grad_C_ptr + partials + bc, grad_Cs, mask=bc_mask)
        carry = tl.reduce(decay * adjoint, 0, _take_first)  # decay_0 g_0 flows into the chunk before
    tl.store(grad_h0_T_ptr + batch_state + state_offsets, carry, mask=state_mask)
    tl.store(grad_A_T_ptr + batch_state + state_offsets, grad_A, mask=state_mask)
    if HAS_D:
        tl.store(grad_D_ptr + batch.to(tl.int64) * channels + channel, grad_D, mask=channel_ok)


@triton.jit
def _backward_steps(
    x_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, chunk_start_ptr, grad_y_ptr, grad_h_last_ptr,
    grad_x_ptr, grad_delta_ptr, grad_A_ptr, grad_B_ptr, grad_C_ptr, grad_D_ptr, grad_h0_ptr, scratch_ptr,
    batches, seq_len, channels, groups, per_group, state_size, chunks, log2_e,
    HAS_D: tl.constexpr, HAS_GRAD_H_LAST: tl.constexpr,
    BLOCK_D: tl.constexpr, N_PAD: tl.constexpr, CHUNK_T: tl.constexpr, STAGES: tl.constexpr,
):
    """Chunk by chunk from the end: the chunk's states recomputed from its saved start into a
    scratch tile of this program (L2-resident), then a reverse step loop over them. The adjoint
    g_t = dL/dh_t = C_t gy_t + exp(delta_{t+1} A) g_{t+1} is the only chain; decay_t h_{t-1} is
    h_t - drive_t, so the reverse loop needs no state before the step."""
    batch = tl.program_id(0)
    group = tl.program_id(1)
    block = tl.program_id(2)
    within = block * BLOCK_D + tl.arange(0, BLOCK_D)
    channel = group * per_group + within  # (BLOCK_D,)
    channel_ok = within < per_group
    n = tl.arange(0, N_PAD)
    n_ok = n < state_size
    state_mask = channel_ok[:, None] & n_ok[None, :]
    state_offsets = channel[:, None] * state_size + n[None, :]  # (BLOCK_D, N_PAD)
    A = tl.load(A_ptr + state_offsets, mask=state_mask, other=0.0).to(tl.float32)
    A2 = A * log2_e
    batch_state = batch.to(tl.int64) * channels * state_size
    if HAS_GRAD_H_LAST:
        carry = tl.load(grad_h_last_ptr + batch_state + state_offsets, mask=state_mask, other=0.0)
    else:
        carry = tl.zeros([BLOCK_D, N_PAD], dtype=tl.float32)
    if HAS_D:
        D_vec = tl.load(D_ptr + channel, mask=channel_ok, other=0.0).to(tl.float32)
    grad_A = tl.zeros([BLOCK_D, N_PAD], dtype=tl.float32)
    grad_D = tl.zeros([BLOCK_D], dtype=tl.float32)
    program = (batch * groups + group) * tl.num_programs(2) + block
    scratch = scratch_ptr + program.to(tl.int64) * CHUNK_T * BLOCK_D * N_PAD
    tile = tl.arange(0, BLOCK_D)[:, None] * N_PAD + n[None, :]  # (BLOCK_D, N_PAD) in the scratch
    first_row = batch.to(tl.int64) * seq_len
    partials = block.to(tl.int64) * batches * seq_len * groups * state_size
    for chunk_back in range(0, chunks):
        chunk = chunks - 1 - chunk_back
        t0 = chunk * CHUNK_T
        chunk_state = (batch.to(tl.int64) * chunks + chunk) * channels * state_size
        h = tl.load(chunk_start_ptr + chunk_state + state_offsets, mask=state_mask, other=0.0)
        for i in tl.range(0, CHUNK_T, num_stages=STAGES):
            t = t0 + i
            live = within < tl.where(t < seq_len, per_group, 0)  # rows past the end: delta 0, h kept
            row = first_row + t
            x_t = tl.load(x_ptr + row * channels + channel, mask=live, other=0.0).to(tl.float32)
            delta_t = tl.load(delta_ptr + row * channels + channel, mask=live, other=0.0).to(tl.float32)
            B_t = tl.load(B_ptr + (row * groups + group) * state_size + n,
                          mask=n < tl.where(t < seq_len, state_size, 0), other=0.0).to(tl.float32)
            h = tl.exp2(delta_t[:, None] * A2) * h + (delta_t * x_t)[:, None] * B_t[None, :]
            tl.store(scratch + i * BLOCK_D * N_PAD + tile, h)
        tl.debug_barrier()
        for back in tl.range(0, CHUNK_T, num_stages=STAGES):
            i = CHUNK_T - 1 - back
            t = t0 + i
            live = within < tl.where(t < seq_len, per_group, 0)
            n_live = n < tl.where(t < seq_len, state_size, 0)
            row = first_row + t
            x_t = tl.load(x_ptr + row * channels + channel, mask=live, other=0.0).to(tl.float32)
            delta_t = tl.load(delta_ptr + row * channels + channel, mask=live, other=0.0).to(tl.float32)
            grad_y_t = tl.load(grad_y_ptr + row * channels + channel, mask=live, other=0.0).to(tl.float32)
            bc = (row * groups + group) * state_size + n
            B_t = tl.load(B_ptr + bc, mask=n_live, other=0.0).to(tl.float32)
            C_t = tl.load(C_ptr + bc, mask=n_live, other=0.0).to(tl.float32)
            h_t = tl.load(scratch + i * BLOCK_D * N_PAD + tile)
            adjoint = grad_y_t[:, None] * C_t[None, :] + carry  # (BLOCK_D, N_PAD): dL/dh_t
            drive = (delta_t * x_t)[:, None] * B_t[None, :]
            carried = h_t - drive  # decay_t h_{t-1}
            grad_delta_t = tl.sum(adjoint * (A * carried + x_t[:, None] * B_t[None, :]), axis=1)
            grad_x_t = tl.sum(adjoint * B_t[None, :], axis=1) * delta_t
            if HAS_D:
                grad_x_t += D_vec * grad_y_t
                grad_D += grad_y_t * x_t
            tl.store(grad_x_ptr + row * channels + channel, grad_x_t.to(grad_x_ptr.dtype.element_ty), mask=live)
            tl.store(grad_delta_ptr + row * channels + channel, grad_delta_t.to(grad_delta_ptr.dtype.element_ty),
                     mask=live)
            grad_A += adjoint * delta_t[:, None] * carried
            # This block's share of dB and dC (summed over blocks afterwards, in a fixed order).
            tl.store(grad_B_ptr + partials + bc, tl.sum(adjoint * (delta_t * x_t)[:, None], axis=0), mask=n_live)
            tl.store(grad_C_ptr + partials + bc, tl.sum(grad_y_t[:, None] * h_t, axis=0), mask=n_live)
            carry = tl.exp2(delta_t[:, None] * A2) * adjoint
        tl.debug_barrier()  # the next chunk rewrites the scratch
    tl.store(grad_h0_ptr + batch_state + state_offsets, carry, mask=state_mask)
    tl.store(grad_A_ptr + batch_state + state_offsets, grad_A, mask=state_mask)
    if HAS_D:
        tl.store(grad_D_ptr + batch.to(tl.int64) * channels + channel, grad_D, mask=channel_ok)


def step_scan_class(
    block_d: int, warps: int, stages: int, step_backward: bool = False
) -> type[torch.autograd.Function]:
    """kernels.selective_scan's autograd function with this forward (and, with step_backward,
    this backward; else its own)."""

    class StepScan(scan_module._SelectiveScan):
        @staticmethod
        def forward(ctx, x, delta, A, B, C, D, h0):
            batch, seq_len, channels = x.shape
            groups, state_size = B.shape[2], B.shape[3]
            per_group = channels // groups
            chunks = triton.cdiv(seq_len, scan_module._CHUNK_T)
            x, delta, A, B, C = (t.contiguous() for t in (x, delta, A, B, C))
            D = D.contiguous() if D is not None else None
            h0 = h0.contiguous().float() if h0 is not None else None
            y = new_buffer(x.shape, x.dtype, x.device)
            h_last = new_buffer((batch, channels, state_size), torch.float32, x.device)
            chunk_start = new_buffer((batch, chunks, channels, state_size), torch.float32, x.device)
            _forward_steps[(batch, groups, triton.cdiv(per_group, block_d))](
                x, delta, A, B, C, D if D is not None else x, h0 if h0 is not None else h_last,
                y, h_last, chunk_start,
                seq_len, channels, groups, per_group, state_size, chunks, LOG2_E,
                HAS_D=D is not None, HAS_H0=h0 is not None,
                BLOCK_D=block_d, N_PAD=triton.next_power_of_2(state_size), CHUNK_T=scan_module._CHUNK_T,
                STAGES=stages, num_warps=warps,
            )
            ctx.save_for_backward(x, delta, A, B, C, D, chunk_start)
            ctx.has_h0 = h0 is not None
            ctx.set_materialize_grads(False)
            return y, h_last

        @staticmethod
        def backward(ctx, grad_y, grad_h_last):
            if not step_backward:
                return scan_module._SelectiveScan.backward(ctx, grad_y, grad_h_last)
            x, delta, A, B, C, D, chunk_start = ctx.saved_tensors
            batch, seq_len, channels = x.shape
            groups, state_size = B.shape[2], B.shape[3]
            per_group, chunks, n_pad = channels // groups, chunk_start.shape[1], triton.next_power_of_2(state_size)
            blocks = triton.cdiv(per_group, block_d)
            grad_y = grad_y.contiguous() if grad_y is not None else torch.zeros_like(x)
            grad_x = new_buffer(x.shape, x.dtype, x.device)
            grad_delta = new_buffer(delta.shape, delta.dtype, delta.device)
            grad_A = new_buffer((batch, channels, state_size), torch.float32, x.device)
            grad_B = new_buffer((blocks, *B.shape), torch.float32, x.device)
            grad_C = new_buffer((blocks, *C.shape), torch.float32, x.device)
            grad_D = new_buffer((batch, channels), torch.float32, x.device)
            grad_h0 = new_buffer((batch, channels, state_size), torch.float32, x.device)
            scratch = torch.empty(batch * groups * blocks * scan_module._CHUNK_T * block_d * n_pad, device=x.device)
            _backward_steps[(batch, groups, blocks)](
                x, delta, A, B, C, D if D is not None else x, chunk_start, grad_y,
                grad_h_last.contiguous() if grad_h_last is not None else x,
                grad_x, grad_delta, grad_A, grad_B, grad_C, grad_D, grad_h0, scratch,
                batch, seq_len, channels, groups, per_group, state_size, chunks, LOG2_E,
                HAS_D=D is not None, HAS_GRAD_H_LAST=grad_h_last is not None,
                BLOCK_D=block_d, N_PAD=n_pad, CHUNK_T=scan_module._CHUNK_T, STAGES=stages, num_warps=warps,
            )
            return (
                grad_x,
                grad_delta,
                grad_A.sum(0).to(A.dtype),
                grad_B.sum(0).to(B.dtype),
                grad_C.sum(0).to(C.dtype),
                grad_D.sum(0).to(D.dtype) if D is not None else None,
                grad_h0 if ctx.has_h0 else None,
            )

    return StepScan


def split_scan_class(
    block_d: int, split: int, warps: int, stages: int, unroll: int, poly_every: int
) -> type[torch.autograd.Function]:
    """kernels.selective_scan's autograd function with the split forward; its own backward, fed the
    chunk-start states transposed back to the (Dm, N) layout it reads (that transpose is timed)."""

    class SplitScan(scan_module._SelectiveScan):
        @staticmethod
        def forward(ctx, x, delta, A, B, C, D, h0):
            batch, seq_len, channels = x.shape
            groups, state_size = B.shape[2], B.shape[3]
            per_group = channels // groups
            n_pad = triton.next_power_of_2(state_size)
            chunks = triton.cdiv(seq_len, scan_module._CHUNK_T)
            x, delta, B, C = (t.contiguous() for t in (x, delta, B, C))
            A_T = A.t().contiguous()  # (N, Dm)
            D = D.contiguous() if D is not None else None
            h0_T = h0.float().transpose(1, 2).contiguous() if h0 is not None else None  # (Bt, N, Dm)
            y = new_buffer(x.shape, x.dtype, x.device)
            h_last_T = new_buffer((batch, state_size, channels), torch.float32, x.device)
            chunk_start_T = new_buffer((batch, chunks, state_size, channels), torch.float32, x.device)
            even = seq_len % unroll == 0 and per_group % block_d == 0 and n_pad == state_size
            _forward_split[(batch, groups, triton.cdiv(per_group, block_d))](
                x, delta, A_T, B, C, D if D is not None else x, h0_T if h0 is not None else h_last_T,
                y, h_last_T, chunk_start_T, seq_len, chunks, LOG2_E,
                channels=channels, groups=groups, state_size=state_size,
                HAS_D=D is not None, HAS_H0=h0 is not None,
                BLOCK_D=block_d, ROWS=n_pad // split, SPLIT=split, N_PAD=n_pad, CHUNK_T=scan_module._CHUNK_T,
                UNROLL=unroll, POLY_EVERY=poly_every, STAGES=stages, EVEN=even, num_warps=warps,
            )
            ctx.save_for_backward(x, delta, A, B, C, D, chunk_start_T)
            ctx.has_h0 = h0 is not None
            ctx.set_materialize_grads(False)
            return y, h_last_T.transpose(1, 2).contiguous()

        @staticmethod
        def backward(ctx, grad_y, grad_h_last):
            *inputs, chunk_start_T = ctx.saved_tensors
            ctx.saved_tensors_override = (*inputs, chunk_start_T.transpose(2, 3).contiguous())
            return scan_module._SelectiveScan.backward(_Saved(ctx), grad_y, grad_h_last)

    return SplitScan


def chunk_scan_class(
    block_d: int, chunk_t: int, warps: int, stages: int, backward: tuple[int, int, int] | None = None,
    save: bool = True,
) -> type[torch.autograd.Function]:
    """The chunk-tile forward (time in each thread's registers, the state's n over a few threads);
    the kernel's own backward, fed chunk-start states rebuilt at its chunk length (16) from ours
    when they differ (a transpose; timed with the backward)."""

    class ChunkScan(scan_module._SelectiveScan):
        @staticmethod
        def forward(ctx, x, delta, A, B, C, D, h0):
            batch, seq_len, channels = x.shape
            groups, state_size = B.shape[2], B.shape[3]
            per_group = channels // groups
            n_pad = triton.next_power_of_2(state_size)
            chunks = triton.cdiv(seq_len, chunk_t)
            x, delta, B, C = (t.contiguous() for t in (x, delta, B, C))
            A_T = A.t().contiguous()  # (N, Dm)
            D = D.contiguous() if D is not None else None
            h0_T = h0.float().transpose(1, 2).contiguous() if h0 is not None else None  # (Bt, N, Dm)
            y = new_buffer(x.shape, x.dtype, x.device)
            h_last_T = new_buffer((batch, state_size, channels), torch.float32, x.device)
            chunk_start_T = new_buffer((batch, chunks, state_size, channels), torch.float32, x.device)
            even = seq_len % chunk_t == 0 and per_group % block_d == 0 and n_pad == state_size
            _forward_chunks[(batch, groups, triton.cdiv(per_group, block_d))](
                x, delta, A_T, B, C, D if D is not None else x, h0_T if h0 is not None else h_last_T,
                y, h_last_T, chunk_start_T, seq_len, chunks, LOG2_E,
                channels=channels, groups=groups, state_size=state_size,
                HAS_D=D is not None, HAS_H0=h0 is not None,
                BLOCK_D=block_d, N_PAD=n_pad, CHUNK_T=chunk_t, STAGES=stages, EVEN=even, SAVE=save,
                num_warps=warps,
            )
            ctx.save_for_backward(x, delta, A, B, C, D, chunk_start_T)
            ctx.has_h0 = h0 is not None
            ctx.set_materialize_grads(False)
            return y, h_last_T.transpose(1, 2).contiguous()

        @staticmethod
        def backward(ctx, grad_y, grad_h_last):
            if backward is not None:
                return chunk_backward(ctx, grad_y, grad_h_last, chunk_t, *backward)
            *inputs, chunk_start_T = ctx.saved_tensors
            if chunk_t != scan_module._CHUNK_T:  # keep every (16 / chunk_t)-th chunk start
                chunk_start_T = chunk_start_T[:, :: scan_module._CHUNK_T // chunk_t]
            ctx.saved_tensors_override = (*inputs, chunk_start_T.transpose(2, 3).contiguous())
            return scan_module._SelectiveScan.backward(_Saved(ctx), grad_y, grad_h_last)

    return ChunkScan


def chunk_backward(ctx, grad_y, grad_h_last, chunk_t: int, block_d: int, warps: int, stages: int):
    """The chunk-tile backward on the chunk-start states the chunk-tile forward saved."""
    x, delta, A, B, C, D, chunk_start_T = ctx.saved_tensors
    batch, seq_len, channels = x.shape
    groups, state_size = B.shape[2], B.shape[3]
    per_group, chunks, n_pad = channels // groups, chunk_start_T.shape[1], triton.next_power_of_2(state_size)
    blocks = triton.cdiv(per_group, block_d)
    grad_y = grad_y.contiguous() if grad_y is not None else torch.zeros_like(x)
    grad_x = new_buffer(x.shape, x.dtype, x.device)
    grad_delta = new_buffer(delta.shape, delta.dtype, delta.device)
    grad_A_T = new_buffer((batch, state_size, channels), torch.float32, x.device)
    grad_B = new_buffer((blocks, *B.shape), torch.float32, x.device)
    grad_C = new_buffer((blocks, *C.shape), torch.float32, x.device)
    grad_D = new_buffer((batch, channels), torch.float32, x.device)
    grad_h0_T = new_buffer((batch, state_size, channels), torch.float32, x.device)
    grad_h_last_T = grad_h_last.transpose(1, 2).contiguous() if grad_h_last is not None else None
    even = seq_len % chunk_t == 0 and per_group % block_d == 0 and n_pad == state_size
    _backward_chunks[(batch, groups, blocks)](
        x, delta, A.t().contiguous(), B, C, D if D is not None else x, chunk_start_T, grad_y,
        grad_h_last_T if grad_h_last_T is not None else x,
        grad_x, grad_delta, grad_A_T, grad_B, grad_C, grad_D, grad_h0_T,
        batch, seq_len, chunks, LOG2_E, channels=channels, groups=groups, state_size=state_size,
        HAS_D=D is not None, HAS_GRAD_H_LAST=grad_h_last is not None,
        BLOCK_D=block_d, N_PAD=n_pad, CHUNK_T=chunk_t, STAGES=stages, EVEN=even, num_warps=warps,
    )
    return (
        grad_x,
        grad_delta,
        grad_A_T.sum(0).t().to(A.dtype),
        grad_B.sum(0).to(B.dtype),
        grad_C.sum(0).to(C.dtype),
        grad_D.sum(0).to(D.dtype) if D is not None else None,
        grad_h0_T.transpose(1, 2).contiguous() if ctx.has_h0 else None,
    )


class _Saved:
    """A ctx stand-in whose saved_tensors are the override (the transposed chunk-start states)."""

    def __init__(self, ctx) -> None:
        self.saved_tensors = ctx.saved_tensors_override
        self.has_h0 = ctx.has_h0


def case(batch: int, steps: int, channels: int, state: int, device: str, seed: int) -> list[torch.Tensor]:
    """x, delta, A, B, C, D, h0 as PSSA draws them (delta > 0, A < 0), one group."""
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device)

    return [draw(batch, steps, channels), torch.nn.functional.softplus(draw(batch, steps, channels)),
            -torch.exp(draw(channels, state) * 0.5), draw(batch, steps, 1, state), draw(batch, steps, 1, state),
            draw(channels), draw(batch, channels, state)]


def outputs_and_grads(apply, inputs: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.Tensor]:
    leaves = [t.clone().requires_grad_() if t is not None else None for t in inputs]
    y, h_last = apply(*leaves)
    torch.autograd.backward([y, h_last], grads)
    return [y.detach(), h_last.detach()] + [leaf.grad for leaf in leaves if leaf is not None]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run the variants whose label contains this")
    only = parser.parse_args().only
    device = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
    # (label, autograd class): the step loops of session 3, then the split forward of session 4
    # (channels per program, threads per channel, warps, stages, steps per iteration, every how
    # many steps the exponential runs on the FMA pipe; 1000 = never).
    variants = [(f"steps block {b} warps {w} stages {st}, {'step' if sb else 'kernel'} backward",
                 step_scan_class(b, w, st, sb))
                for b, w, st, sb in [(8, 1, 4, True)]]
    variants += [(f"split block {b} x{sp} warps {w} stages {st} unroll {u} fma-exp every {pe}",
                  split_scan_class(b, sp, w, st, u, pe))
                 for b, sp, w, st, u, pe in [(8, 4, 1, 3, 8, 1000)]]
    # (channels per program, steps per chunk, warps, stages)
    variants += [(f"chunks block {b} chunk {c} warps {w} stages {st}", chunk_scan_class(b, c, w, st))
                 for b, c, w, st in [(8, 8, 1, 4), (8, 8, 1, 6), (8, 16, 1, 4), (8, 16, 1, 5), (16, 8, 1, 3),
                                     (16, 8, 1, 4), (16, 8, 1, 5), (16, 16, 1, 3), (16, 16, 1, 4), (32, 8, 1, 4)]]
    # the same without saving chunk starts (what a forward under no_grad needs): the cost of saving
    variants += [(f"chunks block {b} chunk {c} warps 1 stages {st} no save", chunk_scan_class(b, c, 1, st, save=False))
                 for b, c, st in [(16, 8, 4), (16, 16, 4)]]
    # (forward: channels, chunk, stages; backward: channels, warps, stages)
    variants += [(f"chunks block {b} chunk {c} stages {st}, chunk backward block {bb} warps {bw} stages {bst}",
                  chunk_scan_class(b, c, 1, st, (bb, bw, bst)))
                 for b, c, st, bb, bw, bst in [(16, 8, 3, 16, 1, 2), (16, 8, 3, 16, 1, 3), (16, 8, 3, 8, 1, 3),
                                               (16, 8, 3, 32, 1, 2), (16, 8, 3, 32, 2, 2), (8, 16, 3, 8, 1, 2),
                                               (8, 16, 3, 16, 1, 2)]]
    variants = [(label, scan) for label, scan in variants if only in label]
    checked = []
    for steps, channels in [(37, 48), (32, 64)]:  # ragged (masked path), then even (unmasked path)
        check = case(2, steps, channels, 16, device, seed=1)
        check_grads = [torch.randn_like(check[0]), torch.randn_like(check[6])]
        want = outputs_and_grads(lambda *a: scan_module.selective_scan(*a, use_triton=True), check, check_grads)
        for label, scan in variants:
            try:
                got = outputs_and_grads(scan.apply, check, check_grads)
                error = max(relative_error(a, b) for a, b in zip(got, want))
                print(json.dumps({"variant": label, "T": steps, "Dm": channels, "check_rel_err": error}), flush=True)
                if error < 1e-5 and steps == 32:
                    checked.append((label, scan))
            except Exception as failure:  # noqa: BLE001 - report and go on with the others
                print(json.dumps({"variant": label, "error": str(failure)[:300]}), flush=True)
    if device == "cpu":
        return 0
    spec = importlib.util.spec_from_file_location("bench_kernels", Path(__file__).with_name("kernels.py"))
    bench_kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_kernels)
    copy_gbs = bench_kernels.copy_bandwidth()
    for batch, steps in [(8, 4096), (1, 32768)]:
        time_size(batch, steps, checked, bench_kernels.time_ms, copy_gbs)
    return 0


def time_size(batch: int, steps: int, variants: list, time_ms, copy_gbs: float) -> None:
    inputs = case(batch, steps, 1024, 16, "cuda", seed=2)[:6] + [None]  # no h0, as in training
    grads = [torch.randn_like(inputs[0]), torch.zeros(batch, 1024, 16, device="cuda")]
    io = batch * steps * (3 * 1024 + 32) * 4  # x, delta in, y out, B and C in (fp32)
    size = f"Bt {batch} T {steps} Dm 1024 N 16 fp32"

    def timings(apply) -> tuple[float, float]:
        with torch.no_grad():
            forward = time_ms(lambda: apply(*inputs))
        both = time_ms(lambda: outputs_and_grads(apply, inputs, grads))
        return forward, both

    base_forward, base_both = timings(lambda *a: scan_module.selective_scan(*a, use_triton=True))
    print(json.dumps({"size": size, "impl": "kernels.selective_scan", "fwd_ms": round(base_forward, 4),
                      "fwd_of_copy": round(io / base_forward / 1e6 / copy_gbs, 3),
                      "fwd_bwd_ms": round(base_both, 4)}), flush=True)
    for label, scan in variants:
        try:
            forward, both = timings(scan.apply)
        except Exception as failure:  # noqa: BLE001 - report and go on with the others
            print(json.dumps({"size": size, "impl": label, "error": str(failure)[:300]}), flush=True)
            continue
        print(json.dumps({"size": size, "impl": label,
                          "fwd_ms": round(forward, 4), "fwd_of_copy": round(io / forward / 1e6 / copy_gbs, 3),
                          "fwd_bwd_ms": round(both, 4), "speedup_fwd": round(base_forward / forward, 2),
                          "speedup_fwd_bwd": round(base_both / both, 2)}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
