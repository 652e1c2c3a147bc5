"""Sums of squares of the segments of the flat gradient buffer, in one pass.

Entry i of `segment_sq_sums(flat, offsets)` is sum(flat[offsets[i]:offsets[i+1]] ** 2); the
caller adds segments up into layers, groups and the global norm, so one read of the buffer
gives every gradient norm the trainer reports.

The squares are taken and summed in float64 (the sums come back as float64): a finite fp32
gradient element above about 1.8e19 has a square beyond fp32's range, so an fp32 sum would turn
a huge but finite gradient into an infinite norm, and the update would be skipped instead of
clipped. In float64 every finite fp32 buffer has a finite sum; a NaN or Inf element still gives a
non-finite one. The cost on the GPU is one conversion and one fp64 multiply-add per element in a
kernel bound by reading the buffer (the H200's fp64 rate is half its fp32 rate, tens of TFLOP/s
against about 1.2e12 elements/s of bandwidth), and fp64 adds for the partial sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._dispatch import new_buffer, wants_triton

_CHUNK = 8192
"""Elements of the buffer one program reads (32 per thread at 8 warps)."""
_SEGMENT_BLOCK = 1024
"""Chunk partials the second pass adds up per loop iteration."""


def _check_inputs(flat: torch.Tensor, offsets: torch.Tensor) -> None:
    if flat.dtype != torch.float32 or flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError("segment_sq_sums: flat must be a 1-D contiguous fp32 tensor")
    if offsets.dtype != torch.int64 or offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError("segment_sq_sums: offsets must be a 1-D int64 tensor of S + 1 boundaries")
    if offsets.device != flat.device:
        raise ValueError(f"segment_sq_sums: offsets on {offsets.device}, flat on {flat.device}")


@triton.jit
def _chunk_partials_kernel(
    flat_ptr, offsets_ptr, head_ptr, inner_ptr, count, segments,
    CHUNK: tl.constexpr, SEARCH_STEPS: tl.constexpr,
):
    chunk = tl.program_id(0)
    start = chunk.to(tl.int64) * CHUNK
    end = tl.minimum(start + CHUNK, count)
    positions = start + tl.arange(0, CHUNK)
    # The load goes first so that the search below runs while the bytes are on their way.
    values = tl.load(flat_ptr + positions, mask=positions < end, other=0.0).to(tl.float64)
    squares = values * values
    # Binary search for the segment holding `start`: the largest s with offsets[s] <= start
    # (it is never empty, since offsets[s + 1] > start by the choice of s).
    low = start * 0
    high = low + segments - 1
    for _ in tl.static_range(SEARCH_STEPS):
        middle = (low + high + 1) // 2
        ahead = (high > low) & (tl.load(offsets_ptr + middle, mask=high > low, other=0) <= start)
        low = tl.where(ahead, middle, low)
        high = tl.where(ahead | (high <= low), high, middle - 1)
    segment = low
    segment_end = tl.load(offsets_ptr + segment + 1)
    tl.store(head_ptr + chunk, tl.sum(tl.where(positions < segment_end, squares, 0.0), axis=0))
    # Segments that start inside this chunk (rare: small parameters packed together).
    segment += 1
    segment_start = segment_end
    while (segment < segments) & (segment_start < end):
        segment_end = tl.load(offsets_ptr + segment + 1)
        inside = (positions >= segment_start) & (positions < segment_end)
        tl.store(inner_ptr + segment, tl.sum(tl.where(inside, squares, 0.0), axis=0))
        segment += 1
        segment_start = segment_end


@triton.jit
def _segment_totals_kernel(
    offsets_ptr, head_ptr, inner_ptr, sums_ptr, count, CHUNK: tl.constexpr, BLOCK: tl.constexpr
):
    segment = tl.program_id(0)
    segment_start = tl.load(offsets_ptr + segment)
    segment_end = tl.load(offsets_ptr + segment + 1)
    # The chunks whose first element lies in the segment, in a fixed order (deterministic).
    first_chunk = tl.cdiv(segment_start, CHUNK)
    last_chunk = tl.cdiv(segment_end, CHUNK)
    partial = tl.zeros([BLOCK], dtype=tl.float64)
    for block_start in range(first_chunk, last_chunk, BLOCK):
        chunks = block_start + tl.arange(0, BLOCK)
        partial += tl.load(head_ptr + chunks, mask=chunks < last_chunk, other=0.0)
    total = tl.sum(partial, axis=0)
    # A segment that starts mid-chunk has its first part in inner (written by that chunk).
    starts_mid_chunk = (segment_start % CHUNK != 0) & (segment_start < count)
    total += tl.load(inner_ptr + segment, mask=starts_mid_chunk, other=0.0)
    tl.store(sums_ptr + segment, total)


def segment_sq_sums_reference(flat: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """One reduction per segment (reads the offsets on the host) -> (S,) float64."""
    _check_inputs(flat, offsets)
    bounds = offsets.tolist()
    if bounds[0] != 0 or bounds[-1] != flat.numel() or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"segment_sq_sums: offsets must ascend from 0 to {flat.numel()}, got {bounds}")
    sums = [
        torch.linalg.vector_norm(flat[start:end], dtype=torch.float64).square()
        for start, end in zip(bounds, bounds[1:])
    ]
    if not sums:
        return flat.new_zeros(0, dtype=torch.float64)
    return torch.stack(sums)


def segment_sq_sums(
    flat: torch.Tensor, offsets: torch.Tensor, *, use_triton: bool | None = None
) -> torch.Tensor:
    """(S,) float64 sums of squares of the segments (see the module docstring): Triton on CUDA.

    use_triton: None picks Triton on CUDA; True forces it (off CUDA only under
    TRITON_INTERPRET=1); False forces the reference. The Triton path trusts the offsets to ascend
    from 0 to flat.numel() (checking would stop the host for the device); the reference checks.
    Deterministic: partial sums are added in a fixed order, no atomics.
    """
    if not wants_triton(flat, use_triton):
        return segment_sq_sums_reference(flat, offsets)
    _check_inputs(flat, offsets)
    segments = offsets.numel() - 1
    count = flat.numel()
    sums = new_buffer((segments,), torch.float64, flat.device)
    if segments == 0:
        return sums
    chunks = triton.cdiv(count, _CHUNK)
    # head[c]: the chunk's part of the segment its first element belongs to; inner[s]: the
    # whole part of segment s inside the chunk where s starts (when it starts mid-chunk).
    head = new_buffer((max(chunks, 1),), torch.float64, flat.device)
    inner = new_buffer((segments,), torch.float64, flat.device)
    search_steps = max(1, segments.bit_length())
    if chunks:
        _chunk_partials_kernel[(chunks,)](
            flat, offsets, head, inner, count, segments, CHUNK=_CHUNK, SEARCH_STEPS=search_steps, num_warps=8
        )
    _segment_totals_kernel[(segments,)](
        offsets, head, inner, sums, count, CHUNK=_CHUNK, BLOCK=_SEGMENT_BLOCK, num_warps=4
    )
    return sums
