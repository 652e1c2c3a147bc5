"""The NS dendritic chunked scan's Triton kernels (kernels/ssd_scan.py) against the engine's
chunked_scan autograd: y, the last state and every gradient (ragged rows, groups shared by heads,
a carried state or none, the last state's gradient or none, many chunks passing the state, a loss
of the last state alone), exponents after a boundary flush, bitwise repeatability, clear errors,
and on CUDA the ns-2b shape under bf16 autocast."""

from __future__ import annotations

import pytest
import torch

from engine.models.ns.scan import chunked_scan
from kernels._dispatch import poison
from kernels.ssd_scan import _pass_states, ssd_scan

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ("y", "last", "u", "dt", "A", "B", "C", "state0")


@pytest.fixture(autouse=True)
def _poisoned_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(poison, "enabled", True)


def _inputs(batch, length, heads, head_dim, groups, state, dtype=torch.float64, seed=0, device=DEVICE, dt_scale=0.5):
    """u, dt, A, B, C, state0 as the dendritic layer makes them (dt >= 0, A < 0), and the outer
    gradients of y and of the last state."""
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    u = normal(batch, length, heads, head_dim)
    dt = torch.rand(batch, length, heads, generator=generator, dtype=torch.float64) * dt_scale
    A = -torch.rand(heads, generator=generator, dtype=torch.float64) * 2 - 0.05
    B, C = normal(batch, length, groups, state), normal(batch, length, groups, state)
    state0 = normal(batch, heads, state, head_dim)
    grad_y, grad_last = normal(batch, length, heads, head_dim), normal(batch, heads, state, head_dim)
    return [t.to(device, dtype) for t in (u, dt, A, B, C, state0, grad_y, grad_last)]


def _run(scan, u, dt, A, B, C, state0, grad_y, grad_last, chunk_len, with_state0=True, with_last=True):
    """y, the last state and the gradients of u, dt, A, B, C, state0 of sum(y grad_y) (+ sum(last grad_last))."""
    leaves = [t.detach().clone().requires_grad_() for t in (u, dt, A, B, C, state0)]
    y, last = scan(*leaves[:5], chunk_len, leaves[5] if with_state0 else None)
    loss = (y * grad_y.to(y.dtype)).sum()
    if with_last:
        loss = loss + (last * grad_last.to(last.dtype)).sum()
    loss.backward()
    return [y.detach(), last.detach()] + [leaf.grad for leaf in leaves]


def _relative_error(got: torch.Tensor | None, want: torch.Tensor | None) -> float:
    if want is None:
        assert got is None or not got.any()
        return 0.0
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def _assert_close(got: list, want: list, tolerance: float) -> None:
    errors = {name: _relative_error(g, w) for name, g, w in zip(NAMES, got, want)}
    assert max(errors.values()) < tolerance, errors


@pytest.mark.parametrize(
    ("batch", "length", "heads", "head_dim", "groups", "state", "chunk_len", "with_state0", "with_last"),
    [
        (2, 64, 4, 16, 1, 16, 16, True, True),  # whole chunks, one group for every head
        (2, 37, 4, 8, 2, 5, 16, True, True),  # a ragged row, groups < heads, P and N padded
        (1, 50, 3, 12, 3, 20, 32, False, True),  # no carried state, one head a group
        (2, 40, 6, 16, 2, 16, 16, True, False),  # no gradient of the last state
        (1, 9, 2, 16, 1, 16, 16, False, False),  # shorter than a chunk
        (2, 90, 4, 8, 2, 16, 16, True, True),  # six chunks passing the state, carried in and out
        (1, 160, 2, 16, 1, 8, 16, False, True),  # ten chunks from a zero state
    ],
)
def test_kernels_match_the_reference(batch, length, heads, head_dim, groups, state, chunk_len, with_state0, with_last):
    dtype, tolerance = (torch.float32, 1e-4) if DEVICE == "cuda" else (torch.float64, 1e-10)
    tensors = _inputs(batch, length, heads, head_dim, groups, state, dtype)
    got = _run(ssd_scan, *tensors, chunk_len, with_state0, with_last)
    want = _run(chunked_scan, *tensors, chunk_len, with_state0, with_last)
    assert got[0].dtype == want[0].dtype and got[1].dtype == want[1].dtype
    _assert_close(got, want, tolerance)


def test_float32_matches_a_float64_reference():
    tensors = _inputs(2, 70, 4, 16, 2, 16, torch.float64)
    got = _run(ssd_scan, *(t.float() for t in tensors), 32)
    want = _run(chunked_scan, *tensors, 32)
    _assert_close(got, want, 2e-5)


def test_a_scan_continues_from_its_first_parts_last_state():
    """Seven chunks in one call equal three, then four from the first call's last state (a cut inside a chunk)."""
    u, dt, A, B, C, state0, _, _ = _inputs(1, 100, 2, 16, 1, 16, torch.float64 if DEVICE == "cpu" else torch.float32)
    y, last = ssd_scan(u, dt, A, B, C, 16, state0)
    y1, last1 = ssd_scan(u[:, :37], dt[:, :37], A, B[:, :37], C[:, :37], 16, state0)
    y2, last2 = ssd_scan(u[:, 37:], dt[:, 37:], A, B[:, 37:], C[:, 37:], 16, last1)
    tolerance = 1e-12 if DEVICE == "cpu" else 1e-5
    assert _relative_error(torch.cat([y1, y2], 1), y) < tolerance
    assert _relative_error(last2, last) < tolerance


def test_gradients_of_the_last_state_alone():
    """A loss of the last state only (y's gradient None, as a layer whose outputs are unused gives
    it): every input's gradient flows back through the chunks' passed states alone."""
    dtype, tolerance = (torch.float32, 1e-4) if DEVICE == "cuda" else (torch.float64, 1e-10)
    tensors = _inputs(2, 75, 4, 8, 2, 16, dtype, seed=5)
    grads = []
    for scan in (ssd_scan, chunked_scan):
        leaves = [t.detach().clone().requires_grad_() for t in tensors[:6]]
        _, last = scan(*leaves[:5], 16, leaves[5])
        (last * tensors[7]).sum().backward()
        grads.append([leaf.grad for leaf in leaves])
    errors = {name: _relative_error(g, w) for name, g, w in zip(NAMES[2:], *grads)}
    assert max(errors.values()) < tolerance, errors


def test_decays_after_a_boundary_flush_keep_their_precision():
    """A first step that flushes the compartments (a_1 = -5000) and small steps after it: an fp32
    running sum near -5000 would put a relative error of about 5e-4 into the later decays of the
    chunk (its ulp, summed over the steps); the kernels' fp64 running sum keeps y at fp32's precision."""
    u, dt, A, B, C, state0, grad_y, grad_last = _inputs(1, 64, 2, 16, 1, 16, torch.float64, dt_scale=1e-3)
    A = torch.full_like(A, -1.0)
    dt[:, 0] = 5000.0
    dt[:, 1:] = dt[:, 1:] + 1e-3
    want_y, want_last = chunked_scan(u, dt, A, B, C, 64, state0)
    got_y, got_last = ssd_scan(*(t.float() for t in (u, dt, A, B, C)), 64, state0.float())
    assert _relative_error(got_y, want_y) < 1e-5
    assert _relative_error(got_last, want_last) < 1e-5


def test_two_backward_calls_give_the_same_bits():
    dtype = torch.float32
    tensors = _inputs(2, 45, 4, 16, 2, 16, dtype, seed=3)
    first = _run(ssd_scan, *tensors, 16)
    second = _run(ssd_scan, *tensors, 16)
    for name, a, b in zip(NAMES, first, second):
        assert torch.equal(a, b), name


def test_strided_views_as_the_layer_passes_them():
    """u, B and C are views of one in_proj output (rows strided over the whole projection)."""
    dtype, tolerance = (torch.float32, 1e-4) if DEVICE == "cuda" else (torch.float64, 1e-10)
    u, dt, A, B, C, state0, grad_y, grad_last = _inputs(2, 33, 4, 8, 2, 16, dtype)
    projected = torch.cat([u.flatten(2), B.flatten(2), C.flatten(2), dt], dim=-1).requires_grad_()
    parts = projected.split([32, 32, 32, 4], dim=-1)
    views = parts[0].view(2, 33, 4, 8), parts[3], A, parts[1].view(2, 33, 2, 16), parts[2].view(2, 33, 2, 16)
    assert not views[0].is_contiguous()
    y, last = ssd_scan(*views, 16, state0)
    ((y * grad_y).sum() + (last * grad_last).sum()).backward()
    want = _run(chunked_scan, u, dt, A, B, C, state0, grad_y, grad_last, 16)
    want_projected = torch.cat([want[2].flatten(2), want[5].flatten(2), want[6].flatten(2), want[3]], dim=-1)
    _assert_close([y, last, projected.grad], [want[0], want[1], want_projected], tolerance)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"chunk_len": 24}, "chunk_len must be a power of two >= 16"),
        ({"chunk_len": 8}, "chunk_len must be a power of two >= 16"),
        ({"A": torch.zeros(3)}, r"A must be \(H,\)"),
        ({"B": torch.zeros(1, 20, 3, 4)}, "H=4 is not a multiple of G=3"),
        ({"state0": torch.zeros(1, 4, 5, 8)}, r"state0 must be \(Bt, H, N, P\)"),
        ({"dt": torch.zeros(1, 20, 3)}, r"dt must be \(Bt, T, H\)"),
    ],
)
def test_bad_arguments_are_one_clear_error(change, message):
    arguments = {"u": torch.zeros(1, 20, 4, 8), "dt": torch.zeros(1, 20, 4), "A": -torch.ones(4),
                 "B": torch.zeros(1, 20, 2, 4), "C": torch.zeros(1, 20, 2, 4), "chunk_len": 16, "state0": None}
    arguments.update(change)
    if "B" in change:
        arguments["C"] = arguments["B"]
    with pytest.raises(ValueError, match=message):
        ssd_scan(**{name: t.to(DEVICE) if isinstance(t, torch.Tensor) else t for name, t in arguments.items()})


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("with_start", [False, True])
def test_the_state_pass_with_and_without_prefetch_walks_the_chunks_alike(reverse, with_start):
    """The pass between chunks, alone: every tile, warps and prefetch setting the bench sweeps
    gives the recurrence's entering states and last state, and the same bits as each other."""
    generator = torch.Generator().manual_seed(3)
    batch, heads, chunks, state, head_dim = 2, 3, 5, 8, 16  # 128-element states: tiles of 32 split them
    own = torch.randn(batch, heads, chunks, state, head_dim, generator=generator, dtype=torch.float64)
    totals = -torch.rand(batch, heads, chunks, generator=generator, dtype=torch.float64)
    start = torch.randn(batch, heads, state, head_dim, generator=generator, dtype=torch.float64) if with_start else None
    running = start.clone() if with_start else torch.zeros(batch, heads, state, head_dim, dtype=torch.float64)
    want = torch.empty_like(own)
    for chunk in reversed(range(chunks)) if reverse else range(chunks):
        want[:, :, chunk] = running
        running = totals[:, :, chunk, None, None].exp() * running + own[:, :, chunk]
    results = []
    for block, prefetch in ((32, False), (32, True), (1024, True)):
        states, end = own.clone().to(DEVICE), torch.empty(batch, heads, state, head_dim, dtype=torch.float64, device=DEVICE)
        _pass_states(states, totals.to(DEVICE), None if start is None else start.to(DEVICE), end, reverse=reverse,
                     block=block, prefetch=prefetch)
        torch.testing.assert_close(states.cpu(), want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(end.cpu(), running, rtol=1e-12, atol=1e-12)
        results.append((states, end))
    for states, end in results[1:]:
        assert torch.equal(states, results[0][0]) and torch.equal(end, results[0][1])


@pytest.mark.cuda
def test_cuda_ns_2b_shape_under_bf16_autocast():
    """B 8, T 4096, 40 heads of 64, N 64, one group, chunk 64, bf16 u, B, C and fp32 dt, A under
    autocast, as the dendritic layer runs it: as close to the fp64 truth as the reference under the
    same autocast is, and the same bits twice."""
    u, dt, A, B, C, state0, grad_y, grad_last = _inputs(8, 4096, 40, 64, 1, 64, torch.float32, dt_scale=0.1)
    u, B, C = (t.bfloat16() for t in (u, B, C))
    state0 = state0 * 0.1

    def autocast(scan):
        def run(*arguments):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return scan(*arguments)

        return run

    got = _run(autocast(ssd_scan), u, dt, A, B, C, state0, grad_y, grad_last, 64)
    again = _run(autocast(ssd_scan), u, dt, A, B, C, state0, grad_y, grad_last, 64)
    for name, a, b in zip(NAMES, got, again):
        assert torch.equal(a, b), name
    reference = _run(autocast(chunked_scan), u, dt, A, B, C, state0, grad_y, grad_last, 64)
    # The truth in fp32 without autocast on a slice (fp64 of the whole shape needs too much memory).
    truth = _run(chunked_scan, *(t[:1].float() for t in (u, dt)), A, *(t[:1].float() for t in (B, C)),
                 state0[:1], grad_y[:1], grad_last[:1], 64)
    sliced = [t[:1] if t.dim() > 1 else t for t in got[:2]], [t[:1] if t.dim() > 1 else t for t in reference[:2]]
    for kernel_value, reference_value, true_value in zip(sliced[0], sliced[1], truth[:2]):
        assert _relative_error(kernel_value, true_value) < 2 * _relative_error(reference_value, true_value) + 1e-3
    for name, a, b in zip(NAMES, got, reference):
        assert _relative_error(a, b) < 3e-2, name


@pytest.mark.cuda
@pytest.mark.parametrize("length", [1000, 1024])
def test_cuda_float32_matches_the_reference(length):
    tensors = _inputs(2, length, 8, 64, 2, 64, torch.float32, dt_scale=0.2)
    got = _run(ssd_scan, *tensors, 64)
    want = _run(chunked_scan, *(t.double() for t in tensors), 64)
    _assert_close(got, want, 1e-4)
