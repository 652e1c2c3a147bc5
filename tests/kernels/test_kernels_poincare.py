"""Poincare memory read: the reference checked by gradcheck and by hand, the Triton kernels
against the reference (top-k and whole bank, free slots, an empty bank), poisoned outputs."""

from __future__ import annotations

import math

import pytest
import torch

from kernels._dispatch import poison
from kernels.poincare import poincare_read, poincare_read_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _poisoned_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(poison, "enabled", True)


def _in_ball(count: int, dim: int, generator: torch.Generator) -> torch.Tensor:
    """Points at random directions and radii up to 0.9, in fp64."""
    direction = torch.randn(count, dim, generator=generator, dtype=torch.float64)
    radius = torch.rand(count, 1, generator=generator, dtype=torch.float64) * 0.9
    return direction / direction.norm(dim=1, keepdim=True) * radius


def _bank(queries: int, slots: int, key_dim: int, value_dim: int, free: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    q = _in_ball(queries, key_dim, generator)
    keys = _in_ball(slots, key_dim, generator)
    values = torch.randn(slots, value_dim, generator=generator, dtype=torch.float64)
    occupied = torch.ones(slots, dtype=torch.bool)
    occupied[torch.randperm(slots, generator=generator)[:free]] = False
    return q.to(DEVICE), keys.to(DEVICE), values.to(DEVICE), occupied.to(DEVICE)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def test_reference_by_hand() -> None:
    """One query, two occupied slots of three, top 2: the formula written out."""
    q = torch.tensor([[0.3, 0.0]], dtype=torch.float64)
    keys = torch.tensor([[0.0, 0.5], [0.9, 0.0], [0.31, 0.0]], dtype=torch.float64)
    values = torch.tensor([[1.0], [2.0], [100.0]], dtype=torch.float64)
    occupied = torch.tensor([True, True, False])

    def distance(k: torch.Tensor) -> float:
        gap = float(((q[0] - k) ** 2).sum())
        return math.acosh(1 + 2 * gap / ((1 - float((q[0] ** 2).sum())) * (1 - float((k**2).sum()))))

    logits = torch.tensor([-distance(keys[0]) / 0.5, -distance(keys[1]) / 0.5], dtype=torch.float64)
    want = (torch.softmax(logits, 0)[:, None] * values[:2]).sum(0, keepdim=True)
    got = poincare_read_reference(q, keys, values, occupied, tau=0.5, top_k=2)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("top_k", [0, 3])
def test_reference_gradcheck(top_k: int) -> None:
    q, keys, values, occupied = (t.cpu() for t in _bank(4, 9, 3, 2, free=2, seed=1))
    q.requires_grad_()

    def read(query: torch.Tensor) -> torch.Tensor:
        return poincare_read_reference(query, keys, values, occupied, 0.3, top_k)

    assert torch.autograd.gradcheck(read, (q,))


@pytest.mark.parametrize(
    ("queries", "slots", "key_dim", "value_dim", "top_k", "free"),
    [(7, 13, 5, 3, 4, 3), (9, 70, 33, 17, 0, 10), (6, 9, 4, 5, 4, 7), (5, 130, 8, 5, 3, 0),
     (3, 11, 3, 6, 0, 0)],
)
def test_kernel_matches_reference(queries, slots, key_dim, value_dim, top_k, free) -> None:
    q, keys, values, occupied = _bank(queries, slots, key_dim, value_dim, free, seed=slots)
    generator = torch.Generator().manual_seed(2)
    grad_m = torch.randn(queries, value_dim, generator=generator, dtype=torch.float64).to(DEVICE)
    q32 = q.float().requires_grad_()
    got = poincare_read(q32, keys.float(), values.float(), occupied, 0.3, top_k, use_triton=True)
    (got * grad_m.float()).sum().backward()
    q64 = q.clone().requires_grad_()
    want = poincare_read_reference(q64, keys, values, occupied, 0.3, top_k)
    (want * grad_m).sum().backward()
    assert not got.isnan().any() and not q32.grad.isnan().any()
    assert _relative_error(got, want) < 1e-5
    assert _relative_error(q32.grad, q64.grad) < 1e-4


@pytest.mark.parametrize("top_k", [4, 0])
@pytest.mark.parametrize("use_triton", [True, False])
def test_empty_bank_reads_zeros(use_triton: bool, top_k: int) -> None:
    q, keys, values, occupied = _bank(4, 6, 3, 5, free=6, seed=3)
    q = q.float().requires_grad_()
    m = poincare_read(q, keys.float(), values.float(), occupied, 0.1, top_k, use_triton=use_triton)
    assert torch.equal(m, torch.zeros(4, 5, device=DEVICE))
    m.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))


def test_query_on_a_key_stays_finite() -> None:
    """A query equal to a key sits at the arccosh clamp: value and gradient stay finite."""
    q, keys, values, occupied = _bank(2, 5, 4, 3, free=0, seed=4)
    q = keys[:2].float().clone().requires_grad_()
    m = poincare_read(q, keys.float(), values.float(), occupied, 0.1, 0, use_triton=True)
    m.sum().backward()
    assert torch.isfinite(m).all() and torch.isfinite(q.grad).all()


@pytest.mark.parametrize("top_k", [2, 0])
def test_no_queries(top_k: int) -> None:
    _, keys, values, occupied = _bank(1, 5, 3, 4, free=1, seed=6)
    q = torch.zeros(0, 3, device=DEVICE, requires_grad=True)
    m = poincare_read(q, keys.float(), values.float(), occupied, 0.1, top_k, use_triton=True)
    assert m.shape == (0, 4)
    m.sum().backward()
    assert q.grad.shape == (0, 3)
