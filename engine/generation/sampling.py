"""Choosing the next token from a model's logits: temperature, top-p (nucleus), a seeded generator.

The draw is made on the host in float64 from a CPU `torch.Generator`, whatever device computed the
logits: one (V,) row a token is nothing to copy, and a seed then names the same draws on every
device (the text differs only where the device's logits do).
"""

from __future__ import annotations

import torch

from engine.errors import NonFiniteLogits
from engine.generation.settings import SamplingSettings


def choose_token(logits: torch.Tensor, settings: SamplingSettings, generator: torch.Generator) -> int:
    """One token id from (V,) next-token logits; NonFiniteLogits when any is NaN or inf."""
    scores = logits.detach().to("cpu", torch.float64)
    finite = torch.isfinite(scores)
    if not bool(finite.all()):
        raise NonFiniteLogits(
            f"the model's next-token logits hold {int((~finite).sum()):,} NaN or infinite values of {scores.numel():,}"
        )
    if settings.temperature == 0.0:
        return int(scores.argmax())
    # Relative to the best score first: divided by a tiny temperature (1e-310) the raw scores
    # overflow to inf and the softmax gives NaN; the differences only reach -inf (probability 0).
    probabilities = torch.softmax((scores - scores.max()) / settings.temperature, dim=0)
    if settings.top_p < 1.0:
        ranked, order = probabilities.sort(descending=True, stable=True)
        # Keep a token while the mass of the tokens ranked above it is still below top_p.
        keep = ranked.cumsum(0) - ranked < settings.top_p
        probabilities = torch.zeros_like(probabilities).scatter_(0, order[keep], ranked[keep])
    return int(torch.multinomial(probabilities, 1, generator=generator))
