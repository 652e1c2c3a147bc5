"""Flat AdamW: the Triton kernel against its reference, the reference against torch.optim.AdamW,
and the skip of a non-finite gradient norm."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.adamw import adamw_step, adamw_step_reference, advance_step_

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HYPER = {"max_norm": 1.0, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}


def _scalar(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32, device=DEVICE)


def _group(count: int, generator: torch.Generator) -> list[torch.Tensor]:
    """param, grad, exp_avg, exp_avg_sq of a group part-way through training."""
    def draw(scale: float) -> torch.Tensor:
        return (torch.randn(count, generator=generator) * scale).to(DEVICE)

    return [draw(1.0), draw(0.5), draw(0.05), draw(0.01).abs()]


def _scalars(step: float, grad_norm: float) -> dict[str, torch.Tensor]:
    names = ("step", "lr", "weight_decay", "grad_norm")
    return {name: _scalar(value) for name, value in zip(names, (step, 3e-3, 0.1, grad_norm))}


@pytest.mark.parametrize(
    ("count", "step", "norm"), [(1, 0.0, 0.3), (5003, 7.0, 4.5), (12289, 1e5, 0.999), (77, 3e3, 1.5)]
)
def test_kernel_matches_reference(count: int, step: float, norm: float) -> None:
    generator = torch.Generator().manual_seed(count)
    buffers = _group(count, generator)
    kernel_side = [t.clone() for t in buffers]
    reference_side = [t.clone() for t in buffers]
    adamw_step(*kernel_side, **_scalars(step, norm), **HYPER, use_triton=True)
    adamw_step_reference(*reference_side, **_scalars(step, norm), **HYPER)
    # Every element moved (an unwritten one would still equal its start).
    assert not torch.equal(kernel_side[0], buffers[0]) or count == 0
    for got, want in zip(kernel_side, reference_side):
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7)
    assert torch.equal(kernel_side[1], buffers[1]), "the gradient is read, never written"


@pytest.mark.parametrize("max_norm", [1.0, 0.0])
def test_reference_matches_torch_adamw(max_norm: float) -> None:
    """The reference equals torch.optim.AdamW (fp64) fed the clipped gradient."""
    generator = torch.Generator().manual_seed(3)
    param, grad, _, _ = (t.cpu() for t in _group(101, generator))
    grad_norm = float(grad.norm()) * 4  # above max_norm, so the clip acts
    reference = [param.clone(), grad.clone(), torch.zeros(101), torch.zeros(101)]
    step = torch.tensor(0.0)
    torch_param = param.double().clone().requires_grad_()
    optimizer = torch.optim.AdamW([torch_param], lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    scale = min(1.0, max_norm / (grad_norm + 1e-6)) if max_norm > 0 else 1.0
    for _ in range(3):
        adamw_step_reference(
            *reference, step=step, lr=torch.tensor(3e-3), weight_decay=torch.tensor(0.1),
            grad_norm=torch.tensor(grad_norm), max_norm=max_norm, beta1=0.9, beta2=0.95, eps=1e-8,
        )
        advance_step_(step, torch.tensor(grad_norm))
        torch_param.grad = grad.double() * scale
        optimizer.step()
    assert step.item() == 3.0
    torch.testing.assert_close(reference[0].double(), torch_param.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bad_norm", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("use_triton", [True, False])
def test_non_finite_norm_skips_everything(bad_norm: float, use_triton: bool) -> None:
    generator = torch.Generator().manual_seed(11)
    buffers = _group(4099, generator)
    buffers[1][17] = bad_norm  # the gradient that made the norm non-finite
    before = [t.clone() for t in buffers]
    scalars = _scalars(5.0, bad_norm)
    adamw_step(*buffers, **scalars, **HYPER, use_triton=use_triton)
    advance_step_(scalars["step"], scalars["grad_norm"])
    for got, want in zip(buffers, before):
        # Bit for bit (the gradient holds a NaN, which torch.equal never calls equal).
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert scalars["step"].item() == 5.0


def test_step_advances_on_finite_norm_only() -> None:
    step = _scalar(41.0)
    advance_step_(step, _scalar(2.5))
    advance_step_(step, _scalar(math.nan))
    assert step.item() == 42.0


def test_kernel_is_deterministic() -> None:
    generator = torch.Generator().manual_seed(5)
    buffers = _group(9001, generator)
    first, second = [t.clone() for t in buffers], [t.clone() for t in buffers]
    adamw_step(*first, **_scalars(3.0, 0.7), **HYPER, use_triton=True)
    adamw_step(*second, **_scalars(3.0, 0.7), **HYPER, use_triton=True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_rejects_mismatched_buffers() -> None:
    buffers = [torch.zeros(5, device=DEVICE) for _ in range(3)] + [torch.zeros(6, device=DEVICE)]
    with pytest.raises(ValueError, match="exp_avg_sq has 6 elements"):
        adamw_step(*buffers, **_scalars(0.0, 1.0), **HYPER)
