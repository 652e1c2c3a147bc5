"""The hippocampal pool read: the explicit biased softmax against a naive loop, flex against explicit."""

from __future__ import annotations

import math

import pytest
import torch

from engine.models.ns.pool_read import pool_read_explicit, pool_read_flex


def random_read_inputs(batch=2, heads=3, length=11, head_dim=4, dtype=torch.float64, device="cpu", seed=0):
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).to(device, dtype)

    q, k, v = (normal(batch, heads, length, head_dim) for _ in range(3))
    log_tag = torch.nn.functional.logsigmoid(normal(batch, heads, length)).to(torch.float32)
    steps = torch.rand(batch, heads, length, generator=generator, dtype=torch.float64) * 2
    clock = steps.cumsum(dim=-1).to(device, torch.float32)
    rate = torch.tensor([0.5, 0.05, 0.002][:heads], dtype=torch.float32, device=device)
    if dtype == torch.float64:
        log_tag, clock, rate = log_tag.double(), clock.double(), rate.double()
    return q, k, v, log_tag, clock, rate


def naive_read(q, k, v, log_tag, clock, rate):
    batch, heads, length, head_dim = q.shape
    out = torch.zeros_like(v)
    for b in range(batch):
        for h in range(heads):
            for t in range(length):
                scores = torch.stack([
                    q[b, h, t] @ k[b, h, s] / math.sqrt(head_dim)
                    + log_tag[b, h, s]
                    - rate[h] * (clock[b, h, t] - clock[b, h, s])
                    for s in range(t + 1)
                ])  # fmt: skip
                weights = torch.softmax(scores, dim=0)
                out[b, h, t] = sum(weights[s] * v[b, h, s] for s in range(t + 1))
    return out


def test_explicit_read_equals_a_naive_loop():
    inputs = random_read_inputs()
    torch.testing.assert_close(pool_read_explicit(*inputs), naive_read(*inputs), rtol=1e-12, atol=1e-12)


def test_a_clock_offset_shared_by_a_row_cancels():
    q, k, v, log_tag, clock, rate = random_read_inputs()
    shifted = clock + torch.tensor([[[3.0]], [[-7.5]]], dtype=torch.float64)  # per row
    torch.testing.assert_close(
        pool_read_explicit(q, k, v, log_tag, shifted, rate), pool_read_explicit(q, k, v, log_tag, clock, rate)
    )


def test_explicit_read_gradients_match_finite_differences():
    inputs = [t.requires_grad_() for t in random_read_inputs(batch=1, heads=2, length=5, head_dim=2)]
    assert torch.autograd.gradcheck(pool_read_explicit, inputs)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_read_is_as_close_to_float64_as_the_explicit_read(dtype):
    """Both reads in DTYPE against the explicit read in float64: flex may not be much worse.

    In bf16 neither read is close to float64 in every gradient (the clock rate's gradient sums
    bf16 residues times clock spans of thousands), so the bound is relative to the explicit read's
    own error in the same precision, not an absolute tolerance.
    """
    inputs = random_read_inputs(batch=2, heads=3, length=300, head_dim=64, dtype=dtype, device="cuda")
    # Clocks of about 6,000 ticks (past a 4K row's): flex reads the bias lambda c_s in fp32, which
    # rounds at 6e-8 of its size (about 2e-4 of a logit here).
    inputs[4].mul_(20.0)
    grad_out = torch.randn(inputs[2].shape, device="cuda", dtype=torch.float64)
    results = {}
    for name, read, cast in (
        ("reference", pool_read_explicit, torch.float64),
        ("explicit", pool_read_explicit, None),
        ("flex", pool_read_flex, None),
    ):
        leaves = [(t.detach().to(cast) if cast else t.detach().clone()).requires_grad_() for t in inputs]
        out = read(*leaves)
        out.backward(grad_out.to(out.dtype))
        results[name] = [out.detach().double()] + [t.grad.double() for t in leaves]
    names = ("out", "q", "k", "v", "log_tag", "clock", "rate")
    floor = 5e-2 if dtype == torch.bfloat16 else 1e-3
    for index, name in enumerate(names):
        reference = results["reference"][index]
        scale = reference.abs().max().clamp_min(1e-6)
        explicit_error = float((results["explicit"][index] - reference).abs().max() / scale)
        flex_error = float((results["flex"][index] - reference).abs().max() / scale)
        bound = max(2 * explicit_error, floor)
        assert flex_error < bound, (
            f"{name}: flex error {flex_error:.2e}, explicit {explicit_error:.2e} (dtype {dtype})"
        )
