"""Selective scan: the reference checked by gradcheck, the Triton kernel against the reference
(forward and backward, odd sizes, several groups), poisoned outputs and carry chaining."""

from __future__ import annotations

import importlib

import pytest
import torch

from kernels._dispatch import poison
from kernels.selective_scan import selective_scan, selective_scan_reference

scan_module = importlib.import_module("kernels.selective_scan")  # not the function kernels/ exports
backward_module = importlib.import_module("kernels.selective_scan_backward")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _poisoned_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(poison, "enabled", True)


def _inputs(batch, steps, channels, groups, state, seed, dtype=torch.float32, with_d=True, with_h0=True):
    """x, delta, A, B, C, D, h0 with delta > 0 and A < 0, as the models make them."""
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    x = draw(batch, steps, channels)
    delta = torch.nn.functional.softplus(draw(batch, steps, channels) - 1)
    A = -torch.exp(draw(channels, state) * 0.5)
    B, C = draw(batch, steps, groups, state), draw(batch, steps, groups, state)
    D = draw(channels) if with_d else None
    h0 = draw(batch, channels, state) if with_h0 else None
    return [t.to(dtype).to(DEVICE) if t is not None else None for t in (x, delta, A, B, C, D, h0)]


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def _outputs_and_grads(scan, inputs, grad_y, grad_h):
    leaves = [t.clone().requires_grad_() if t is not None else None for t in inputs]
    y, h_last = scan(*leaves)
    ((y * grad_y).sum() + (h_last * grad_h).sum()).backward()
    return [y, h_last] + [leaf.grad for leaf in leaves if leaf is not None]


def test_reference_gradcheck() -> None:
    inputs = [t.requires_grad_() for t in _inputs(2, 4, 4, 2, 3, seed=0, dtype=torch.float64)]
    assert torch.autograd.gradcheck(selective_scan_reference, inputs)


@pytest.mark.parametrize(
    ("batch", "steps", "channels", "groups", "state", "with_d", "with_h0"),
    [(2, 21, 6, 2, 5, True, True), (1, 3, 3, 1, 3, False, False), (1, 33, 19, 1, 16, True, False),
     (2, 32, 32, 2, 8, True, True)],  # the last: whole chunks and channel blocks (the unmasked loop)
)
def test_kernel_matches_reference(batch, steps, channels, groups, state, with_d, with_h0) -> None:
    _check_against_reference(batch, steps, channels, groups, state, with_d, with_h0)


@pytest.mark.parametrize(("steps", "channels"), [(24, 32), (19, 20)])
def test_wide_forward_blocks_match_reference(monkeypatch, steps, channels) -> None:
    """The 16-channel forward programs (taken when Bt x Dm is large), whole and ragged."""
    monkeypatch.setattr(scan_module, "_forward_block_d", lambda batch, channels: 16)
    _check_against_reference(1, steps, channels, 1, 16, True, True)


@pytest.mark.parametrize("segment_chunks", [1, 2, None])
def test_backward_segments_match_reference(monkeypatch, segment_chunks) -> None:
    """The backward split along time (segments run at once, chained through their carries) and not
    (None: one segment, as for many rows): 37 steps are 5 chunks, so 5 segments of one chunk or 3 of
    two (the last half empty)."""
    monkeypatch.setattr(backward_module, "_backward_segment_chunks",
                        lambda batch, channels, chunks: segment_chunks or max(chunks, 1))
    _check_against_reference(2, 37, 6, 2, 4, True, True)
    _check_against_reference(1, 32, 16, 1, 8, True, True)  # whole segments: the unmasked loop


@pytest.mark.parametrize("segment_chunks", [1, 2, None])
@pytest.mark.parametrize("with_h0", [True, False])
def test_forward_segments_match_reference(monkeypatch, segment_chunks, with_h0) -> None:
    """The forward split along time (a flow pass, the segments' entering states chained from h0,
    then every segment at once) and not (None): 37 steps are 5 chunks, so 5 segments of one chunk
    or 3 of two (the last half empty: no chunk start may be saved past the last chunk); the saved
    chunk starts feed the backward, so its gradients check them. Without gradients too."""
    monkeypatch.setattr(scan_module, "_forward_segment_chunks",
                        lambda batch, channels, chunks: segment_chunks or max(chunks, 1))
    _check_against_reference(2, 37, 6, 2, 4, True, with_h0)
    _check_against_reference(1, 32, 16, 1, 8, True, with_h0)  # whole segments: the unmasked loop
    inputs = _inputs(2, 37, 6, 2, 4, seed=5, with_h0=with_h0)
    with torch.no_grad():
        got = selective_scan(*inputs, use_triton=True)
    want = selective_scan_reference(*[t.double() if t is not None else None for t in inputs])
    for mine, theirs in zip(got, want):
        assert _relative_error(mine, theirs) < 2e-5


def test_segments_only_for_few_rows_and_no_longer_than_the_row_needs() -> None:
    """Time segments where they were measured to pay (Bt x Dm <= 2048), their length growing with
    the row up to 64 chunks; one segment for many rows. A backward segment walks all its chunks, so
    a short row's must stay short (a 3-chunk row would otherwise walk 64)."""
    forward, backward = scan_module._forward_segment_chunks, backward_module._backward_segment_chunks
    assert forward(1, 1024, 4096) == 64  # T 32768
    assert forward(2, 1024, 512) == 64  # T 4096
    assert forward(2, 1024, 32) == 8  # T 256: four segments
    assert forward(1, 1024, 16) == 16  # too short: one segment
    assert forward(8, 1024, 4096) == 4096  # many rows: one segment
    assert backward(1, 1024, 4096) == 64
    assert backward(1, 2048, 256) == 32
    assert backward(2, 1024, 32) == 8
    assert backward(1, 96, 20) == 8  # three segments, the last one ragged
    assert backward(1, 96, 4) == 4  # one segment, its loop no longer than the row
    assert backward(8, 1024, 512) == 512


def test_whole_rows_run_the_unmasked_loops(record_launches) -> None:
    """Whole chunks, channel blocks and segments (test_kernel_matches_reference's last case): both
    directions' chunk loops carry no masks. Until session 7 the backward walked this row's 4 chunks
    as one 8-chunk segment, ragged, so that case ran the masked loop."""
    forward = record_launches(scan_module, "_selective_scan_forward_kernel")
    backward = record_launches(backward_module, "_selective_scan_backward_kernel")
    _check_against_reference(2, 32, 32, 2, 8, True, True)
    assert forward and backward
    assert all(launch["EVEN"] for launch in forward + backward)


def test_forward_without_gradients_matches() -> None:
    """Under no_grad the forward saves no chunk starts; its outputs are the same bits."""
    inputs = _inputs(2, 27, 12, 3, 4, seed=3)
    leaves = [t.clone().requires_grad_() for t in inputs]
    y, h_last = selective_scan(*leaves, use_triton=True)
    with torch.no_grad():
        y_plain, h_plain = selective_scan(*inputs, use_triton=True)
    assert torch.equal(y.detach(), y_plain) and torch.equal(h_last.detach(), h_plain)


def _check_against_reference(batch, steps, channels, groups, state, with_d, with_h0) -> None:
    inputs = _inputs(batch, steps, channels, groups, state, seed=steps, with_d=with_d, with_h0=with_h0)
    generator = torch.Generator().manual_seed(1)
    grad_y = torch.randn(batch, steps, channels, generator=generator).to(DEVICE)
    grad_h = torch.randn(batch, channels, state, generator=generator).to(DEVICE)
    got = _outputs_and_grads(lambda *a: selective_scan(*a, use_triton=True), inputs, grad_y, grad_h)
    reference64 = [t.double() if t is not None else None for t in inputs]
    want = _outputs_and_grads(selective_scan_reference, reference64, grad_y.double(), grad_h.double())
    assert len(got) == len(want)
    for index, (mine, theirs) in enumerate(zip(got, want)):
        assert not mine.isnan().any(), f"output {index} has unwritten (NaN) elements"
        assert _relative_error(mine, theirs) < 2e-5, f"output {index}"


@pytest.mark.parametrize("use_triton", [True, False])
def test_carry_chains(use_triton: bool) -> None:
    """The scan of T equals the scan of T1 followed by the scan of T2 from the first's h_last."""
    x, delta, A, B, C, D, h0 = _inputs(2, 29, 6, 3, 4, seed=5)
    y, h_last = selective_scan(x, delta, A, B, C, D, h0, use_triton=use_triton)
    y1, h1 = selective_scan(x[:, :17], delta[:, :17], A, B[:, :17], C[:, :17], D, h0, use_triton=use_triton)
    y2, h2 = selective_scan(x[:, 17:], delta[:, 17:], A, B[:, 17:], C[:, 17:], D, h1, use_triton=use_triton)
    assert _relative_error(torch.cat([y1, y2], 1), y) < 1e-6
    assert _relative_error(h2, h_last) < 1e-6


def test_kernel_is_deterministic() -> None:
    inputs = _inputs(1, 18, 5, 1, 4, seed=9)
    grad_y = torch.ones(1, 18, 5, device=DEVICE)
    grad_h = torch.ones(1, 5, 4, device=DEVICE)
    first = _outputs_and_grads(lambda *a: selective_scan(*a, use_triton=True), inputs, grad_y, grad_h)
    second = _outputs_and_grads(lambda *a: selective_scan(*a, use_triton=True), inputs, grad_y, grad_h)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 kernels are checked on the GPU")
def test_kernel_bf16_inputs() -> None:
    x, delta, A, B, C, D, h0 = _inputs(2, 100, 64, 1, 16, seed=4)
    half = [t.bfloat16() for t in (x, delta, B, C)]
    y, h_last = selective_scan(half[0], half[1], A, half[2], half[3], D, h0)
    want_y, want_h = selective_scan_reference(half[0], half[1], A, half[2], half[3], D, h0)
    assert y.dtype == torch.bfloat16 and h_last.dtype == torch.float32
    assert _relative_error(y, want_y) < 1e-2
    assert _relative_error(h_last, want_h) < 1e-4


def test_groups_must_divide_channels() -> None:
    x, delta, A, B, C, D, h0 = _inputs(1, 3, 5, 1, 2, seed=2)
    B2 = torch.cat([B, B], 2)
    with pytest.raises(ValueError, match="Dm=5 is not a multiple of G=2"):
        selective_scan(x, delta, A, B2, B2, D, h0, use_triton=True)
