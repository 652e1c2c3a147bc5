"""An experiment: more PLIF time steps in flight per thread, by unrolling the step loop.

kernels/plif.py walks time one step per loop iteration, one channel a thread, with
`tl.range(..., num_stages=12)` keeping the loads of the next steps in flight. On the H200 that
reaches 53-58 % of copy bandwidth forward (Bt 8, T 4096, D 2560, fp32) and 45-49 % forward +
backward, against a goal of 70 %. The suspicion: 20480 channels are 640 one-warp programs on 132
SMs (under 5 warps an SM), too few bytes in flight. The variants here put U steps into one loop
iteration (`for t0 in tl.range(0, T, U, num_stages=S)` around `tl.static_range(U)`), so that
U x (S - 1) steps' loads are in flight per thread (the kernel: 11), forward and backward:

- unrolled: the U steps one after the other, each loading its inputs just before its compute;
- loads first: all the U steps' loads written first (x_0..x_{U-1}, and in the backward every
  input of every step), then the U steps' dependent compute (U is 2, 4 or 8, written out).

Steps past the end of a ragged T are masked out of the loads and stores and leave the carried
state unchanged. Each variant is checked against kernels.plif.plif_scan(..., use_triton=True) on
odd sizes (spikes, v_pre, v_last and the gradients of x, beta, v_th and v0; kept under a 1e-5
relative error), then timed against it at Bt 8 x T 4096 and Bt 1 x T 32768, D 2560, fp32,
forward (no_grad) and forward + backward (gradients into spikes and v_pre, no v0, as in
training). A JSON row per variant and size.

    python bench/plif_variants.py [--only 0,3,7]     (CUDA; under TRITON_INTERPRET=1 it only checks, on a CPU)

Not yet run on a GPU (checked under the CPU interpreter only; the kernels were compiled to sm_90
cubins offline with Triton 3.9's own ptxas, without a GPU, but never launched on one).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels._dispatch import new_buffer  # noqa: E402

# The module (its private kernel settings and autograd Function), by its full name.
plif_module = importlib.import_module("kernels.plif")

ALPHA = 4.0
CHANNELS = 2560


# ---------------------------------------------------------------------------------------------
# One step of each direction, shared by both loop shapes. t may lie past the sequence (forward:
# t >= seq_len; backward: t < 0): then nothing is loaded or stored and the state is returned as is.


@triton.jit
def _forward_load(x_ptr, base, t, seq_len, channels, channel):
    live = channel < tl.where(t < seq_len, channels, 0)
    return tl.load(x_ptr + base + t * channels, mask=live, other=0.0).to(tl.float32)


@triton.jit
def _forward_step(
    x_t, v, beta, threshold, base, t, seq_len, channels, channel,
    spikes_ptr, v_pre_ptr, v_pre_f32_ptr, SAVE_F32: tl.constexpr,
):
    live = channel < tl.where(t < seq_len, channels, 0)
    offsets = base + t * channels
    v_pre = beta * v + (1.0 - beta) * x_t
    spike = (v_pre - threshold > 0).to(tl.float32)
    tl.store(spikes_ptr + offsets, spike.to(spikes_ptr.dtype.element_ty), mask=live)
    tl.store(v_pre_ptr + offsets, v_pre.to(v_pre_ptr.dtype.element_ty), mask=live)
    if SAVE_F32:
        tl.store(v_pre_f32_ptr + offsets, v_pre, mask=live)
    return tl.where(t < seq_len, v_pre - threshold * spike, v)


@triton.jit
def _backward_load(
    x_ptr, grad_spikes_ptr, grad_v_pre_ptr, v_pre_ptr, base, t, channels, channel,
    HAS_GRAD_SPIKES: tl.constexpr, HAS_GRAD_V_PRE: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Step t's x, outer gradients and the step before's v_pre (t runs from seq_len - 1 down)."""
    live = channel < tl.where(t >= 0, channels, 0)
    offsets = base + t * channels
    x_t = tl.load(x_ptr + offsets, mask=live, other=0.0).to(tl.float32)
    outer_spike = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_GRAD_SPIKES:
        outer_spike = tl.load(grad_spikes_ptr + offsets, mask=live, other=0.0).to(tl.float32)
    outer_v_pre = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_GRAD_V_PRE:
        outer_v_pre = tl.load(grad_v_pre_ptr + offsets, mask=live, other=0.0).to(tl.float32)
    has_before = channel < tl.where(t > 0, channels, 0)
    v_pre_before = tl.load(v_pre_ptr + offsets - channels, mask=has_before, other=0.0)
    return x_t, outer_spike, outer_v_pre, v_pre_before


@triton.jit
def _backward_step(
    x_t, outer_spike, outer_v_pre, v_pre_before, v_pre, grad_v, grad_beta, grad_threshold,
    beta, threshold, v_initial, alpha, grad_x_ptr, base, t, channels, channel,
):
    """kernels.plif's backward step: v_pre is step t's (carried), v_pre_before step t - 1's."""
    live = channel < tl.where(t >= 0, channels, 0)
    v_before = v_pre_before - threshold * (v_pre_before - threshold > 0).to(tl.float32)
    v_before = tl.where(t > 0, v_before, v_initial)
    above = v_pre - threshold
    spike = (above > 0).to(tl.float32)
    sig = tl.sigmoid(alpha * above)
    surrogate = alpha * sig * (1.0 - sig)
    grad_spike = outer_spike - threshold * grad_v
    grad_v_pre = outer_v_pre + grad_v + grad_spike * surrogate
    grad_threshold += tl.where(t >= 0, -grad_v * spike - grad_spike * surrogate, 0.0)
    grad_beta += tl.where(t >= 0, grad_v_pre * (v_before - x_t), 0.0)
    grad_x = grad_v_pre * (1.0 - beta)
    tl.store(grad_x_ptr + base + t * channels, grad_x.to(grad_x_ptr.dtype.element_ty), mask=live)
    grad_v = tl.where(t >= 0, grad_v_pre * beta, grad_v)
    return grad_v, grad_beta, grad_threshold


# ---------------------------------------------------------------------------------------------
# Forward kernels: kernels.plif._plif_forward_kernel's arguments plus UNROLL.


@triton.jit
def _forward_unrolled(
    x_ptr, beta_ptr, threshold_ptr, v0_ptr, spikes_ptr, v_pre_ptr, v_pre_f32_ptr, v_last_ptr,
    seq_len, channels,
    HAS_V0: tl.constexpr, SAVE_F32: tl.constexpr, BLOCK_D: tl.constexpr, UNROLL: tl.constexpr,
    STAGES: tl.constexpr,
):
    batch = tl.program_id(0)
    channel = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    channel_ok = channel < channels
    beta = tl.load(beta_ptr + channel, mask=channel_ok, other=0.5).to(tl.float32)
    threshold = tl.load(threshold_ptr + channel, mask=channel_ok, other=1.0).to(tl.float32)
    if HAS_V0:
        v = tl.load(v0_ptr + batch * channels + channel, mask=channel_ok, other=0.0).to(tl.float32)
    else:
        v = tl.zeros([BLOCK_D], dtype=tl.float32)
    base = batch.to(tl.int64) * seq_len * channels + channel
    for t0 in tl.range(0, seq_len, UNROLL, num_stages=STAGES):
        for i in tl.static_range(UNROLL):
            x_t = _forward_load(x_ptr, base, t0 + i, seq_len, channels, channel)
            v = _forward_step(x_t, v, beta, threshold, base, t0 + i, seq_len, channels, channel,
                              spikes_ptr, v_pre_ptr, v_pre_f32_ptr, SAVE_F32)
    tl.store(v_last_ptr + batch * channels + channel, v, mask=channel_ok)


@triton.jit
def _forward_loads_first(
    x_ptr, beta_ptr, threshold_ptr, v0_ptr, spikes_ptr, v_pre_ptr, v_pre_f32_ptr, v_last_ptr,
    seq_len, channels,
    HAS_V0: tl.constexpr, SAVE_F32: tl.constexpr, BLOCK_D: tl.constexpr, UNROLL: tl.constexpr,
    STAGES: tl.constexpr,
):
    """UNROLL 2, 4 or 8: the iteration's x loads written out first, then its steps."""
    batch = tl.program_id(0)
    channel = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    channel_ok = channel < channels
    beta = tl.load(beta_ptr + channel, mask=channel_ok, other=0.5).to(tl.float32)
    threshold = tl.load(threshold_ptr + channel, mask=channel_ok, other=1.0).to(tl.float32)
    if HAS_V0:
        v = tl.load(v0_ptr + batch * channels + channel, mask=channel_ok, other=0.0).to(tl.float32)
    else:
        v = tl.zeros([BLOCK_D], dtype=tl.float32)
    base = batch.to(tl.int64) * seq_len * channels + channel
    for t0 in tl.range(0, seq_len, UNROLL, num_stages=STAGES):
        x0 = _forward_load(x_ptr, base, t0, seq_len, channels, channel)
        x1 = _forward_load(x_ptr, base, t0 + 1, seq_len, channels, channel)
        if UNROLL >= 4:
            x2 = _forward_load(x_ptr, base, t0 + 2, seq_len, channels, channel)
            x3 = _forward_load(x_ptr, base, t0 + 3, seq_len, channels, channel)
        if UNROLL >= 8:
            x4 = _forward_load(x_ptr, base, t0 + 4, seq_len, channels, channel)
            x5 = _forward_load(x_ptr, base, t0 + 5, seq_len, channels, channel)
            x6 = _forward_load(x_ptr, base, t0 + 6, seq_len, channels, channel)
            x7 = _forward_load(x_ptr, base, t0 + 7, seq_len, channels, channel)
        v = _forward_step(x0, v, beta, threshold, base, t0, seq_len, channels, channel,
                          spikes_ptr, v_pre_ptr, v_pre_f32_ptr, SAVE_F32)
        v = _forward_step(x1, v, beta, threshold, base, t0 + 1, seq_len, channels, channel,
                          spikes_ptr, v_pre_ptr, v_pre_f32_ptr, SAVE_F32)
        if UNROLL >= 4:
            v = _forward_step(x2, v, beta, threshold, base, t0 + 2, seq_len, channels, channel,
                              spikes_ptr, v_pre_ptr, v_pre_f32_ptr, SAVE_F32)
            v = _forward_step(x3, v, beta, threshold, base, t0 + 3, seq_len, channels, channel,
                              spikes_ptr, v_pre_ptr, v_pre_f32_ptr, SAVE_F32)
        if UNROLL >= 8:
            v = _forward_step(x4, v, beta, threshold, base, t0 + 4, seq_len, channels, channel,
                              spikes_ptr, v_pre_ptr, v_pre_f32_ptr, SAVE_F32)
            v = _forward_step(x5, v, beta, threshold, base, t0 + 5, seq_len, channels, channel,
                              spikes_ptr, v_pre_ptr, v_pre_f32_ptr, SAVE_F32)
            v = _forward_step(x6, v, beta, threshold, base, t0 + 6, seq_len, channels, channel,
                              spikes_ptr, v_pre_ptr, v_pre_f32_ptr, SAVE_F32)
            v = _forward_step(x7, v, beta, threshold, base, t0 + 7, seq_len, channels, channel,
                              spikes_ptr, v_pre_ptr, v_pre_f32_ptr, SAVE_F32)
    tl.store(v_last_ptr + batch * channels + channel, v, mask=channel_ok)


# ---------------------------------------------------------------------------------------------
# Backward kernels: kernels.plif._plif_backward_kernel's arguments plus UNROLL. Time runs in
# reverse, t = seq_len - 1 - back; a ragged last iteration has t < 0 (masked, state kept).


@triton.jit
def _backward_unrolled(
    x_ptr, beta_ptr, threshold_ptr, v0_ptr, v_pre_ptr,
    grad_spikes_ptr, grad_v_pre_ptr, grad_v_last_ptr,
    grad_x_ptr, grad_beta_ptr, grad_threshold_ptr, grad_v0_ptr,
    seq_len, channels, alpha,
    HAS_V0: tl.constexpr, HAS_GRAD_SPIKES: tl.constexpr, HAS_GRAD_V_PRE: tl.constexpr,
    HAS_GRAD_V_LAST: tl.constexpr, BLOCK_D: tl.constexpr, UNROLL: tl.constexpr, STAGES: tl.constexpr,
):
    batch = tl.program_id(0)
    channel = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    channel_ok = channel < channels
    state_offsets = batch * channels + channel
    beta = tl.load(beta_ptr + channel, mask=channel_ok, other=0.5).to(tl.float32)
    threshold = tl.load(threshold_ptr + channel, mask=channel_ok, other=1.0).to(tl.float32)
    if HAS_V0:
        v_initial = tl.load(v0_ptr + state_offsets, mask=channel_ok, other=0.0).to(tl.float32)
    else:
        v_initial = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_GRAD_V_LAST:
        grad_v = tl.load(grad_v_last_ptr + state_offsets, mask=channel_ok, other=0.0).to(tl.float32)
    else:
        grad_v = tl.zeros([BLOCK_D], dtype=tl.float32)
    grad_beta = tl.zeros([BLOCK_D], dtype=tl.float32)
    grad_threshold = tl.zeros([BLOCK_D], dtype=tl.float32)
    base = batch.to(tl.int64) * seq_len * channels + channel
    has_last = channel < tl.where(seq_len > 0, channels, 0)
    v_pre = tl.load(v_pre_ptr + base + (seq_len - 1) * channels, mask=has_last, other=0.0)
    for back0 in tl.range(0, seq_len, UNROLL, num_stages=STAGES):
        for i in tl.static_range(UNROLL):
            t = seq_len - 1 - (back0 + i)
            x_t, outer_spike, outer_v_pre, v_pre_before = _backward_load(
                x_ptr, grad_spikes_ptr, grad_v_pre_ptr, v_pre_ptr, base, t, channels, channel,
                HAS_GRAD_SPIKES, HAS_GRAD_V_PRE, BLOCK_D)
            grad_v, grad_beta, grad_threshold = _backward_step(
                x_t, outer_spike, outer_v_pre, v_pre_before, v_pre, grad_v, grad_beta, grad_threshold,
                beta, threshold, v_initial, alpha, grad_x_ptr, base, t, channels, channel)
            v_pre = v_pre_before
    tl.store(grad_v0_ptr + state_offsets, grad_v, mask=channel_ok)
    tl.store(grad_beta_ptr + state_offsets, grad_beta, mask=channel_ok)
    tl.store(grad_threshold_ptr + state_offsets, grad_threshold, mask=channel_ok)


@triton.jit
def _backward_loads_first(
    x_ptr, beta_ptr, threshold_ptr, v0_ptr, v_pre_ptr,
    grad_spikes_ptr, grad_v_pre_ptr, grad_v_last_ptr,
    grad_x_ptr, grad_beta_ptr, grad_threshold_ptr, grad_v0_ptr,
    seq_len, channels, alpha,
    HAS_V0: tl.constexpr, HAS_GRAD_SPIKES: tl.constexpr, HAS_GRAD_V_PRE: tl.constexpr,
    HAS_GRAD_V_LAST: tl.constexpr, BLOCK_D: tl.constexpr, UNROLL: tl.constexpr, STAGES: tl.constexpr,
):
    """UNROLL 2, 4 or 8: every load of the iteration's steps first (x, the outer gradients and the
    step before's v_pre), then the steps; step j's v_pre is step j - 1's loaded v_pre_before."""
    batch = tl.program_id(0)
    channel = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    channel_ok = channel < channels
    state_offsets = batch * channels + channel
    beta = tl.load(beta_ptr + channel, mask=channel_ok, other=0.5).to(tl.float32)
    threshold = tl.load(threshold_ptr + channel, mask=channel_ok, other=1.0).to(tl.float32)
    if HAS_V0:
        v_initial = tl.load(v0_ptr + state_offsets, mask=channel_ok, other=0.0).to(tl.float32)
    else:
        v_initial = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_GRAD_V_LAST:
        grad_v = tl.load(grad_v_last_ptr + state_offsets, mask=channel_ok, other=0.0).to(tl.float32)
    else:
        grad_v = tl.zeros([BLOCK_D], dtype=tl.float32)
    grad_beta = tl.zeros([BLOCK_D], dtype=tl.float32)
    grad_threshold = tl.zeros([BLOCK_D], dtype=tl.float32)
    base = batch.to(tl.int64) * seq_len * channels + channel
    has_last = channel < tl.where(seq_len > 0, channels, 0)
    v_pre = tl.load(v_pre_ptr + base + (seq_len - 1) * channels, mask=has_last, other=0.0)
    for back0 in tl.range(0, seq_len, UNROLL, num_stages=STAGES):
        t = seq_len - 1 - back0  # this iteration's steps: t, t - 1, ..., t - UNROLL + 1
        x0, s0, p0, b0 = _backward_load(x_ptr, grad_spikes_ptr, grad_v_pre_ptr, v_pre_ptr, base, t,
                                        channels, channel, HAS_GRAD_SPIKES, HAS_GRAD_V_PRE, BLOCK_D)
        x1, s1, p1, b1 = _backward_load(x_ptr, grad_spikes_ptr, grad_v_pre_ptr, v_pre_ptr, base, t - 1,
                                        channels, channel, HAS_GRAD_SPIKES, HAS_GRAD_V_PRE, BLOCK_D)
        if UNROLL >= 4:
            x2, s2, p2, b2 = _backward_load(x_ptr, grad_spikes_ptr, grad_v_pre_ptr, v_pre_ptr, base, t - 2,
                                            channels, channel, HAS_GRAD_SPIKES, HAS_GRAD_V_PRE, BLOCK_D)
            x3, s3, p3, b3 = _backward_load(x_ptr, grad_spikes_ptr, grad_v_pre_ptr, v_pre_ptr, base, t - 3,
                                            channels, channel, HAS_GRAD_SPIKES, HAS_GRAD_V_PRE, BLOCK_D)
        if UNROLL >= 8:
            x4, s4, p4, b4 = _backward_load(x_ptr, grad_spikes_ptr, grad_v_pre_ptr, v_pre_ptr, base, t - 4,
                                            channels, channel, HAS_GRAD_SPIKES, HAS_GRAD_V_PRE, BLOCK_D)
            x5, s5, p5, b5 = _backward_load(x_ptr, grad_spikes_ptr, grad_v_pre_ptr, v_pre_ptr, base, t - 5,
                                            channels, channel, HAS_GRAD_SPIKES, HAS_GRAD_V_PRE, BLOCK_D)
            x6, s6, p6, b6 = _backward_load(x_ptr, grad_spikes_ptr, grad_v_pre_ptr, v_pre_ptr, base, t - 6,
                                            channels, channel, HAS_GRAD_SPIKES, HAS_GRAD_V_PRE, BLOCK_D)
            x7, s7, p7, b7 = _backward_load(x_ptr, grad_spikes_ptr, grad_v_pre_ptr, v_pre_ptr, base, t - 7,
                                            channels, channel, HAS_GRAD_SPIKES, HAS_GRAD_V_PRE, BLOCK_D)
        grad_v, grad_beta, grad_threshold = _backward_step(
            x0, s0, p0, b0, v_pre, grad_v, grad_beta, grad_threshold,
            beta, threshold, v_initial, alpha, grad_x_ptr, base, t, channels, channel)
        grad_v, grad_beta, grad_threshold = _backward_step(
            x1, s1, p1, b1, b0, grad_v, grad_beta, grad_threshold,
            beta, threshold, v_initial, alpha, grad_x_ptr, base, t - 1, channels, channel)
        v_pre = b1
        if UNROLL >= 4:
            grad_v, grad_beta, grad_threshold = _backward_step(
                x2, s2, p2, b2, b1, grad_v, grad_beta, grad_threshold,
                beta, threshold, v_initial, alpha, grad_x_ptr, base, t - 2, channels, channel)
            grad_v, grad_beta, grad_threshold = _backward_step(
                x3, s3, p3, b3, b2, grad_v, grad_beta, grad_threshold,
                beta, threshold, v_initial, alpha, grad_x_ptr, base, t - 3, channels, channel)
            v_pre = b3
        if UNROLL >= 8:
            grad_v, grad_beta, grad_threshold = _backward_step(
                x4, s4, p4, b4, b3, grad_v, grad_beta, grad_threshold,
                beta, threshold, v_initial, alpha, grad_x_ptr, base, t - 4, channels, channel)
            grad_v, grad_beta, grad_threshold = _backward_step(
                x5, s5, p5, b5, b4, grad_v, grad_beta, grad_threshold,
                beta, threshold, v_initial, alpha, grad_x_ptr, base, t - 5, channels, channel)
            grad_v, grad_beta, grad_threshold = _backward_step(
                x6, s6, p6, b6, b5, grad_v, grad_beta, grad_threshold,
                beta, threshold, v_initial, alpha, grad_x_ptr, base, t - 6, channels, channel)
            grad_v, grad_beta, grad_threshold = _backward_step(
                x7, s7, p7, b7, b6, grad_v, grad_beta, grad_threshold,
                beta, threshold, v_initial, alpha, grad_x_ptr, base, t - 7, channels, channel)
            v_pre = b7
    tl.store(grad_v0_ptr + state_offsets, grad_v, mask=channel_ok)
    tl.store(grad_beta_ptr + state_offsets, grad_beta, mask=channel_ok)
    tl.store(grad_threshold_ptr + state_offsets, grad_threshold, mask=channel_ok)


# ---------------------------------------------------------------------------------------------


class Variant(NamedTuple):
    block: int | None  # channels per program; None: kernels.plif's choice (64 at Bt 8, 32 at Bt 1)
    warps: int
    unroll: int
    stages: int
    loads_first: bool = False

    def label(self) -> str:
        block = "auto" if self.block is None else str(self.block)
        order = ", loads first" if self.loads_first else ""
        return f"block {block} warps {self.warps} unroll {self.unroll} stages {self.stages}{order}"


# The first is kernels.plif's own settings through this script's code (its time should match the
# kernel's). U x S is about the steps in flight per thread (the kernel: 1 x 12).
VARIANTS = [
    Variant(None, 1, 1, 12),
    Variant(None, 1, 2, 6),
    Variant(None, 1, 2, 12),
    Variant(None, 1, 4, 4),
    Variant(None, 1, 4, 8),
    Variant(None, 1, 8, 2),
    Variant(None, 1, 8, 4),
    Variant(32, 1, 4, 8),
    Variant(64, 1, 4, 8),
    Variant(64, 2, 4, 4),  # one channel a thread, two warps a program
    Variant(64, 2, 4, 8),
    Variant(128, 2, 4, 4),
    Variant(None, 1, 4, 4, loads_first=True),
    Variant(None, 1, 4, 8, loads_first=True),
    Variant(None, 1, 8, 4, loads_first=True),
    Variant(64, 2, 4, 8, loads_first=True),
]


def variant_class(variant: Variant) -> type[torch.autograd.Function]:
    """kernels.plif._PlifScan with this variant's forward and backward kernels and launch."""
    if variant.loads_first and variant.unroll not in (2, 4, 8):
        raise ValueError("loads first is written out for unroll 2, 4 and 8 only")
    forward_kernel = _forward_loads_first if variant.loads_first else _forward_unrolled
    backward_kernel = _backward_loads_first if variant.loads_first else _backward_unrolled

    def block_for(batch: int, channels: int) -> int:
        return variant.block or plif_module._channels_per_program(batch, channels)

    class PlifVariant(plif_module._PlifScan):
        @staticmethod
        def forward(ctx, x, beta, v_th, v0, alpha):
            batch, seq_len, channels = x.shape
            x = x.contiguous()
            spikes = new_buffer(x.shape, x.dtype, x.device)
            v_pre = new_buffer(x.shape, x.dtype, x.device)
            save_f32 = x.dtype != torch.float32
            v_pre_f32 = new_buffer(x.shape, torch.float32, x.device) if save_f32 else v_pre
            v_last = new_buffer((batch, channels), torch.float32, x.device)
            v0_arg = v0.contiguous() if v0 is not None else v_last
            block = block_for(batch, channels)
            forward_kernel[(batch, triton.cdiv(channels, block))](
                x, beta.contiguous(), v_th.contiguous(), v0_arg, spikes, v_pre, v_pre_f32, v_last,
                seq_len, channels,
                HAS_V0=v0 is not None, SAVE_F32=save_f32, BLOCK_D=block, UNROLL=variant.unroll,
                STAGES=variant.stages, num_warps=variant.warps,
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

            block = block_for(batch, channels)
            backward_kernel[(batch, triton.cdiv(channels, block))](
                x, beta.contiguous(), v_th.contiguous(), v0.contiguous() if v0 is not None else x, v_pre_f32,
                pointer(grad_spikes), pointer(grad_v_pre), pointer(grad_v_last),
                grad_x, grad_beta, grad_threshold, grad_v0,
                seq_len, channels, float(ctx.alpha),
                HAS_V0=v0 is not None, HAS_GRAD_SPIKES=grad_spikes is not None,
                HAS_GRAD_V_PRE=grad_v_pre is not None, HAS_GRAD_V_LAST=grad_v_last is not None,
                BLOCK_D=block, UNROLL=variant.unroll, STAGES=variant.stages, num_warps=variant.warps,
            )
            return (
                grad_x,
                grad_beta.sum(0).to(beta.dtype),
                grad_threshold.sum(0).to(v_th.dtype),
                grad_v0.to(v0.dtype) if v0 is not None else None,
                None,
            )

    return PlifVariant


def kernel_in_use(x: torch.Tensor, beta: torch.Tensor, v_th: torch.Tensor, v0: torch.Tensor | None,
                  alpha: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return plif_module.plif_scan(x, beta, v_th, v0, alpha, use_triton=True)


def case(batch: int, steps: int, channels: int, device: str, seed: int) -> dict[str, torch.Tensor]:
    """x, beta in (0.1, 0.9), v_th in (0.5, 1.5) and v0, as bench/kernels.py's PLIF rows draw them."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(batch, steps, channels, generator=generator).to(device),
        "beta": (torch.rand(channels, generator=generator) * 0.8 + 0.1).to(device),
        "v_th": (torch.rand(channels, generator=generator) + 0.5).to(device),
        "v0": (torch.rand(batch, channels, generator=generator) * 0.5).to(device),
    }


def outputs_and_grads(apply: Callable, inputs: dict[str, torch.Tensor], with_v0: bool,
                      grads: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """spikes, v_pre, v_last, then the gradients of x, beta, v_th (and v0) for these output gradients
    (None: that output is left out of the backward, so its gradient reaches the kernel as None)."""
    names = ["x", "beta", "v_th"] + (["v0"] if with_v0 else [])
    leaves = {name: inputs[name].clone().requires_grad_() for name in names}
    outputs = apply(leaves["x"], leaves["beta"], leaves["v_th"], leaves.get("v0"), ALPHA)
    used = [(out, grad) for out, grad in zip(outputs, grads) if grad is not None]
    torch.autograd.backward([out for out, _ in used], [grad for _, grad in used])
    return [out.detach() for out in outputs] + [leaves[name].grad for name in names]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def check(variant: Variant, device: str) -> float:
    """Max relative error against the kernel in use over two odd cases: v0 and every output's
    gradient (T 37: ragged for unroll 2, 4, 8); no v0 and gradients into spikes and v_pre only, as
    in training (T 5 < unroll 8, D 70 over three blocks of 32)."""
    cases = [(case(2, 37, 48, device, seed=1), True, (1, 1, 1)),
             (case(3, 5, 70, device, seed=2), False, (1, 1, 0))]
    error = 0.0
    for inputs, with_v0, used in cases:
        x = inputs["x"]
        generator = torch.Generator().manual_seed(3)
        grads = [torch.randn(x.shape, generator=generator).to(device) if used[0] else None,
                 torch.randn(x.shape, generator=generator).to(device) if used[1] else None,
                 torch.randn(x.shape[0], x.shape[2], generator=generator).to(device) if used[2] else None]
        want = outputs_and_grads(kernel_in_use, inputs, with_v0, grads)
        got = outputs_and_grads(variant_class(variant).apply, inputs, with_v0, grads)
        error = max([error] + [relative_error(a, b) for a, b in zip(got, want)])
    return error


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated indices into VARIANTS (default: all)")
    args = parser.parse_args()
    device = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
    indices = [int(i) for i in args.only.split(",")] if args.only else list(range(len(VARIANTS)))
    checked = []
    for index in indices:
        variant = VARIANTS[index]
        try:
            error = check(variant, device)
            print(json.dumps({"index": index, "variant": variant.label(), "check_rel_err": error}), flush=True)
            if error < 1e-5:
                checked.append((index, variant))
        except Exception as failure:  # noqa: BLE001 - report and go on with the others
            print(json.dumps({"index": index, "variant": variant.label(), "error": str(failure)[:300]}),
                  flush=True)
    if device == "cpu":
        return 0
    spec = importlib.util.spec_from_file_location("bench_kernels", Path(__file__).with_name("kernels.py"))
    bench_kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_kernels)
    copy_gbs = bench_kernels.copy_bandwidth()
    for batch, steps in [(8, 4096), (1, 32768)]:
        time_size(batch, steps, checked, bench_kernels.time_ms, copy_gbs)
        torch.cuda.empty_cache()
    return 0


def time_size(batch: int, steps: int, variants: list[tuple[int, Variant]], time_ms: Callable,
              copy_gbs: float) -> None:
    inputs = case(batch, steps, CHANNELS, "cuda", seed=4)
    x, beta, v_th = (inputs[name].requires_grad_() for name in ("x", "beta", "v_th"))
    grads = [torch.randn_like(x), torch.randn_like(x)]  # into spikes and v_pre, as in training
    elements = batch * steps * CHANNELS
    forward_bytes = elements * 3 * 4  # x read, spikes and v_pre written
    both_bytes = elements * 8 * 4  # and the backward: x, v_pre, two output gradients read, grad_x written
    size = f"Bt {batch} T {steps} D {CHANNELS} fp32"

    def timings(apply: Callable) -> tuple[float, float]:
        def forward_backward() -> None:
            spikes, v_pre, _ = apply(x, beta, v_th, None, ALPHA)
            torch.autograd.grad([spikes, v_pre], [x, beta, v_th], grads)  # returned, not accumulated

        with torch.no_grad():
            forward = time_ms(lambda: apply(x, beta, v_th, None, ALPHA))
        return forward, time_ms(forward_backward)

    def row(impl: str, forward: float, both: float) -> dict:
        return {"size": size, "impl": impl, "fwd_ms": round(forward, 4),
                "fwd_of_copy": round(forward_bytes / forward / 1e6 / copy_gbs, 3),
                "fwd_bwd_ms": round(both, 4), "fwd_bwd_of_copy": round(both_bytes / both / 1e6 / copy_gbs, 3)}

    base_forward, base_both = timings(kernel_in_use)
    print(json.dumps(row("kernels.plif", base_forward, base_both)), flush=True)
    for index, variant in variants:
        try:
            forward, both = timings(variant_class(variant).apply)
        except Exception as failure:  # noqa: BLE001 - e.g. out of shared memory; go on with the others
            print(json.dumps({"size": size, "index": index, "impl": variant.label(), "error": str(failure)[:300]}),
                  flush=True)
            continue
        print(json.dumps({"index": index, **row(variant.label(), forward, both),
                          "speedup_fwd": round(base_forward / forward, 2),
                          "speedup_fwd_bwd": round(base_both / both, 2)}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
