"""How tokens are drawn: the settings `sample` and `chat` take (no torch: the CLI reads the defaults)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingSettings:
    """Temperature, top-p and seed of the draws (the `sample` and `chat` options of the same names)."""

    temperature: float = 0.8
    """Logits are divided by it before the softmax; 0 takes the most likely token (greedy)."""
    top_p: float = 0.95
    """Draw only among the most likely tokens whose probabilities first reach top_p together
    (the most likely one always stays); 1 draws from the whole distribution."""
    seed: int = 0
    """Seeds the generator of the draws: the same checkpoint, prompt, settings and device give the
    same text."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")
