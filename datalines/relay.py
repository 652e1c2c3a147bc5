"""What is left of a cycle's source after some of its windows were read, and the windows it makes.

A source's targets are its token offsets 1 .. tokens - 1 (offset 0 is no window's target). The
targets a cycle still has to train are `Runs`: spans of consecutive offsets, in offset order.
Laid end to end they make a stream; window k at length L is the stream's targets k L .. k L + L - 1,
read as the row [token before its first target, its L targets]. A fresh cycle is one run (1,
tokens - 1), and that rule gives the reader's plain windows: window k is tokens[k L : k L + L + 1].

A plan stage that changes the sequence length inside a cycle (a branch's decay at 4K, then its
long stage at 32K) reads the rest of the cycle as a relay: the runs left once the first samples of
the old length's order are taken away (`Runs.without`), cut at the new length. Every target of the
cycle is then trained exactly once -- the old length's windows and the relay's are disjoint, and
together they cover the source's targets but the stream's last `total % L` -- and whatever the
reads before it, the relay is a pure function of them, the shards and the seed (an exact resume
point). Where a relay window spans two runs, the first target of the second run follows the
first run's last token, not its own predecessor, as at a document boundary of packed rows: the
price of wasting no target and changing no window's shape (a run cut on its own would leave up to
L - 1 targets of each of its, often many, short runs).

The alternative, holding the length until the cycle ends, would move a branch's decay stage and
the learning-rate schedule that ends with the plan: a stage trains its budget in tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np


@dataclass(frozen=True)
class Runs:
    """A source's targets still to train: `lengths[i]` offsets from `starts[i]`, in offset order."""

    starts: np.ndarray
    """int64, the first target offset of each run (ascending, runs disjoint)."""
    lengths: np.ndarray
    """int64, each run's targets (> 0)."""

    @classmethod
    def whole(cls, tokens: int) -> Runs:
        """A fresh source of `tokens` tokens: every offset but the first is a target."""
        if tokens < 2:
            return cls(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
        return cls(np.array([1], dtype=np.int64), np.array([tokens - 1], dtype=np.int64))

    @cached_property
    def offsets(self) -> np.ndarray:
        """Each run's place in the stream (exclusive cumulative lengths)."""
        return np.cumsum(self.lengths) - self.lengths

    @property
    def total(self) -> int:
        """Targets left."""
        return int(self.lengths.sum())

    def windows(self, seq_len: int) -> int:
        """Whole windows of `seq_len` targets the stream holds."""
        return self.total // seq_len

    def targets(self, windows: np.ndarray, seq_len: int) -> np.ndarray:
        """The target offsets of windows `windows` (int64, any order): (len(windows), seq_len)."""
        offsets = self.offsets
        first = windows.astype(np.int64) * seq_len
        run_first = np.searchsorted(offsets, first, side="right") - 1
        run_last = np.searchsorted(offsets, first + seq_len - 1, side="right") - 1
        steps = np.arange(seq_len, dtype=np.int64)
        result = (self.starts[run_first] + first - offsets[run_first])[:, None] + steps
        # Most windows lie inside one run; those that span runs map offset by offset.
        spanning = np.flatnonzero(run_first != run_last)
        if len(spanning):
            stream = first[spanning, None] + steps
            run = np.searchsorted(offsets, stream, side="right") - 1
            result[spanning] = self.starts[run] + stream - offsets[run]
        return result

    def without(self, windows: np.ndarray, seq_len: int) -> Runs:
        """The runs left once windows `windows` (distinct, at `seq_len`) have been read."""
        total = self.total
        read = np.zeros(total // seq_len, dtype=bool)
        read[windows] = True
        # Stream spans not read: the maximal stretches of unread windows, and the stream's tail.
        edges = np.diff(np.concatenate(([True], read, [True])).astype(np.int8))
        kept_from = np.flatnonzero(edges == -1) * seq_len
        kept_to = np.flatnonzero(edges == 1) * seq_len
        if len(kept_to) and kept_to[-1] == len(read) * seq_len:
            kept_to[-1] = total  # the last kept stretch runs on into the tail
        elif total > len(read) * seq_len:
            kept_from = np.append(kept_from, len(read) * seq_len)
            kept_to = np.append(kept_to, total)
        # Cut the kept spans where a run ends: each piece lies in one run.
        offsets = self.offsets
        cuts = np.union1d(np.concatenate((kept_from, kept_to, offsets)), [total])
        begin, end = cuts[:-1], cuts[1:]
        span = np.searchsorted(kept_from, begin, side="right") - 1
        keep = (span >= 0) & (begin < kept_to[np.maximum(span, 0)] if len(kept_to) else False)
        begin, end = begin[keep], end[keep]
        run = np.searchsorted(offsets, begin, side="right") - 1
        return Runs((self.starts[run] + begin - offsets[run]).astype(np.int64), (end - begin).astype(np.int64))
