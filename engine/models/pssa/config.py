"""PSSA's configuration and presets (no torch: run.json is checked against them by light tools)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.errors import ConfigError


@dataclass(frozen=True)
class PSSAConfig:
    """Shape and memory settings of a PSSA preset; every field can be overridden from run.json."""

    vocab_size: int = 2048
    """Tokenizer vocabulary size (rows of the embedding and of the output head)."""
    d_latent: int = 256
    """Width d of the latent stream (SSM channels, memory values, MLP input)."""
    d_state: int = 16
    """SSM states N per channel."""
    d_mem_key: int = 32
    """Width of a memory key / query in the Poincare ball."""
    mem_capacity: int = 512
    """Slots per block's memory bank (also the size of the dreaming cache)."""
    chunk_len: int = 64
    """TBPTT piece length: the carry is detached and the banks written every chunk_len tokens."""
    tau_mem: float = 0.1
    """Temperature of the memory read's softmax over -hyperbolic distance."""
    mem_top_k: int = 4
    """Slots a read attends to (the nearest, exactly); 0 reads the whole bank."""
    depth: int = 1
    """Number of independently parameterised blocks."""
    loops: int = 1
    """Ouro passes over the stack (weight-shared; each pass has its own recurrent carry)."""
    adapter_rank: int = 16
    """Rank of the plastic adapter (down d -> r, up r -> d)."""
    mlp_ratio: int = 2
    """MLP hidden width as a multiple of d."""
    tau_min: float = 1.5
    """Shortest SSM time constant at initialisation (tokens, at delta = 1)."""
    tau_max: float = 200.0
    """Longest SSM time constant at initialisation; the N constants are log-spaced between."""
    write_loss_threshold: float = 3.5
    """A chunk writes to the banks only when its mean loss (nats) exceeds this."""
    ema_alpha: float = 0.01
    """Consolidation rate a: `U_slow += a U_fast; U_fast *= 1 - a`."""
    norm_eps: float = 1e-5
    """Epsilon of the blocks' RMSNorm."""

    def validate(self) -> None:
        """Raise ConfigError on settings the model cannot be built with."""
        positive = (
            "vocab_size", "d_latent", "d_state", "d_mem_key", "mem_capacity", "chunk_len",
            "depth", "loops", "adapter_rank", "mlp_ratio",
        )  # fmt: skip
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.overrides: {name} must be positive, got {getattr(self, name)}")
        if not (math.isfinite(self.tau_mem) and self.tau_mem > 0):
            raise ConfigError(f"model.overrides: tau_mem must be finite and positive, got {self.tau_mem}")
        if self.mem_top_k < 0:
            raise ConfigError(f"model.overrides: mem_top_k must be >= 0, got {self.mem_top_k}")
        if not 0 < self.tau_min <= self.tau_max:
            raise ConfigError(
                f"model.overrides: need 0 < tau_min <= tau_max, got {self.tau_min} and {self.tau_max}"
            )
        if not 0.0 <= self.ema_alpha <= 1.0:
            raise ConfigError(f"model.overrides: ema_alpha must be in [0, 1], got {self.ema_alpha}")


STATE_SHAPING = ("mem_capacity", "chunk_len", "d_mem_key", "d_latent")
"""Settings that shape a PSSA model's saved state beyond its parameters (its banks and dreaming
cache): `mem_capacity` and `chunk_len` shape no weight, so a line's parameter layout does not show
that run.json changed them since a checkpoint."""


def changed_state_setting(saved: dict[str, int | None], config: PSSAConfig) -> str | None:
    """Why state saved with the `STATE_SHAPING` settings `saved` (None: not known) cannot load into
    a model of `config`: the first setting that differs, and how to set it back; None when all agree."""
    for name in STATE_SHAPING:
        value = saved.get(name)
        if value is not None and value != getattr(config, name):
            return (
                f"its PSSA memory state was saved with {name} {value}, and run.json's model has "
                f"{name} {getattr(config, name)}: {name} cannot change on a line with checkpoints "
                f"(set model.overrides.{name} back to {value})"
            )
    return None


PRESETS: dict[str, PSSAConfig] = {
    # The article's model: 1,544,704 parameters at vocab 2048.
    "pssa-1.5m": PSSAConfig(),
    # Small enough for CPU tests in well under a second; two blocks to exercise the stack.
    "pssa-tiny": PSSAConfig(
        vocab_size=256, d_latent=32, d_state=4, d_mem_key=8, mem_capacity=16, chunk_len=16,
        depth=2, adapter_rank=4,
    ),  # fmt: skip
    # A GPU-sized stack: 127,025,152 parameters at a 32K vocabulary.
    "pssa-127m": PSSAConfig(vocab_size=32768, d_latent=1024, depth=8, chunk_len=256),
}
