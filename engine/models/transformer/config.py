"""The transformer's configuration and presets (no torch: run.json is checked against them by light tools)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.errors import ConfigError


@dataclass(frozen=True)
class TransformerConfig:
    """Shape of a transformer preset; every field can be overridden from run.json."""

    vocab_size: int = 2048
    """Tokenizer vocabulary size (rows of the embedding and of the output head)."""
    width: int = 256
    """Residual stream width d."""
    depth: int = 1
    """Number of transformer layers."""
    heads: int = 4
    """Attention heads per layer (width must be a multiple)."""
    ffn_hidden: int = 448
    """Hidden width of the feed-forward block."""
    swiglu: bool = False
    """True: gated SwiGLU FFN (three matrices); False: `W2 silu(W1 x)` (two matrices)."""
    rope: bool = False
    """True: rotary positions on q and k; False: fixed sinusoidal positions added to the embedding."""
    rope_base: float = 10_000.0
    """Base of the rotary or sinusoidal frequencies."""
    norm_offset: bool = True
    """Whether each RMSNorm has a learned offset (bias) beside its learned scale."""
    final_norm: bool = False
    """Whether an RMSNorm precedes the output head."""
    tie_embeddings: bool = False
    """Whether the output head reuses the embedding matrix."""
    scale_logits: bool = True
    """Whether the logits are multiplied by 1/sqrt(width) (the article's peer)."""
    context_len: int = 64
    """Attention window: rows longer than this are cut into independent windows of this length."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of matrices and embeddings."""
    compile_layers: bool = True
    """Run each layer's training forward through `torch.compile` on CUDA (norms, RoPE, SwiGLU and
    residual adds fused around the matrix products; one compilation shared by the identical
    layers, made at the step engine's warm-up before any CUDA-graph capture). False runs them
    eagerly there. The CPU, decoding and no-grad forwards always run the layers eagerly."""

    def validate(self) -> None:
        """Raise ConfigError on a shape the model cannot be built with."""
        positive = ("vocab_size", "width", "depth", "heads", "ffn_hidden", "context_len")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.overrides: {name} must be positive, got {getattr(self, name)}")
        if self.width % self.heads:
            raise ConfigError(f"model.overrides: width {self.width} is not a multiple of heads {self.heads}")
        if not isinstance(self.compile_layers, bool):
            raise ConfigError(
                f"model.overrides: compile_layers must be true or false, got {self.compile_layers!r}"
            )
        if (self.width // self.heads) % 2:
            raise ConfigError(f"model.overrides: head width {self.width // self.heads} must be even")
        # base ** (-2i/d) of a base <= 0 is infinite or NaN: every position (sinusoidal or RoPE)
        # would be NaN and so would every loss, a line of skipped updates.
        if not self.rope_base > 0:
            raise ConfigError(f"model.overrides: rope_base must be positive, got {self.rope_base}")
        # torch's normal initialisation refuses a negative std with a traceback, at build time.
        if not self.init_std > 0:
            raise ConfigError(f"model.overrides: init_std must be positive, got {self.init_std}")


_LLAMA_STYLE: dict[str, Any] = dict(
    swiglu=True, rope=True, rope_base=500_000.0, norm_offset=False, final_norm=True, tie_embeddings=True,
    scale_logits=False, context_len=32768,
)  # fmt: skip
"""The large presets' family traits (RMSNorm without offset, RoPE, SwiGLU, final norm, tied head)."""


PRESETS: dict[str, TransformerConfig] = {
    # The PSSA article's peer: 1,541,120 parameters at vocab 2048.
    "transformer-1.5m": TransformerConfig(),
    # Small enough for CPU tests in well under a second.
    "transformer-tiny": TransformerConfig(
        vocab_size=256, width=32, depth=2, heads=2, ffn_hidden=64, context_len=32
    ),
    # Llama-style peers of ns-1p3b (1,305,000,448) and ns-2b (1,993,992,320): the same tied
    # 65,536-token embedding, width and longest context; depth and SwiGLU width chosen so the
    # counts land within 0.5 % (1,310,820,352 and 2,002,926,080).
    "transformer-1p3b": TransformerConfig(vocab_size=65536, width=2048, depth=24, heads=16, ffn_hidden=5248,
                                          **_LLAMA_STYLE),  # fmt: skip
    "transformer-2b": TransformerConfig(vocab_size=65536, width=2560, depth=28, heads=20, ffn_hidden=5120,
                                        **_LLAMA_STYLE),  # fmt: skip
}
