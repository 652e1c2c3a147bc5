"""Layers shared by the model families: RMSNorm, rotary and sinusoidal positions, SwiGLU, maps of
one input stacked into one product.

Everything here is plain PyTorch and runs on CPU and GPU alike; no family-specific logic.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from engine.models.base import compute_dtype


class RMSNorm(nn.Module):
    """`x / rms(x) * scale (+ offset)` over the last dimension, computed in float32.

    The offset (a learned bias) is optional: the PSSA article's transformer peer has one,
    the large presets do not.
    """

    def __init__(self, dim: int, eps: float = 1e-6, offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if offset else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 (float64 stays float64) so bf16 activations keep the mean square.
        dtype = torch.promote_types(x.dtype, torch.float32)
        wide = x.to(dtype)
        normed = wide * torch.rsqrt(wide.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        out = normed * self.weight.to(dtype)
        if self.bias is not None:
            out = out + self.bias.to(dtype)
        return out.to(x.dtype)


def sinusoidal_positions(length: int, dim: int, base: float = 10_000.0) -> torch.Tensor:
    """Fixed positions of "Attention Is All You Need": (length, dim) float32.

    `pe[p, 2i] = sin(p / base^(2i/dim))`, `pe[p, 2i+1] = cos(p / base^(2i/dim))`.
    """
    if dim % 2:
        raise ValueError(f"sinusoidal positions need an even width, got {dim}")
    position = torch.arange(length, dtype=torch.float64).unsqueeze(1)  # (L, 1)
    inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # (dim/2,)
    angles = position * inv_freq  # (L, dim/2)
    table = torch.empty(length, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles)
    return table.float()


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE), rotating half-splits of each head (GPT-NeoX layout).

    The cos / sin tables are computed once per (length, device, dtype) and kept: a captured CUDA
    graph reads the very tensors it was captured with, so a table may not be replaced (freed)
    while the graph lives; `clear_device_cache()` drops them with the graphs. They are not
    parameters and not saved (`persistent=False`), so a checkpoint does not depend on the
    longest row seen.
    """

    def __init__(self, head_dim: int, base: float = 10_000.0) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head width, got {head_dim}")
        self.head_dim = head_dim
        self.base = base
        inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self._cache: dict[tuple[int, torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(
        self, length: int, offset: int, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(length, head_dim) cos and sin for positions offset .. offset + length - 1.

        Tables are kept for lengths rounded up to a power of two, so a decoder asking for one
        more position per token reuses a few tables instead of keeping one per offset (each
        position's angle is the same whatever the table's length)."""
        table_length = 1 << max(offset + length - 1, 0).bit_length()
        key = (table_length, device, dtype)
        if key not in self._cache:
            # Angles in float64 so positions in the hundreds of thousands keep their phase.
            position = torch.arange(table_length, dtype=torch.float64, device=device)
            angles = position.unsqueeze(1) * self.inv_freq.to(device, torch.float64)  # (L, hd/2)
            angles = torch.cat([angles, angles], dim=-1)  # (L, hd)
            self._cache[key] = (angles.cos().to(dtype), angles.sin().to(dtype))
        cos, sin = self._cache[key]
        return cos[offset : offset + length], sin[offset : offset + length]

    def clear_device_cache(self) -> None:
        """Forget the tables (see the class docstring)."""
        self._cache = {}

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Rotate x of shape (B, H, T, head_dim) by the positions offset .. offset + T - 1."""
        length = x.shape[-2]
        return apply_rotary(x, *self.tables(length, offset, x.device, x.dtype))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x of shape (..., T, head_dim) by (T, head_dim) tables from `RotaryEmbedding.tables`
    (a function of tensors only, so a compiled layer can take the tables as inputs)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


STACK_ALIGN = 16
"""Columns a stacked map's output starts at a multiple of, and the stacked width is a multiple of:
a Triton kernel reading a slice (the pool read's v, a PLIF scan's input) sees its rows 16-element
aligned, which its vectorised, pipelined loads need (an ns-2b write gate's 20 channels at a stride
of 7,720 ran 1.2 ms a call instead of a few microseconds, its loads waited out one at a time)."""


def _padding(width: int) -> int:
    return -width % STACK_ALIGN


def stacked_linear(x: torch.Tensor, maps: Sequence[nn.Linear]) -> tuple[torch.Tensor, ...]:
    """x (..., D) through several linear maps of it as one matrix product -> each map's output (a
    slice of one (..., W) tensor), in the maps' order; each starts at a multiple of `STACK_ALIGN`
    columns (zero rows fill the gaps, and W is a multiple too).

    One product reads x once and gives it one gradient, the maps' parts summed in the product's
    fp32 accumulator. Separate maps under bf16 autocast give x a bf16 gradient each, which must be
    cast to fp32 and added (a pass over x's size each) to keep the sum in fp32. A map without a bias
    adds zeros in the stacked bias. The weights are stacked in the product's dtype (bf16 under
    autocast: each cast once, then half the bytes to copy): a copy of every weight a call, which
    a caller with large maps and no gradient to gather may rather not pay (`maps_of`)."""
    dtype = compute_dtype(x)
    weights: list[torch.Tensor] = []
    biases: list[torch.Tensor] = []
    widths: list[int] = []  # of each map's output, then of its zero rows where it has some
    outputs: list[int] = []  # which pieces are the maps' outputs
    for linear in maps:
        weight = linear.weight.to(dtype)
        bias = linear.bias if linear.bias is not None else linear.weight.new_zeros(linear.out_features)
        outputs.append(len(widths))
        weights.append(weight)
        biases.append(bias)
        widths.append(linear.out_features)
        if pad := _padding(linear.out_features):
            weights.append(weight.new_zeros(pad, weight.shape[1]))
            biases.append(bias.new_zeros(pad))
            widths.append(pad)
    has_bias = any(linear.bias is not None for linear in maps)
    pieces = F.linear(x, torch.cat(weights), torch.cat(biases) if has_bias else None).split(widths, dim=-1)
    return tuple(pieces[index] for index in outputs)


def maps_of(x: torch.Tensor, maps: Sequence[nn.Linear]) -> tuple[torch.Tensor, ...]:
    """Each map of x: stacked into one product under autograd (`stacked_linear`: one gradient for
    x), one by one without it (validation, probes, decoding), where there is no gradient to gather
    and stacking would copy every weight once a call (once a token when decoding: for an ns-2b
    hippocampal layer's 66M parameters, more bytes than the maps themselves read)."""
    if torch.is_grad_enabled():
        return stacked_linear(x, maps)
    return tuple(linear(x) for linear in maps)


class SwiGLU(nn.Module):
    """`down(silu(gate x) * up x)` without biases (the large presets' feed-forward)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))
