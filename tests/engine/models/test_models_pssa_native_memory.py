"""PSSA's native memory code (`native_memory`: the ball map, the top-k read, the write rule) against
its PyTorch definitions in float64, its thread-count independence, and the PyTorch fallback."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from helpers.numerics import assert_close_to_scale

from engine.models.pssa import native, native_memory
from engine.models.pssa import read as read_module
from engine.models.pssa.config import PSSAConfig
from engine.models.pssa.memory import to_poincare_ball, torch_poincare_ball
from engine.models.pssa.model import PSSALM
from kernels.poincare import poincare_read_reference

F64 = torch.float64


@pytest.fixture(autouse=True)
def _needs_the_library() -> None:
    if native_memory.library() is None:
        pytest.skip("no C compiler: the native memory code is not built")


def _native_read(*inputs):  # noqa: ANN002, ANN202
    return read_module._NativeRead.apply(*inputs)


def _bank(slots: int, key_dim: int, value_dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    keys = torch_poincare_ball(2 * torch.randn(slots, key_dim, generator=generator, dtype=F64))
    return keys, torch.randn(slots, value_dim, generator=generator, dtype=F64)


@pytest.mark.parametrize(
    ("slots", "occupied", "top_k"),
    # Empty, fewer than k, exactly k, more than k of a small bank; then banks past one block of
    # SLOT_BLOCK slots, full and part full (free blocks, a part-filled block, padding).
    [(12, 0, 4), (12, 2, 4), (12, 4, 4), (12, 9, 4), (12, 12, 4), (150, 150, 5), (150, 70, 3), (200, 129, 7)],
)
@pytest.mark.parametrize("implementation", [read_module.torch_topk_read, _native_read])
def test_topk_read_equals_the_dense_reference(
    slots: int, occupied: int, top_k: int, implementation: Callable[..., torch.Tensor]
) -> None:
    keys, values = _bank(slots, 5, 7, seed=slots + occupied)
    generator = torch.Generator().manual_seed(occupied)
    q = torch_poincare_ball(2 * torch.randn(40, 5, generator=generator, dtype=F64)).requires_grad_()
    mask = torch.arange(slots) < occupied
    grad_m = torch.randn(40, 7, generator=generator, dtype=F64)
    results = []
    for read in (poincare_read_reference, implementation):
        m = read(q, keys, values, mask, 0.3, top_k)
        (grad,) = torch.autograd.grad((m * grad_m).sum(), q)
        results.append((m, grad))
    for actual, expected in zip(results[1], results[0]):
        assert_close_to_scale(actual, expected)
    if occupied == 0:
        assert torch.count_nonzero(results[1][0]) == 0 and torch.count_nonzero(results[1][1]) == 0


def test_native_read_takes_a_scattered_occupancy_and_queries_on_the_keys() -> None:
    """Free slots between occupied ones, and queries equal to keys (the argument clamped at its
    minimum, the gap at 0): the reference's values and gradients."""
    keys, values = _bank(70, 4, 3, seed=5)
    mask = torch.rand(70, generator=torch.Generator().manual_seed(6)) < 0.5
    q = torch.cat([keys[mask][:3], torch_poincare_ball(torch.randn(9, 4, dtype=F64))]).requires_grad_()
    results = []
    for read in (poincare_read_reference, _native_read):
        m = read(q, keys, values, mask, 0.2, 3)
        results.append((m, *torch.autograd.grad(m.square().sum(), q)))
    for actual, expected in zip(results[1], results[0]):
        assert_close_to_scale(actual, expected)


def test_native_read_gradcheck_float64() -> None:
    keys, values = _bank(80, 3, 4, seed=7)
    mask = torch.arange(80) < 75
    q = torch_poincare_ball(torch.randn(6, 3, dtype=F64)).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: _native_read(x, keys, values, mask, 0.5, 4), (q,))


def _queries(seed: int) -> torch.Tensor:
    """Rows from 1e-3 to 1e3 in size, a zero row, one past float32's square range."""
    generator = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-3, 3, 30, dtype=F64)[:, None]
    q = torch.randn(30, 7, generator=generator, dtype=F64) * scale
    q[4] = 0
    q[5] = 1e30
    return q


def test_native_ball_equals_the_torch_map_forward_and_gradient() -> None:
    q = _queries(0).requires_grad_()
    grad_out = torch.randn(30, 7, generator=torch.Generator().manual_seed(1), dtype=F64)
    results = []
    for ball in (torch_poincare_ball, to_poincare_ball):
        out = ball(q)
        results.append((out, *torch.autograd.grad((out * grad_out).sum(), q)))
    assert results[1][0].grad_fn is not None and "NativeBall" in type(results[1][0].grad_fn).__name__
    for actual, expected in zip(results[1], results[0]):
        assert_close_to_scale(actual, expected)


def test_native_ball_gradcheck_float64() -> None:
    q = torch.randn(5, 4, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(to_poincare_ball, (q,))


def test_native_memory_is_bit_identical_at_any_thread_count() -> None:
    """Each query (row) owns its outputs: the thread count changes no bit."""
    generator = torch.Generator().manual_seed(3)
    keys = torch_poincare_ball(torch.randn(300, 16, generator=generator))
    values = torch.randn(300, 24, generator=generator)
    mask = torch.arange(300) < 260
    raw = torch.randn(97, 16, generator=generator)
    results = []
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            leaf = raw.clone().requires_grad_()
            q = to_poincare_ball(leaf)
            m = _native_read(q, keys, values, mask, 0.1, 4)
            results.append([q, m, *torch.autograd.grad((m * m).sum() + q.sum(), leaf)])
    finally:
        torch.set_num_threads(threads)
    for one, two in zip(*results):
        assert torch.equal(one, two)


# A float64 model small enough to run in a moment, with a top-k read of a bank that fills up,
# overflows and is defended (write threshold 0: every chunk writes), over several chunks.
CONFIG = PSSAConfig(
    vocab_size=40, d_latent=24, d_state=4, d_mem_key=6, mem_capacity=10, chunk_len=5, depth=2,
    adapter_rank=3, mem_top_k=3, write_loss_threshold=0.0,
)  # fmt: skip


def _training_step(monkeypatch: pytest.MonkeyPatch, native_code: bool) -> list[torch.Tensor]:
    """Two updates of the float64 model (forward with writes, backward); the losses, carries,
    gradients and banks they leave."""
    with monkeypatch.context() as patch:
        if not native_code:
            patch.setattr(native_memory, "library", lambda: None)
            patch.setattr(native, "library", lambda time_block: None)
        torch.manual_seed(0)
        model = PSSALM(CONFIG).double().train()
        with torch.no_grad():
            for block in model.blocks:
                block.adapter_up.weight.normal_(0, 0.3)
                block.mlp_down.weight.normal_(0, 0.3)
        tokens = torch.randint(0, 40, (3, 23), generator=torch.Generator().manual_seed(1))
        outputs: list[torch.Tensor] = []
        carry = None
        for update in range(2):
            model.set_update(update * 7)
            loss, carry = model(tokens, tokens.roll(-1, dims=1), carry)
            grads = torch.autograd.grad(loss.sum(), list(model.parameters()))
            outputs += [loss, carry, *grads]
        for block in model.blocks:
            outputs += [block.bank.keys, block.bank.values, block.bank.confidence, block.bank.last_touched]
        assert all(block.bank.count == CONFIG.mem_capacity for block in model.blocks)
        return outputs


def test_model_with_native_code_equals_the_pytorch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scan, ball map, read and write rule native against all of them in PyTorch (the path of
    a host without a compiler, or NSCONSOLE_PSSA_NATIVE=0): losses, carries, gradients, banks."""
    if native.library(8) is None:
        pytest.skip("no C compiler: the native scan is not built")
    for actual, expected in zip(_training_step(monkeypatch, True), _training_step(monkeypatch, False)):
        if actual.is_floating_point():
            assert_close_to_scale(actual, expected)
        else:
            assert torch.equal(actual, expected)


def test_without_a_build_the_loader_gives_none(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # noqa: ANN001
    """NSCONSOLE_PSSA_NATIVE=0 asks for PyTorch outright; a source that does not compile warns and
    gives None (the caller's PyTorch path runs)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("NSCONSOLE_PSSA_NATIVE", "0")
    assert native.load("pssa_test", "void f(void) {}", {"f": []}, "test code") is None
    monkeypatch.setenv("NSCONSOLE_PSSA_NATIVE", "1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert native.load("pssa_test", "this is not C", {}, "test code") is None
    assert any("native test code did not build" in str(warning.message) for warning in caught)


def test_read_falls_back_to_pytorch_without_the_library(monkeypatch: pytest.MonkeyPatch) -> None:
    keys, values = _bank(12, 5, 7, seed=2)
    q = torch_poincare_ball(torch.randn(8, 5, dtype=F64))
    mask = torch.arange(12) < 9
    native_read = read_module.topk_read(q, keys, values, mask, 0.3, 4)
    monkeypatch.setattr(native_memory, "library", lambda: None)
    fallback = read_module.topk_read(q, keys, values, mask, 0.3, 4)
    assert fallback.grad_fn is None  # no autograd function: the PyTorch operations ran
    assert_close_to_scale(native_read, fallback)
