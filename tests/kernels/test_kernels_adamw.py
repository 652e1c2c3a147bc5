"""Flat AdamW: the Triton kernel against its reference, the reference against torch.optim.AdamW,
and the skip of a non-finite gradient norm."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import adamw
from kernels.adamw import adamw_step, adamw_step_reference, advance_step_
from kernels.grad_norms import segment_sq_sums

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HYPER = {"max_norm": 1.0, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}


SCALAR_DTYPES = {"step": torch.int64, "lr": torch.float32, "weight_decay": torch.float32, "grad_norm": torch.float64}


def _scalar(name: str, value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=SCALAR_DTYPES[name], device=DEVICE)


def _group(count: int, generator: torch.Generator) -> list[torch.Tensor]:
    """param, grad, exp_avg, exp_avg_sq of a group part-way through training."""
    def draw(scale: float) -> torch.Tensor:
        return (torch.randn(count, generator=generator) * scale).to(DEVICE)

    return [draw(1.0), draw(0.5), draw(0.05), draw(0.01).abs()]


def _scalars(step: int, grad_norm: float) -> dict[str, torch.Tensor]:
    names = ("step", "lr", "weight_decay", "grad_norm")
    return {name: _scalar(name, value) for name, value in zip(names, (step, 3e-3, 0.1, grad_norm))}


@pytest.mark.parametrize(
    ("count", "step", "norm"), [(1, 0, 0.3), (5003, 7, 4.5), (12289, 100_000, 0.999), (77, 3000, 1.5)]
)
def test_kernel_matches_reference(count: int, step: int, norm: float) -> None:
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
    step = torch.tensor(0)
    torch_param = param.double().clone().requires_grad_()
    optimizer = torch.optim.AdamW([torch_param], lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    scale = min(1.0, max_norm / (grad_norm + 1e-6)) if max_norm > 0 else 1.0
    for _ in range(3):
        adamw_step_reference(
            *reference, step=step, lr=torch.tensor(3e-3), weight_decay=torch.tensor(0.1),
            grad_norm=torch.tensor(grad_norm, dtype=torch.float64), max_norm=max_norm, beta1=0.9, beta2=0.95,
            eps=1e-8,
        )
        advance_step_(step, torch.tensor(grad_norm, dtype=torch.float64))
        torch_param.grad = grad.double() * scale
        optimizer.step()
    assert step.item() == 3
    torch.testing.assert_close(reference[0].double(), torch_param.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bad_norm", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("use_triton", [True, False])
def test_non_finite_norm_skips_everything(bad_norm: float, use_triton: bool) -> None:
    generator = torch.Generator().manual_seed(11)
    buffers = _group(4099, generator)
    buffers[1][17] = bad_norm  # the gradient that made the norm non-finite
    before = [t.clone() for t in buffers]
    scalars = _scalars(5, bad_norm)
    adamw_step(*buffers, **scalars, **HYPER, use_triton=use_triton)
    advance_step_(scalars["step"], scalars["grad_norm"])
    for got, want in zip(buffers, before):
        # Bit for bit (the gradient holds a NaN, which torch.equal never calls equal).
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert scalars["step"].item() == 5


def test_step_advances_on_finite_norm_only() -> None:
    step = _scalar("step", 41)
    advance_step_(step, _scalar("grad_norm", 2.5))
    advance_step_(step, _scalar("grad_norm", math.nan))
    assert step.item() == 42


def test_kernel_is_deterministic() -> None:
    generator = torch.Generator().manual_seed(5)
    buffers = _group(9001, generator)
    first, second = [t.clone() for t in buffers], [t.clone() for t in buffers]
    adamw_step(*first, **_scalars(3, 0.7), **HYPER, use_triton=True)
    adamw_step(*second, **_scalars(3, 0.7), **HYPER, use_triton=True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_rejects_mismatched_buffers() -> None:
    buffers = [torch.zeros(5, device=DEVICE) for _ in range(3)] + [torch.zeros(6, device=DEVICE)]
    with pytest.raises(ValueError, match="exp_avg_sq has 6 elements"):
        adamw_step(*buffers, **_scalars(0, 1.0), **HYPER)


@pytest.mark.parametrize("use_triton", [True, False])
def test_huge_finite_gradient_is_clipped_not_skipped(use_triton: bool) -> None:
    """Elements of 1e21 have squares beyond fp32 (the old fp32 norm was Inf and skipped the update):
    the float64 norm is finite, and the clipped update equals that of the same direction at norm 10."""
    generator = torch.Generator().manual_seed(21)
    count = 5003
    buffers = _group(count, generator)
    direction = buffers[1].clone()
    huge, modest = [t.clone() for t in buffers], [t.clone() for t in buffers]
    huge[1] = direction * 1e21
    modest[1] = direction * (10.0 / float(direction.double().norm()))
    whole = torch.tensor([0, count], device=DEVICE)
    for side in (huge, modest):
        norm = segment_sq_sums(side[1], whole, use_triton=use_triton).sum().sqrt()
        assert math.isfinite(norm.item()) and norm.item() > HYPER["max_norm"]
        scalars = _scalars(5, 0.0)
        scalars["grad_norm"] = norm
        adamw_step(*side, **scalars, **HYPER, use_triton=use_triton)
        advance_step_(scalars["step"], norm)
        assert scalars["step"].item() == 6, "a clipped update counts as a step"
    assert not torch.equal(huge[0], buffers[0]), "the update was skipped"
    for state in (0, 2, 3):  # param, exp_avg, exp_avg_sq
        assert torch.isfinite(huge[state]).all()
        torch.testing.assert_close(huge[state], modest[state], rtol=1e-5, atol=1e-7)


def _update_in_float64(buffers: list[torch.Tensor], step: int, beta: float) -> torch.Tensor:
    """The module docstring's parameter update, evaluated in float64 (norm below max_norm)."""
    param, grad, exp_avg, exp_avg_sq = (t.double().cpu() for t in buffers)
    lr, weight_decay, eps = 3e-3, 0.1, HYPER["eps"]
    t = step + 1
    correction = -math.expm1(t * math.log(beta))
    exp_avg = beta * exp_avg + (1 - beta) * grad
    exp_avg_sq = beta * exp_avg_sq + (1 - beta) * grad * grad
    return param * (1 - lr * weight_decay) - lr * (exp_avg / correction) / ((exp_avg_sq / correction).sqrt() + eps)


@pytest.mark.parametrize("use_triton", [True, False])
def test_step_counter_is_exact_past_2_pow_24(use_triton: bool) -> None:
    """An fp32 counter stops at 2^24 (2^24 + 1 rounds back to it); the int64 one goes on, and the
    bias corrections at such a count match float64's. beta = 1 - 2^-24 keeps 1 - beta^t near 0.63
    there, so a wrong count or a mangled read of it would show."""
    beta = 1 - 2**-24
    hyper = dict(HYPER, beta1=beta, beta2=beta)
    step = _scalar("step", 2**24)
    for _ in range(3):
        advance_step_(step, _scalar("grad_norm", 0.5))
    assert step.item() == 2**24 + 3
    generator = torch.Generator().manual_seed(24)
    buffers = _group(4099, generator)
    expected = _update_in_float64(buffers, 2**24 + 3, beta)
    scalars = _scalars(2**24 + 3, 0.5)
    adamw_step(*buffers, **scalars, **hyper, use_triton=use_triton)
    torch.testing.assert_close(buffers[0].double().cpu(), expected, rtol=1e-6, atol=1e-7)


def test_scalars_of_the_wrong_dtype_are_refused() -> None:
    """An fp32 step or norm would bring the 2^24 stop and the overflowing norm back."""
    buffers = [torch.zeros(5, device=DEVICE) for _ in range(4)]
    scalars = _scalars(0, 1.0)
    scalars["step"] = torch.tensor(0.0, device=DEVICE)
    for use_triton in (True, False):
        with pytest.raises(ValueError, match="step must be a 0-d torch.int64 tensor"):
            adamw_step(*[t.clone() for t in buffers], **scalars, **HYPER, use_triton=use_triton)


@pytest.mark.parametrize(
    ("max_norm", "step", "norm", "weight_decay"),
    [(1.0, 0, 0.3, 0.1), (1.0, 5, 7.5, 0.0), (0.0, 123_456, 2.0, 0.01), (0.5, 2**25, 1e300, 0.1),
     (1.0, 3, math.nan, 0.1), (1.0, 3, math.inf, 0.1)],
)
def test_the_cpu_s_in_place_step_has_the_reference_s_bits(
    max_norm: float, step: int, norm: float, weight_decay: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU trainer's step (`adamw_step` off CUDA) is the reference's arithmetic in place: every
    bit of param, grad and moments equal, clipped or not, skipped or not (a CPU line's rows and
    checkpoints do not change with it)."""
    generator = torch.Generator().manual_seed(step)
    buffers = [tensor.cpu() for tensor in _group(100_003, generator)]
    scalars = {
        "step": torch.tensor(step, dtype=torch.int64), "lr": torch.tensor(3e-3, dtype=torch.float32),
        "weight_decay": torch.tensor(weight_decay, dtype=torch.float32),
        "grad_norm": torch.tensor(norm, dtype=torch.float64),
    }
    hyper = {**HYPER, "max_norm": max_norm}
    reference = [tensor.clone() for tensor in buffers]
    adamw_step_reference(*reference, **scalars, **hyper)

    def not_on_the_cpu(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the CPU took the reference's temporaries")

    monkeypatch.setattr(adamw, "adamw_step_reference", not_on_the_cpu)
    adamw.adamw_step(*buffers, **scalars, **hyper, use_triton=False)
    for got, expected in zip(buffers, reference, strict=True):
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
