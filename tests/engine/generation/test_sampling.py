"""Choosing tokens: greedy at temperature 0, the top-p cut, seeded draws, refused settings."""

from __future__ import annotations

import pytest
import torch

from engine.errors import NonFiniteLogits
from engine.generation.sampling import choose_token
from engine.generation.settings import SamplingSettings

PROBABILITIES = torch.tensor([0.05, 0.5, 0.15, 0.3])
"""Ranked: token 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05)."""


def _draws(settings: SamplingSettings, count: int = 400) -> list[int]:
    generator = torch.Generator().manual_seed(settings.seed)
    logits = PROBABILITIES.log()
    return [choose_token(logits, settings, generator) for _ in range(count)]


def test_temperature_zero_takes_the_most_likely_token() -> None:
    assert set(_draws(SamplingSettings(temperature=0.0), 20)) == {1}


@pytest.mark.parametrize(("top_p", "kept"), [(1.0, {0, 1, 2, 3}), (0.9, {1, 2, 3}), (0.7, {1, 3}), (0.5, {1})])
def test_top_p_keeps_the_most_likely_tokens_until_their_mass_reaches_p(top_p: float, kept: set[int]) -> None:
    assert set(_draws(SamplingSettings(temperature=1.0, top_p=top_p, seed=3))) == kept


def test_temperature_one_draws_in_proportion() -> None:
    draws = _draws(SamplingSettings(temperature=1.0, top_p=1.0, seed=4), 4000)
    shares = torch.bincount(torch.tensor(draws), minlength=4).double() / len(draws)
    assert torch.allclose(shares, PROBABILITIES.double(), atol=0.03)


def test_the_same_seed_draws_the_same_tokens_and_another_seed_others() -> None:
    settings = SamplingSettings(temperature=1.0, top_p=1.0, seed=5)
    assert _draws(settings) == _draws(settings)
    assert _draws(settings) != _draws(SamplingSettings(temperature=1.0, top_p=1.0, seed=6))


@pytest.mark.parametrize("changes", [{"temperature": -0.1}, {"temperature": float("inf")}, {"top_p": 0.0},
                                     {"top_p": 1.5}])  # fmt: skip
def test_settings_out_of_range_are_refused(changes: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SamplingSettings(**changes)


def test_a_tiny_temperature_takes_the_most_likely_token() -> None:
    # Dividing the raw logits by 1e-310 overflowed to inf: the softmax was NaN and the draw failed.
    assert set(_draws(SamplingSettings(temperature=1e-310, top_p=1.0, seed=2), 20)) == {1}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_logits_holding_nan_or_inf_are_refused_by_name(temperature: float, bad: float) -> None:
    # A diverged model's logits: multinomial raised torch's 'invalid multinomial distribution'
    # and at temperature 0 argmax silently took the NaN's index.
    logits = PROBABILITIES.log()
    logits[2] = bad
    with pytest.raises(NonFiniteLogits, match=r"^the model's next-token logits hold 1 NaN or infinite values of 4$"):
        choose_token(logits, SamplingSettings(temperature=temperature), torch.Generator().manual_seed(0))
