"""The memory a line's training needs, estimated before anything is allocated (torch-free).

    memory = state + the largest activations of one micro-batch
    state  = parameters x (4 weights + 4 gradients + 8 AdamW moments [+ 4 the `ema` average]) bytes
    activations at length T = 4 bytes x micro_batch_rows x T x floats_per_token(T)

floats_per_token counts what a training forward keeps for the backward (and the backward's
transients) per target token, per family, in fp32 on the reference (CPU) path:

    transformer  3 V + 9 d + depth (10 d + 2 F)              (F x 1.5 with SwiGLU: three matrices)
    pssa         3 V + passes (17 d + 2.5 d N) + passes 8.5 d^2 / T        (passes = depth x loops)
    ns           3 V + 14 d + dendritic layers (4.5 d + 16 H P)
                     + hippocampal layers (14 F + A a + 2 A T on the CPU)

V vocabulary, d width, F FFN width, N SSM states, H P a dendritic layer's heads x head width,
A a attention heads x head width. `3 V` is the logits, their softmax and its gradient; PSSA's
`d^2 / T` is a per-row cost (its TBPTT pieces and adapter), spread over the row's tokens; the NS
pool read materialises its biased softmax (A x T per token) on the CPU only (flex attention on
CUDA keeps it in tiles). The coefficients were fitted to torch's measured peak (MemTracker, CPU,
fp32) over 41 shapes of the three families, from the tiny presets to pssa-1.5m: every estimate
was within 0.89-1.27x of the measured peak; `tests/engine/models/test_memory_budget.py` holds the
tiny presets at two lengths to ACCURACY. On CUDA the formula is an upper bound: bf16 autocast,
the NS models' recomputation and chunked cross-entropy keep less (the CUDA test there compares).

A start is refused only when even the estimate's lower end (state + activations / ACCURACY)
exceeds the device: a configuration that cannot fit, never one that might.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from engine.errors import ConfigError
from engine.units import GIB

ACCURACY = 2.0
"""The estimate's activations are within this factor of the measured peak (both ways)."""
STATE_BYTES_PER_PARAMETER = 16
"""fp32 weights, their gradient and the two AdamW moments (the flat buffers of engine.training.optim)."""
EMA_BYTES_PER_PARAMETER = 4
"""The `ema` parameter average, fp32."""


def floats_per_token(family: str, config: Any, seq_len: int, device_type: str = "cpu") -> float:
    """Activation floats a training forward and backward hold per target token at `seq_len`."""
    c = config
    if family == "transformer":
        ffn = c.ffn_hidden * (1.5 if c.swiglu else 1.0)
        return 3 * c.vocab_size + 9 * c.width + c.depth * (10 * c.width + 2 * ffn)
    if family == "pssa":
        passes = c.depth * c.loops
        per_token = 17 * c.d_latent + 2.5 * c.d_latent * c.d_state
        return 3 * c.vocab_size + passes * per_token + passes * 8.5 * c.d_latent**2 / seq_len
    if family == "ns":
        hippocampal = sum(1 for layer in range(c.n_layers) if c.is_hippocampal(layer))
        dendritic = c.n_layers - hippocampal
        attention = 2 * c.attn_heads * seq_len if device_type == "cpu" else 0
        per_hippocampal = 14 * c.ffn_dim + c.attn_width + attention
        per_dendritic = 4.5 * c.d_model + 16 * c.dendritic_width
        return 3 * c.vocab_size + 14 * c.d_model + dendritic * per_dendritic + hippocampal * per_hippocampal
    raise ConfigError(f"model.preset: no memory estimate for family {family!r}")


@dataclass(frozen=True)
class MemoryEstimate:
    """A line's training memory, by part."""

    parameters: int
    """Trainable parameters."""
    state_bytes: int
    """Weights, gradients, AdamW moments (and the `ema` average)."""
    activations: dict[int, tuple[int, int]]
    """seq_len -> (micro_batch_rows, activation bytes of one micro-batch)."""
    bytes_per_parameter: int = STATE_BYTES_PER_PARAMETER
    """State bytes a parameter takes in the whole model (weights, gradient, moments [, average])."""
    shards: int = 1
    """Ranks the state is sharded over (FSDP2); 1: every process holds it whole."""

    @property
    def largest(self) -> tuple[int, int, int]:
        """(seq_len, rows, bytes) of the length whose micro-batch holds the most activations."""
        seq_len, (rows, size) = max(self.activations.items(), key=lambda item: item[1][1])
        return seq_len, rows, size

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.largest[2]

    @property
    def lower_bytes(self) -> int:
        """The least the estimate allows: state + activations / ACCURACY."""
        return self.state_bytes + int(self.largest[2] / ACCURACY)

    def describe(self) -> str:
        seq_len, rows, size = self.largest
        text = (
            f"about {self.total_bytes / GIB:.3g} GiB: state {self.state_bytes / GIB:.3g} GiB "
            f"({self.parameters:,} parameters x {self.bytes_per_parameter} bytes"
            f"{f' over {self.shards} ranks' if self.shards > 1 else ''}) "
            f"+ activations {size / GIB:.3g} GiB (a micro-batch of {rows} rows at T{seq_len})"
        )
        if len(self.activations) > 1:
            each = ", ".join(f"T{length} {b / GIB:.3g}" for length, (_, b) in sorted(self.activations.items()))
            text += f" (each length's: {each})"
        return text


def estimate_memory(
    family: str,
    config: Any,
    parameters: int,
    shapes: dict[int, int],
    *,
    ema: bool = False,
    device_type: str = "cpu",
    shards: int = 1,
) -> MemoryEstimate:
    """The estimate for `shapes` (seq_len -> micro_batch_rows) of a model of `parameters`, per
    process. With `shards` > 1 (FSDP2 over that many ranks) each rank holds 1/shards of the state;
    what FSDP2 adds on top (one layer's gathered weights, an update's unsynced gradients before its
    last micro-batch) is not counted: the estimate stays a bound a start is refused by only when
    it cannot fit."""
    per_parameter = STATE_BYTES_PER_PARAMETER + (EMA_BYTES_PER_PARAMETER if ema else 0)
    shards = max(1, shards)
    activations = {
        seq_len: (rows, int(4 * rows * seq_len * floats_per_token(family, config, seq_len, device_type)))
        for seq_len, rows in shapes.items()
    }
    state = math.ceil(parameters * per_parameter / shards)
    return MemoryEstimate(parameters, state, activations, per_parameter, shards)


def line_shapes(run_config: Any) -> dict[int, int]:
    """seq_len -> micro_batch_rows of every length a line's plan trains (the largest of its
    own and its shared shape: either may be the one in use)."""
    stage_lengths = {stage.seq_len for stage in run_config.plan}
    shapes: dict[int, int] = {}
    for entry in run_config.lengths:
        if entry.seq_len in stage_lengths:
            rows = entry.micro_batch_rows
            if entry.shared is not None:
                rows = max(rows, entry.shared.micro_batch_rows)
            shapes[entry.seq_len] = rows
    return shapes


def memory_problem(estimate: MemoryEstimate, available: int, where: str, device: str) -> str | None:
    """One line when even the estimate's lower end exceeds `available` bytes; None when it may fit."""
    if estimate.lower_bytes <= available:
        return None
    seq_len, rows, _ = estimate.largest
    return (
        f"{where}: training needs {estimate.describe()}; {device} has {available / GIB:.3g} GiB: it cannot fit "
        f"(even at 1/{ACCURACY:g} of the activations estimate); lower lengths[].micro_batch_rows at T{seq_len} "
        f"(now {rows}) or choose a smaller preset; nothing was allocated"
    )
