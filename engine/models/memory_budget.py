"""The memory a line's training needs, estimated before anything is allocated (torch-free).

    memory = state + model buffers + the largest activations of one micro-batch
    state  = parameters x (4 weights + 4 gradients + 8 AdamW moments [+ 4 the `ema` average]) bytes
    activations at length T = 4 bytes x (micro_batch_rows x T x floats_per_token(T)
                                         + floats_per_micro_batch(T))

floats_per_token counts what a training forward keeps for the backward (and the backward's
transients) per target token, per family, in fp32 on the reference (CPU) path:

    transformer  3 V + 9 d + depth (10 d + 2 F)              (F x 1.5 with SwiGLU: three matrices)
    pssa         V (1 + 1.5 min(T, chunk) / T) + passes (13.5 d + 0.25 d N + 7.25 S_read)
    ns           3 V + 14 d + dendritic layers (4.5 d + 16 H P)
                     + hippocampal layers (14 F + A a + 2 A T on the CPU)

V vocabulary, d width, F FFN width, N SSM states, H P a dendritic layer's heads x head width,
A a attention heads x head width; for PSSA passes = depth x loops, and S_read the bank's slots
when a read weighs the whole bank (`mem_top_k` 0, or at least `mem_capacity`), else 0 (the top-k
read keeps k weights a token). PSSA keeps every chunk's logits and their softmax (V a token) and
forms one chunk's logit gradient at a time (1.5 V a token of a chunk). floats_per_micro_batch is
what does not grow with the rows: PSSA's per-chunk copies of its weights (the six projections
as one matrix, 2 d^2 per chunk and pass) and of its banks (each chunk's writes make the keys and
values the next chunk reads, kept for its backward: (chunks + 1) x depth x S x (d + Dk)); 0 for
the other families.

Model buffers are what a model holds beside its parameters that grows with its settings: PSSA's
banks (depth x S slots of a key, a value and 20 bytes of write-rule state) and its dreaming
record (S chunks of tokens and targets, int64: the device ring the forward writes and the host
cache it drains into). A bank of millions of slots is many GiB that no parameter counts.

The coefficients were fitted to torch's measured peak (MemTracker, CPU, fp32); PSSA's again in
2026-12 over 110 shapes (vocab 512-8192, d 64-256, N 4-32, depth and loops 1-3, chunk 32-256,
1-16 rows of 32-512 tokens, 64-16,384 slots, top-k and whole-bank reads): every estimate within
0.82-1.36x of the measured peak (the earlier fit, before the native scan and read, overestimated
today's PSSA by up to 4.5x, so a line that fits could be refused).
`tests/engine/models/test_memory_budget.py` holds the tiny presets at two lengths, and PSSA's
banks and reads, to ACCURACY.

On CUDA the NS models and the transformer keep less: bf16 autocast, the chunked cross-entropy
(no logits of every token: `engine.models.base.chunked_token_losses`) and, for NS, the layers a
line's `recompute` names, which keep only their input and are run again in the backward. Their
CUDA estimate is measured, not derived (`python bench/cuda_memory.py`, the trainer's eager update
on an H100 80GB, 2026-12-07; bench/RESULTS.md, session 27): per target token,

    ns           d (32.4 + sum over layers of: 4 recomputed, else 12.5 x dendritic width / d for a
                    dendritic layer, 39.6 x (14 F + A a) / (43 d) for a hippocampal one)
                 + the largest recomputed layer once (the backward runs it whole)      bytes
    transformer  2.12 x (9 d + depth (10 d + 2 F))                                   bytes

and per micro-batch 2 bytes a parameter (autocast's bf16 copies of the weights) and one loss
piece's logits (12 bytes x LOSS_CHUNK_TOKENS x V). Fitted to ns-2b (none, dendritic, all) and
ns-1p3b (none, dendritic) at 1 and 2 rows of 4K, the fit's slopes are within 0.1 byte of every
measured one per token and width; the estimates are 0.98-1.11x the measured peaks beyond the state
(1.02x for ns-2b's 16K row, 0.98x for its 8 x 4K update of session 13 on the H200; 1.6-1.9x with
`recompute all`, which keeps no weight copies). Before, the CPU's fp32
formula judged CUDA too: ns-2b at 8 rows of 4K with dendritic recomputation (58 GiB measured) was
estimated at 420 GiB and refused on an H200 and ns-1p3b at 4 rows on an H100 80GB, though both
fit. PSSA on CUDA keeps the CPU formula (0.86-0.96x the measured peak of pssa-127m at 4K).

A start is refused only when even the estimate's lower end (state + buffers + activations /
ACCURACY) exceeds the device: a configuration that cannot fit, never one that might.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.errors import ConfigError
from engine.units import GIB

ACCURACY = 2.0
"""The estimate's activations are within this factor of the measured peak (both ways)."""
LOSS_CHUNK_TOKENS = 2048
"""Tokens per piece of `engine.models.base.chunked_token_losses` (defined here, torch-free, for the
estimate): at vocab 65,536 a piece's bf16 logits are 256 MiB."""
AUTOCAST_BYTES_PER_PARAMETER = 2
"""What bf16 autocast keeps of the weights during an update on CUDA: a bf16 copy of each."""
LOSS_PIECE_BYTES_PER_LOGIT = 12
"""One loss piece's logits on CUDA: bf16 logits, their fp32 softmax and gradient."""
NS_CUDA_BASE = 32.4
"""Bytes per target token and unit of width an NS update keeps on CUDA outside its layers."""
NS_CUDA_RECOMPUTED = 4.0
"""Bytes per token and unit of width a recomputed NS layer keeps: its fp32 input."""
NS_CUDA_DENDRITIC = 12.5
"""Bytes per token and unit of dendritic width a dendritic layer keeps on CUDA, not recomputed."""
NS_CUDA_HIPPOCAMPAL = 39.6 / 43
"""Bytes per token a hippocampal layer keeps on CUDA, not recomputed, per float of the CPU
formula's 14 F + A a (39.6 bytes per unit of width at the presets' F = 3 d, A a = d)."""
TRANSFORMER_CUDA_BYTES = 2.12
"""Bytes on CUDA per float the CPU formula counts for the transformer's layers and stream."""
STATE_BYTES_PER_PARAMETER = 16
"""fp32 weights, their gradient and the two AdamW moments (the flat buffers of engine.training.optim)."""
EMA_BYTES_PER_PARAMETER = 4
"""The `ema` parameter average, fp32."""
Shape = tuple[int, str]
"""A micro-batch shape: (rows, recompute)."""


def floats_per_token(family: str, config: Any, seq_len: int, device_type: str = "cpu") -> float:
    """Activation floats a training forward and backward hold per target token at `seq_len`."""
    c = config
    if family == "transformer":
        ffn = c.ffn_hidden * (1.5 if c.swiglu else 1.0)
        return 3 * c.vocab_size + 9 * c.width + c.depth * (10 * c.width + 2 * ffn)
    if family == "pssa":
        piece = min(seq_len, c.chunk_len) / seq_len
        per_pass = 13.5 * c.d_latent + 0.25 * c.d_latent * c.d_state + 7.25 * _whole_bank_read(c)
        return c.vocab_size * (1 + 1.5 * piece) + c.depth * c.loops * per_pass
    if family == "ns":
        hippocampal = sum(1 for layer in range(c.n_layers) if c.is_hippocampal(layer))
        dendritic = c.n_layers - hippocampal
        attention = 2 * c.attn_heads * seq_len if device_type == "cpu" else 0
        per_hippocampal = 14 * c.ffn_dim + c.attn_width + attention
        per_dendritic = 4.5 * c.d_model + 16 * c.dendritic_width
        return 3 * c.vocab_size + 14 * c.d_model + dendritic * per_dendritic + hippocampal * per_hippocampal
    raise ConfigError(f"model.preset: no memory estimate for family {family!r}")


def cuda_bytes_per_token(family: str, config: Any, recompute: str = "none") -> float | None:
    """Activation bytes a training update keeps per target token on CUDA, measured per family (see
    the module docstring); None for a family whose CUDA estimate is the CPU formula (PSSA)."""
    c = config
    if family == "transformer":
        ffn = c.ffn_hidden * (1.5 if c.swiglu else 1.0)
        return TRANSFORMER_CUDA_BYTES * (9 * c.width + c.depth * (10 * c.width + 2 * ffn))
    if family != "ns":
        return None
    from engine.models.ns.presets import recomputed_layers

    recomputed = recomputed_layers(recompute, c)
    whole = [
        NS_CUDA_HIPPOCAMPAL * (14 * c.ffn_dim + c.attn_width) if c.is_hippocampal(layer)
        else NS_CUDA_DENDRITIC * c.dendritic_width
        for layer in range(c.n_layers)
    ]  # fmt: skip
    kept = sum(NS_CUDA_RECOMPUTED * c.d_model if layer in recomputed else size for layer, size in enumerate(whole))
    rerun = max((whole[layer] for layer in recomputed), default=0.0)
    return NS_CUDA_BASE * c.d_model + kept + rerun


def _whole_bank_read(config: Any) -> int:
    """Slots a PSSA read weighs under autograd: the whole bank when it reads every slot (the
    dense read keeps distances and weights for each), none on the top-k path."""
    dense = config.mem_top_k == 0 or config.mem_top_k >= config.mem_capacity
    return config.mem_capacity if dense else 0


def floats_per_micro_batch(family: str, config: Any, seq_len: int) -> float:
    """Activation floats of one micro-batch at `seq_len` that do not grow with its rows (PSSA's
    per-chunk weight and bank copies; see the module docstring)."""
    if family != "pssa":
        return 0.0
    c = config
    chunks = math.ceil(seq_len / c.chunk_len)
    weights = c.depth * c.loops * chunks * 2 * c.d_latent**2
    banks = (chunks + 1) * c.depth * c.mem_capacity * (c.d_latent + c.d_mem_key)
    return float(weights + banks)


def buffer_bytes(family: str, config: Any) -> int:
    """Bytes a model holds beside its parameters that its settings can make large: PSSA's banks
    (fp32 keys and values; confidence, last-touched update and slot index, 20 bytes a slot) and
    its dreaming record (int64 tokens and targets of S chunks, on the device and on the host)."""
    if family != "pssa":
        return 0
    return _bank_bytes(config) + 2 * _dream_record_bytes(config)


def saved_buffer_bytes(family: str, config: Any) -> int:
    """What of `buffer_bytes` a checkpoint holds: the banks and the dreaming record once (a bank of
    millions of slots is GiBs on disk that no parameter counts)."""
    if family != "pssa":
        return 0
    return _bank_bytes(config) + _dream_record_bytes(config)


def _bank_bytes(config: Any) -> int:
    return config.depth * config.mem_capacity * (4 * (config.d_mem_key + config.d_latent) + 20)


def _dream_record_bytes(config: Any) -> int:
    return (config.mem_capacity + 1) * config.chunk_len * 2 * 8


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
    buffer_bytes: int = 0
    """The model's buffers that grow with its settings (PSSA's banks and dreaming record)."""

    @property
    def largest(self) -> tuple[int, int, int]:
        """(seq_len, rows, bytes) of the length whose micro-batch holds the most activations."""
        seq_len, (rows, size) = max(self.activations.items(), key=lambda item: item[1][1])
        return seq_len, rows, size

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.buffer_bytes + self.largest[2]

    @property
    def lower_bytes(self) -> int:
        """The least the estimate allows: state + buffers + activations / ACCURACY."""
        return self.state_bytes + self.buffer_bytes + int(self.largest[2] / ACCURACY)

    def describe(self) -> str:
        seq_len, rows, size = self.largest
        text = (
            f"about {self.total_bytes / GIB:.3g} GiB: state {self.state_bytes / GIB:.3g} GiB "
            f"({self.parameters:,} parameters x {self.bytes_per_parameter} bytes"
            f"{f' over {self.shards} ranks' if self.shards > 1 else ''}) "
            f"{f'+ model buffers {self.buffer_bytes / GIB:.3g} GiB ' if self.buffer_bytes else ''}"
            f"+ activations {size / GIB:.3g} GiB (a micro-batch of {rows} row{'s' if rows != 1 else ''} at T{seq_len})"
        )
        if len(self.activations) > 1:
            each = ", ".join(f"T{length} {b / GIB:.3g}" for length, (_, b) in sorted(self.activations.items()))
            text += f" (each length's: {each})"
        return text


def estimate_memory(
    family: str,
    config: Any,
    parameters: int,
    shapes: Mapping[int, int | Sequence[Shape]],
    *,
    ema: bool = False,
    device_type: str = "cpu",
    shards: int = 1,
) -> MemoryEstimate:
    """The estimate for `shapes` of a model of `parameters`, per process: seq_len -> its
    micro_batch_rows (no recomputation), or the (rows, recompute) shapes the length may train
    with (its own and its shared one: the one that keeps more counts). With `shards` > 1 (FSDP2
    over that many ranks) each rank holds 1/shards of the state (and of autocast's weight copies);
    what FSDP2 adds on top (one layer's gathered weights, an update's unsynced gradients before its
    last micro-batch) is not counted: the estimate stays a bound a start is refused by only when
    it cannot fit."""
    per_parameter = STATE_BYTES_PER_PARAMETER + (EMA_BYTES_PER_PARAMETER if ema else 0)
    shards = max(1, shards)
    activations = {}
    for seq_len, choices in shapes.items():
        options = [(choices, "none")] if isinstance(choices, int) else choices
        sized = [
            (rows, activation_bytes(family, config, rows, seq_len, device_type, recompute, parameters // shards))
            for rows, recompute in options
        ]
        activations[seq_len] = max(sized, key=lambda item: item[1])
    state = math.ceil(parameters * per_parameter / shards)
    return MemoryEstimate(parameters, state, activations, per_parameter, shards, buffer_bytes(family, config))


def activation_bytes(
    family: str, config: Any, rows: int, seq_len: int, device_type: str, recompute: str = "none", parameters: int = 0
) -> int:
    """The estimate's activation bytes of one micro-batch of `rows` at `seq_len` with `recompute`, for
    a model of `parameters` (on CUDA autocast keeps a bf16 copy of them)."""
    per_token = cuda_bytes_per_token(family, config, recompute) if device_type == "cuda" else None
    if per_token is None:
        return int(4 * _micro_batch_floats(family, config, rows, seq_len, device_type))
    loss_piece = LOSS_PIECE_BYTES_PER_LOGIT * min(LOSS_CHUNK_TOKENS, rows * seq_len) * config.vocab_size
    return int(rows * seq_len * per_token + AUTOCAST_BYTES_PER_PARAMETER * parameters + loss_piece)


def _micro_batch_floats(family: str, config: Any, rows: int, seq_len: int, device_type: str) -> float:
    per_token = floats_per_token(family, config, seq_len, device_type)
    return rows * seq_len * per_token + floats_per_micro_batch(family, config, seq_len)


def line_shapes(run_config: Any) -> dict[int, list[Shape]]:
    """seq_len -> the (micro_batch_rows, recompute) shapes of every length a line's plan trains:
    its own and its shared one (either may be the one in use)."""
    stage_lengths = {stage.seq_len for stage in run_config.plan}
    shapes: dict[int, list[Shape]] = {}
    for entry in run_config.lengths:
        if entry.seq_len in stage_lengths:
            shapes[entry.seq_len] = [(entry.micro_batch_rows, entry.recompute)]
            if entry.shared is not None:
                shapes[entry.seq_len].append((entry.shared.micro_batch_rows, entry.shared.recompute))
    return shapes


def memory_problem(estimate: MemoryEstimate, available: int, where: str, device: str) -> str | None:
    """One line when even the estimate's lower end exceeds `available` bytes; None when it may fit."""
    if estimate.lower_bytes <= available:
        return None
    seq_len, rows, _ = estimate.largest
    remedy = f"lower lengths[].micro_batch_rows at T{seq_len} (now {rows}) or choose a smaller preset"
    if estimate.buffer_bytes > estimate.state_bytes:
        # PSSA's slots outweigh its parameters: its buffers and each chunk's bank copy grow with
        # them, and fewer rows leave both as they are.
        remedy = f"lower model.overrides.mem_capacity (the banks' slots, held again by every chunk), {remedy}"
    return (
        f"{where}: training needs {estimate.describe()}; {device} has {available / GIB:.3g} GiB: it cannot fit "
        f"(even at 1/{ACCURACY:g} of the activations estimate); {remedy}; nothing was allocated"
    )
