"""The sample order's mix: every contiguous run of samples holds each source within 2 of its share."""

from __future__ import annotations

import numpy as np
from helpers.data import worst_run_deviation
from hypothesis import given, settings
from hypothesis import strategies as st

from datalines.mixture import interleave_sources, merge_strata, segment_shuffle

recipes = st.lists(
    st.one_of(st.integers(1, 30), st.integers(1, 1_000_000), st.just(0)), min_size=1, max_size=8
).filter(lambda weights: sum(weights) > 0)


@settings(max_examples=300, deadline=None)
@given(weights=recipes, data=st.data())
def test_every_contiguous_run_is_within_two_samples_of_the_share(
    weights: list[int], data: st.DataObject
) -> None:
    available = [data.draw(st.integers(0, 600)) for _ in weights]
    order = interleave_sources(weights, available)
    assert worst_run_deviation(order, weights) < 2.0
    counts = np.bincount(order, minlength=len(weights)) if len(order) else np.zeros(len(weights))
    assert all(counts[index] <= available[index] for index in range(len(weights)))
    assert all(counts[index] == 0 for index, weight in enumerate(weights) if weight == 0)


@settings(max_examples=100, deadline=None)
@given(weights=recipes.filter(lambda weights: all(weights)))
def test_order_runs_until_a_source_is_used_up(weights: list[int]) -> None:
    available = [50 * weight // max(weights) + 1 for weight in weights]
    order = interleave_sources(weights, available)
    counts = np.bincount(order, minlength=len(weights))
    assert any(counts[index] == available[index] for index in range(len(weights)))
    # The whole order is itself a run: each source within 2 of its share of it.
    total = sum(weights)
    assert all(abs(counts[i] - len(order) * w / total) < 2 for i, w in enumerate(weights))


def test_order_does_not_depend_on_anything_but_its_inputs() -> None:
    first = interleave_sources([700_000, 200_000, 100_000], [5000, 5000, 5000])
    second = interleave_sources([700_000, 200_000, 100_000], [5000, 5000, 5000])
    assert np.array_equal(first, second)
    # Shares 0.7 / 0.2 / 0.1: 7, 2 and 1 of every 10 slots.
    assert np.bincount(first[:10], minlength=3).tolist() == [7, 2, 1]


@settings(max_examples=100, deadline=None)
@given(count=st.integers(0, 500), segments=st.integers(1, 12), seed=st.integers(0, 2**32 - 1))
def test_segment_shuffle_keeps_windows_in_their_segment(count: int, segments: int, seed: int) -> None:
    permutation = segment_shuffle(count, segments, [seed])
    assert sorted(permutation.tolist()) == list(range(count))
    for part in range(segments):
        start, end = part * count // segments, (part + 1) * count // segments
        assert sorted(permutation[start:end].tolist()) == list(range(start, end))
    assert np.array_equal(permutation, segment_shuffle(count, segments, [seed]))


def test_segment_shuffle_is_seeded() -> None:
    assert not np.array_equal(segment_shuffle(1000, 4, [1]), segment_shuffle(1000, 4, [2]))


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.lists(st.integers(1, 40), min_size=0, max_size=30), min_size=1, max_size=5))
def test_merge_strata_keeps_every_stretch_proportional(sizes: list[list[int]]) -> None:
    lengths = [np.array(stratum, dtype=np.int64) for stratum in sizes]
    order = merge_strata(lengths)
    # Every document exactly once, each stratum's documents in their own order.
    assert len(order) == sum(len(stratum) for stratum in sizes)
    for index, stratum in enumerate(sizes):
        assert order[order[:, 0] == index, 1].tolist() == list(range(len(stratum)))
    # At every point a stratum is ahead of any other by at most one of its own documents: once the
    # stratum is chosen it was the furthest behind, and a document moves it by length / total.
    totals = [sum(stratum) for stratum in sizes]
    largest = [max(stratum, default=0) for stratum in sizes]
    emitted = [0] * len(sizes)
    for stratum, document in order.tolist():
        emitted[stratum] += sizes[stratum][document]
        fractions = [emitted[i] / totals[i] if totals[i] else 1.0 for i in range(len(sizes))]
        for i in range(len(sizes)):
            for j in range(len(sizes)):
                if sizes[i] and sizes[j]:
                    assert fractions[i] - fractions[j] <= largest[i] / totals[i] + 1e-9
