"""Comparisons of computed tensors against their definitions."""

from __future__ import annotations

import torch


def assert_close_to_scale(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-12) -> None:
    """Within rtol of the expected tensor's largest magnitude, elementwise."""
    actual, expected = actual.detach(), expected.detach()
    scale = float(expected.abs().max()) or 1.0
    assert float((actual - expected).abs().max()) <= rtol * scale, (actual - expected).abs().max()
