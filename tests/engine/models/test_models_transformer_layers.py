"""Shared layers (engine/models/common.py): RMSNorm, RoPE, sinusoidal positions, SwiGLU."""

from __future__ import annotations

import math

import pytest
import torch

from engine.models.common import RMSNorm, RotaryEmbedding, SwiGLU, sinusoidal_positions


def test_rms_norm_scale_offset_and_dtypes() -> None:
    norm = RMSNorm(4, eps=0.0, offset=True)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
        norm.bias.copy_(torch.tensor([0.5, 0.0, 0.0, -0.5]))
    x = torch.tensor([[1.0, -1.0, 1.0, -1.0]])  # rms 1
    assert torch.equal(norm(x), torch.tensor([[1.5, -2.0, 3.0, -4.5]]))
    assert norm(x.bfloat16()).dtype == torch.bfloat16
    # float64 stays float64 all the way (gradient checks rely on it).
    wide = torch.tensor([[1.0, 1.0 + 1e-12, 1.0, 1.0]], dtype=torch.float64)
    normed = RMSNorm(4, eps=0.0).double()(wide)
    assert normed.dtype == torch.float64
    assert normed[0, 1] > normed[0, 0]  # the 1e-12 survives: no float32 round trip
    assert RMSNorm(4).bias is None and sum(p.numel() for p in RMSNorm(4).parameters()) == 4


def test_sinusoidal_table_follows_the_formula() -> None:
    table = sinusoidal_positions(5, 6, base=10_000.0)
    for position in range(5):
        for pair in range(3):
            angle = position / 10_000 ** (2 * pair / 6)
            assert table[position, 2 * pair] == pytest.approx(math.sin(angle), abs=1e-7)
            assert table[position, 2 * pair + 1] == pytest.approx(math.cos(angle), abs=1e-7)
    with pytest.raises(ValueError, match="even width"):
        sinusoidal_positions(3, 5)


def test_rope_scores_depend_only_on_relative_position() -> None:
    rope = RotaryEmbedding(8, base=100.0)
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 1, 8, generator=generator, dtype=torch.float64).expand(1, 1, 20, 8)
    k = torch.randn(1, 1, 1, 8, generator=generator, dtype=torch.float64).expand(1, 1, 20, 8)
    rq, rk = rope(q.contiguous()), rope(k.contiguous())
    scores = rq[0, 0] @ rk[0, 0].T  # (20, 20): same vectors at every position
    for shift in (1, 5, 11):
        assert torch.allclose(scores[3, 1], scores[3 + shift, 1 + shift], atol=1e-12)
    assert torch.allclose(rq.norm(dim=-1), q.norm(dim=-1), atol=1e-12)  # a rotation


def test_rope_offset_continues_the_positions() -> None:
    rope = RotaryEmbedding(4)
    x = torch.randn(2, 3, 10, 4, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(rope(x[:, :, 6:], offset=6), rope(x)[:, :, 6:], atol=1e-6)


def test_swiglu_is_down_of_silu_gate_times_up() -> None:
    ffn = SwiGLU(3, 5)
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(2))
    expected = ffn.down.weight @ (torch.nn.functional.silu(ffn.gate.weight @ x.T) * (ffn.up.weight @ x.T))
    assert torch.allclose(ffn(x), expected.T, atol=1e-6)
    assert sum(p.numel() for p in ffn.parameters()) == 3 * 3 * 5
