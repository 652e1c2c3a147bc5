"""PSSA's CPU scan against its step-by-step definition, in float64 (the top-k read: test_models_pssa_native_memory.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from helpers.numerics import assert_close_to_scale

from engine.models.pssa import native
from engine.models.pssa import scan as scan_module
from engine.models.pssa.scan import TIME_BLOCK, pssa_scan

F64 = torch.float64


def _step_by_step(x, delta, A, B, C, h0):  # noqa: ANN001, ANN202
    """The recurrence as written: h_t = exp(delta_t A) h_{t-1} + delta_t x_t B_t, y_t = h_t C_t."""
    h = h0 if h0 is not None else x.new_zeros(x.shape[0], x.shape[2], A.shape[1])
    outputs = []
    for t in range(x.shape[1]):
        decay = torch.exp(delta[:, t, :, None] * A)  # (Bt, d, N)
        h = decay * h + (delta[:, t] * x[:, t])[:, :, None] * B[:, t, None, :]
        outputs.append((h * C[:, t, None, :]).sum(-1))
    return torch.stack(outputs, dim=1), h


def _inputs(
    length: int, seed: int, with_h0: bool = True, channels: int = 6, states: int = 5
) -> list[torch.Tensor | None]:
    """Random inputs with time constants from 0.02 to 20,000 tokens at delta = 1 (past the
    initialisation's 1.5..200 both ways) and steps delta up to 12: decays from exp(-600) (an
    underflow to 0) to 1 - 1e-4."""
    generator = torch.Generator().manual_seed(seed)
    batch = 3
    tau = torch.exp(torch.empty(channels, states, dtype=F64).uniform_(-4.0, 10.0, generator=generator))
    A = -1.0 / tau
    x = torch.randn(batch, length, channels, generator=generator, dtype=F64)
    delta = 12 * torch.rand(batch, length, channels, generator=generator, dtype=F64)
    B = torch.randn(batch, length, states, generator=generator, dtype=F64)
    C = torch.randn(batch, length, states, generator=generator, dtype=F64)
    h0 = torch.randn(batch, channels, states, generator=generator, dtype=F64) if with_h0 else None
    return [x, delta, A, B, C, h0]


def _torch_scan(*inputs):  # noqa: ANN002, ANN202
    return scan_module._CpuScan.apply(*inputs)


def _native_scan(*inputs):  # noqa: ANN002, ANN202
    if native.library(TIME_BLOCK) is None:
        pytest.skip("no C compiler: the native scan is not built")
    return scan_module._NativeScan.apply(*inputs)


def _assert_step_by_step(
    implementation: Callable[..., tuple[torch.Tensor, torch.Tensor]], inputs: list[torch.Tensor | None], seed: int
) -> None:
    """y, the last state and every input's gradient (under random output gradients drawn from
    seed) of `implementation` equal the step-by-step definition's."""
    x, _delta, _A, B, _C, _h0 = inputs
    batch, length, channels = x.shape
    states = B.shape[-1]
    leaves = [t.requires_grad_() for t in inputs if t is not None]
    generator = torch.Generator().manual_seed(seed)
    grad_y = torch.randn(batch, length, channels, generator=generator, dtype=F64)
    grad_h = torch.randn(batch, channels, states, generator=generator, dtype=F64)
    results = []
    for scan in (_step_by_step, implementation):
        y, h_last = scan(*inputs)
        gradients = torch.autograd.grad((y * grad_y).sum() + (h_last * grad_h).sum(), leaves)
        results.append((y, h_last, *gradients))
    for actual, expected in zip(results[1], results[0]):
        assert_close_to_scale(actual, expected)


@pytest.mark.parametrize("length", [1, TIME_BLOCK - 1, TIME_BLOCK, TIME_BLOCK + 3, 64])
@pytest.mark.parametrize("with_h0", [True, False])
@pytest.mark.parametrize("implementation", [_torch_scan, _native_scan])
def test_scan_equals_the_step_by_step_recurrence_forward_and_gradients(
    length: int, with_h0: bool, implementation: Callable[..., tuple[torch.Tensor, torch.Tensor]]
) -> None:
    _assert_step_by_step(implementation, _inputs(length, seed=length, with_h0=with_h0), seed=100 + length)


@pytest.mark.parametrize("states", [16, 21, 32])
def test_native_scan_sums_whole_groups_of_lanes_and_states(states: int) -> None:
    """g B and g C summed over the lanes by the transposing tree (LANES states at a time, the rest
    one by one) and channels in a full group and a partial one: the step-by-step definition's."""
    inputs = _inputs(TIME_BLOCK + 3, seed=states, channels=native.LANES + 4, states=states)
    _assert_step_by_step(_native_scan, inputs, seed=200 + states)


def test_scan_gradients_pass_gradcheck() -> None:
    inputs = _inputs(TIME_BLOCK + 2, seed=7)
    leaves = tuple(t.requires_grad_() for t in inputs)
    assert torch.autograd.gradcheck(lambda *a: pssa_scan(*a), leaves, eps=1e-6, atol=1e-7)


def test_scan_gradient_of_only_the_last_state() -> None:
    """The carry's gradient alone (no y gradient) reaches h0 through every decay."""
    inputs = _inputs(TIME_BLOCK * 2 + 1, seed=8)
    inputs[5].requires_grad_()
    _, h_last = pssa_scan(*inputs)
    (grad,) = torch.autograd.grad(h_last.sum(), inputs[5])
    x, delta, A = inputs[:3]
    assert_close_to_scale(grad, torch.exp(delta.sum(1)[:, :, None] * A))


def test_scan_without_gradient_equals_the_one_with(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a gradient one block's buffers are reused block after block: same numbers."""
    monkeypatch.setattr(scan_module, "TIME_BLOCK", 3)
    inputs = _inputs(11, seed=9)
    with torch.no_grad():
        y_plain, h_plain = pssa_scan(*inputs)
    inputs[0].requires_grad_()
    y, h_last = pssa_scan(*inputs)
    assert torch.equal(y.detach(), y_plain) and torch.equal(h_last.detach(), h_plain)


def test_scan_of_float32_inputs_keeps_a_float32_state() -> None:
    inputs = [t.float() for t in _inputs(5, seed=10)]
    y, h_last = pssa_scan(*inputs)
    expected_y, expected_h = _step_by_step(*[t.double() for t in inputs])
    assert y.dtype == torch.float32 and h_last.dtype == torch.float32
    torch.testing.assert_close(y.double(), expected_y, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(h_last.double(), expected_h, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("states", [5, 16])
def test_native_scan_is_bit_identical_at_any_thread_count(states: int) -> None:
    """Tasks own their outputs and the cross-task sums run in PyTorch in a fixed order."""
    if native.library(TIME_BLOCK) is None:
        pytest.skip("no C compiler: the native scan is not built")
    generator = torch.Generator().manual_seed(3)
    x, delta = torch.randn(4, 20, 40, generator=generator), torch.rand(4, 20, 40, generator=generator)
    B, C = torch.randn(4, 20, states, generator=generator), torch.randn(4, 20, states, generator=generator)
    A = -torch.rand(40, states, generator=generator)
    h0 = torch.randn(4, 40, states, generator=generator)
    results = []
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            leaves = [t.clone().requires_grad_() for t in (x, delta, A, B, C, h0)]
            y, h_last = scan_module._NativeScan.apply(*leaves)
            grads = torch.autograd.grad((y * y).sum() + h_last.sum(), leaves)
            results.append([y, h_last, *grads])
    finally:
        torch.set_num_threads(threads)
    for one, two in zip(*results):
        assert torch.equal(one, two)


def test_native_scan_leaves_the_callers_subnormal_numbers_alone() -> None:
    """The float32 scan flushes subnormal numbers in its own threads only: PyTorch's next
    operation still makes one (the floating-point mode is restored)."""
    if native.library(TIME_BLOCK) is None:
        pytest.skip("no C compiler: the native scan is not built")
    inputs = [t.float() for t in _inputs(TIME_BLOCK + 3, seed=11, channels=native.LANES, states=16)]
    leaves = [t.requires_grad_() for t in inputs]
    y, h_last = scan_module._NativeScan.apply(*leaves)
    torch.autograd.grad(y.sum() + h_last.sum(), leaves)
    tiny = torch.tensor([1e-38], dtype=torch.float32) * torch.tensor([1e-3], dtype=torch.float32)
    assert 0 < float(tiny) < torch.finfo(torch.float32).tiny
