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
    torch.testing.assert_close(segment_sq_sums_reference(flat, offsets), want.float())


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
    torch.testing.assert_close(whole, flat.double().square().sum().float().reshape(1), rtol=1e-5, atol=0)
    assert segment_sq_sums(flat, torch.tensor([0], device=DEVICE), use_triton=True).numel() == 0


def test_bad_offsets_are_refused() -> None:
    flat = torch.randn(10)
    with pytest.raises(ValueError, match="must ascend from 0 to 10"):
        segment_sq_sums_reference(flat, torch.tensor([0, 6, 4, 10]))
    with pytest.raises(ValueError, match="int64"):
        segment_sq_sums(flat, torch.tensor([0, 10], dtype=torch.int32))
