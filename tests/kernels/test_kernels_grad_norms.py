"""Segment sums of squares: the Triton kernel against its reference on random segmentations."""

from __future__ import annotations

import importlib

import pytest
import torch

from kernels._dispatch import poison
from kernels.grad_norms import segment_sq_sums, segment_sq_sums_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
grad_norms_module = importlib.import_module("kernels.grad_norms")


@pytest.fixture(autouse=True)
def _poisoned_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(poison, "enabled", True)


def _random_offsets(count: int, segments: int, generator: torch.Generator, chunk: int) -> torch.Tensor:
    """Ascending boundaries 0 .. count with empty segments and cuts on chunk edges mixed in."""
    cuts = torch.randint(0, count + 1, (segments - 1,), generator=generator)
    cuts[: max(1, segments // 4)] = (cuts[: max(1, segments // 4)] // chunk) * chunk  # on chunk edges
    cuts[-1:] = cuts[-2:-1] if segments > 2 else cuts[-1:]  # an empty segment
    boundaries = torch.cat([torch.tensor([0]), cuts.sort().values, torch.tensor([count])])
    return boundaries.to(torch.int64).to(DEVICE)


def test_reference_matches_direct_sums() -> None:
    flat = torch.randn(23, dtype=torch.float32)
    offsets = torch.tensor([0, 4, 4, 17, 23])
    want = torch.stack([flat[0:4].double().square().sum(), torch.tensor(0.0, dtype=torch.float64),
                        flat[4:17].double().square().sum(), flat[17:23].double().square().sum()])
    torch.testing.assert_close(segment_sq_sums_reference(flat, offsets), want)


@pytest.mark.parametrize("trial", range(6))
def test_kernel_matches_reference_small_chunks(trial: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 64-element chunk puts many segments across, inside and on the edges of chunks."""
    monkeypatch.setattr(grad_norms_module, "_CHUNK", 64)
    generator = torch.Generator().manual_seed(trial)
    count = int(torch.randint(1, 1500, (1,), generator=generator))
    segments = int(torch.randint(1, 40, (1,), generator=generator))
    flat = torch.randn(count, generator=generator).to(DEVICE)
    offsets = _random_offsets(count, segments, generator, 64)
    got = segment_sq_sums(flat, offsets, use_triton=True)
    assert not got.isnan().any(), "an entry was never written"
    torch.testing.assert_close(got, segment_sq_sums_reference(flat, offsets), rtol=1e-5, atol=1e-6)


def test_kernel_matches_reference_real_chunk() -> None:
    generator = torch.Generator().manual_seed(99)
    count = 3 * 8192 + 4097  # spans chunks of the real size, not a multiple of it
    flat = torch.randn(count, generator=generator).to(DEVICE)
    offsets = torch.tensor([0, 1, 8191, 8192, 8192, 20001, count - 1, count], device=DEVICE)
    got = segment_sq_sums(flat, offsets, use_triton=True)
    torch.testing.assert_close(got, segment_sq_sums_reference(flat, offsets), rtol=1e-5, atol=1e-6)
    # Deterministic: no atomics, the same bits every time.
    assert torch.equal(got, segment_sq_sums(flat, offsets, use_triton=True))


def test_single_segment_and_no_segments() -> None:
    flat = torch.randn(301).to(DEVICE)
    whole = segment_sq_sums(flat, torch.tensor([0, 301], device=DEVICE), use_triton=True)
    torch.testing.assert_close(whole, flat.double().square().sum().reshape(1), rtol=1e-12, atol=0)
    assert segment_sq_sums(flat, torch.tensor([0], device=DEVICE), use_triton=True).numel() == 0


@pytest.mark.parametrize("use_triton", [True, False])
@pytest.mark.parametrize("element", [1e21, 3.0e38])
def test_huge_finite_elements_have_finite_float64_sums(
    element: float, use_triton: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An fp32 square of 1e21 (or of a value near fp32's largest) overflows; a float64 one does not.
    64-element chunks put a segment across chunks, so the chunk partials are float64 too."""
    monkeypatch.setattr(grad_norms_module, "_CHUNK", 64)
    flat = torch.full((197,), element, dtype=torch.float32, device=DEVICE)
    flat[1::2] = -element
    offsets = torch.tensor([0, 7, 150, flat.numel()], device=DEVICE)
    got = segment_sq_sums(flat, offsets, use_triton=use_triton)
    assert got.dtype == torch.float64
    element_sq = float(torch.tensor(element, dtype=torch.float32)) ** 2
    want = torch.tensor([7, 143, flat.numel() - 150], dtype=torch.float64, device=DEVICE) * element_sq
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


@pytest.mark.parametrize("use_triton", [True, False])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_elements_give_non_finite_sums(bad: float, use_triton: bool) -> None:
    """The skip of a NaN/Inf gradient still sees it: only its segment's sum is not finite."""
    flat = torch.randn(9000, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    flat[8500] = bad
    got = segment_sq_sums(flat, torch.tensor([0, 8192, 9000], device=DEVICE), use_triton=use_triton)
    assert torch.isfinite(got[0]) and not torch.isfinite(got[1])


def test_bad_offsets_are_refused() -> None:
    flat = torch.randn(10)
    with pytest.raises(ValueError, match="must ascend from 0 to 10"):
        segment_sq_sums_reference(flat, torch.tensor([0, 6, 4, 10]))
    with pytest.raises(ValueError, match="int64"):
        segment_sq_sums(flat, torch.tensor([0, 10], dtype=torch.int32))
