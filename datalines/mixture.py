"""The sample order of a cycle: sources interleaved at their shares, windows shuffled within segments.

Interleaving is a Pfair schedule on one processor: source s with integer weight w_s (of total
W) has its j-th sample released at slot floor(j W / w_s) and due by slot ceil((j + 1) W / w_s);
at every slot the released sample with the earliest deadline goes first (ties: recipe order).
With the weights summing to W this earliest-deadline schedule meets every deadline, so after
any t slots source s has had strictly between t w_s / W - 1 and t w_s / W + 1 samples. Any
contiguous run of L samples therefore holds each source within 2 samples of L w_s / W: the
bound holds for every update, whatever its size or position. Integer arithmetic only, so the
order is the same on every machine.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np


def interleave_sources(weights: Sequence[int], available: Sequence[int]) -> np.ndarray:
    """Source index of each slot (int16), until the next source due has no sample left.

    weights: integer weight per source (0: never drawn); available: samples each source has.
    """
    total = sum(weights)
    counts = [0] * len(weights)
    active = [index for index, weight in enumerate(weights) if weight > 0]
    if total <= 0 or not active:
        return np.zeros(0, dtype=np.int16)

    def release(index: int) -> int:
        return counts[index] * total // weights[index]

    def deadline(index: int) -> int:
        return -((-(counts[index] + 1) * total) // weights[index])

    ready: list[tuple[int, int]] = []  # (deadline, source index) of released samples
    waiting: list[tuple[int, int]] = []  # (release slot, source index) of the next sample of the rest
    for index in active:
        if release(index) == 0:
            heapq.heappush(ready, (deadline(index), index))
        else:
            heapq.heappush(waiting, (release(index), index))
    order: list[int] = []
    slot = 0
    while True:
        while waiting and waiting[0][0] <= slot:
            _, index = heapq.heappop(waiting)
            heapq.heappush(ready, (deadline(index), index))
        if not ready:
            # Cannot happen with weights summing to the total (the schedule is feasible).
            raise AssertionError(f"interleave: no sample released at slot {slot}")
        _, index = heapq.heappop(ready)
        if counts[index] >= available[index]:
            break
        order.append(index)
        counts[index] += 1
        slot += 1
        next_release = release(index)
        if next_release <= slot:
            heapq.heappush(ready, (deadline(index), index))
        else:
            heapq.heappush(waiting, (next_release, index))
    return np.asarray(order, dtype=np.int16)


def segment_shuffle(count: int, segments: int, seed_words: Sequence[int]) -> np.ndarray:
    """A permutation of range(count) that shuffles within each of `segments` equal contiguous parts.

    The k-th sample a source contributes reads window `result[k]`: windows stay in their segment
    (so every segment of a cycle holds every stratum), in a seeded random order within it.
    """
    generator = np.random.Generator(np.random.PCG64(np.random.SeedSequence(list(seed_words))))
    result = np.arange(count, dtype=np.int64)
    bounds = [part * count // segments for part in range(segments + 1)]
    for start, end in zip(bounds[:-1], bounds[1:]):
        result[start:end] = start + generator.permutation(end - start)
    return result


def merge_strata(lengths: list[np.ndarray]) -> np.ndarray:
    """The order in which to lay out the strata's documents so every stretch holds each at its share.

    lengths: per stratum, each document's length in tokens (with its EOS), in the stratum's order.
    Returns (documents, 2) int64 rows of (stratum, document index). The next document always comes
    from the stratum that has emitted the smallest fraction of its tokens so far (ties: stratum
    order), so any contiguous part of the source's shard, hence any segment of the cycle, holds the
    strata in proportion to their tokens.
    """
    totals = [int(stratum_lengths.sum()) for stratum_lengths in lengths]
    heap = [(0.0, index) for index, stratum_lengths in enumerate(lengths) if len(stratum_lengths)]
    positions = [0] * len(lengths)
    emitted = [0] * len(lengths)
    order = np.empty((sum(len(stratum_lengths) for stratum_lengths in lengths), 2), dtype=np.int64)
    for row in range(len(order)):
        _, index = heapq.heappop(heap)
        order[row] = index, positions[index]
        emitted[index] += int(lengths[index][positions[index]])
        positions[index] += 1
        if positions[index] < len(lengths[index]):
            heapq.heappush(heap, (emitted[index] / totals[index], index))
    return order
