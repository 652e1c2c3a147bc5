"""The reader of one prepared cycle: memory-mapped shards, the sample order, exact windows.

A sample is a window of seq_len + 1 tokens of one source's token file: window w of a source is
tokens[w * seq_len : w * seq_len + seq_len + 1] (consecutive windows share one token, so every
token but the first is a target exactly once). The order of samples interleaves the sources at
the cycle's shares (`mixture.interleave_sources`) and reads each source's windows in a seeded
random order within each segment (`mixture.segment_shuffle`). `samples(seq_len, start, count,
seed)` is a pure function of the shards: (cycle, sample index) is an exact resume position.

After a change of sequence length inside the cycle, the rest of it is read as a relay
(datalines.relay): `earlier` names the samples read before at other lengths, ((seq_len, samples),
...) oldest first, and the order at the new length lays out only the targets none of them read,
interleaved and shuffled by the same rules. A relay is a pure function of the shards, the seed and
`earlier` (an exact resume position again), and a read that took its length's order to the end
leaves an empty relay (the cycle ended there).
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from datalines.errors import DataLineError, ShardChanged
from datalines.manifest import ShardStamps, shard_stamps, verify_shards
from datalines.mixture import interleave_sources, segment_shuffle
from datalines.relay import Runs
from datalines.shards import open_tokens

Reads = tuple[tuple[int, int], ...]
"""A cycle's reads at earlier lengths: (seq_len, samples read of that length's order), oldest first."""


class Cycle:
    """A prepared, verified cycle of a data line (see the module docstring)."""

    def __init__(
        self,
        directory: Path,
        manifest: dict[str, Any],
        manifest_sha256: str,
        segments: int,
        stamps: ShardStamps | None = None,
    ) -> None:
        self.directory = directory
        self.stamps = stamps
        """The shards' stamps when their hashes were last checked (None: not checked yet)."""
        self.index: int = manifest["cycle"]
        self.manifest = manifest
        self.manifest_sha256 = manifest_sha256
        self.segments = segments
        self.source_names: list[str] = list(manifest["source_order"])
        self._dtype = np.dtype(manifest["token_dtype"])
        self._tokens: dict[str, np.ndarray] = {}
        self._order = lru_cache(maxsize=8)(self._compute_order)
        self._runs = lru_cache(maxsize=4)(self._compute_runs)

    def tokens(self, source: str) -> np.ndarray:
        """The source's flat token array (memory-mapped, read-only)."""
        if source not in self._tokens:
            info = self.manifest["sources"][source]
            path = self.directory / info["tokens_file"]["name"]
            self._tokens[source] = open_tokens(path, self._dtype, info["tokens"])
        return self._tokens[source]

    def verify_unchanged(self) -> None:
        """Raise `ShardChanged` when a shard is no longer the manifest's: the trainer asks after
        reading an update's samples, before training on them. A stat of each shard when nothing
        changed; its hashes again when a stamp moved (the bytes may still be the same)."""
        try:
            stamps = shard_stamps(self.directory, self.manifest)
            if stamps == self.stamps:
                return
            verify_shards(self.directory, self.manifest)
        except DataLineError as error:
            raise ShardChanged(f"{error}; it changed while cycle {self.index} was open") from None
        self.stamps = stamps

    def windows(self, source: str, seq_len: int) -> int:
        return max(0, (self.manifest["sources"][source]["tokens"] - 1) // seq_len)

    def _check(self, seq_len: int) -> None:
        if not isinstance(seq_len, int) or seq_len < 1:
            raise DataLineError(f"{self.directory}: seq_len must be a positive integer, got {seq_len!r}")

    def _compute_runs(self, seed: int, earlier: Reads) -> tuple[Runs, ...]:
        """Each source's targets the reads `earlier` left (datalines.relay)."""
        runs = tuple(Runs.whole(self.manifest["sources"][name]["tokens"]) for name in self.source_names)
        for depth, (seq_len, read) in enumerate(earlier):
            self._check(seq_len)
            sources, windows = self._order(seq_len, seed, earlier[:depth])
            if not isinstance(read, int) or not 0 <= read <= len(sources):
                raise DataLineError(
                    f"{self.directory}: a read of {read!r} samples of cycle {self.index} at seq_len {seq_len}, "
                    f"whose order there has {len(sources)}"
                )
            read_sources, read_windows = sources[:read], windows[:read]
            runs = tuple(part.without(read_windows[read_sources == index], seq_len) for index, part in enumerate(runs))
        return runs

    def _compute_order(self, seq_len: int, seed: int, earlier: Reads = ()) -> tuple[np.ndarray, np.ndarray]:
        """(source index, window index) of every sample of the cycle, in reading order: the windows
        of each source's runs left by `earlier` (all of the source, without it)."""
        runs = self._runs(seed, earlier)  # checks the reads
        if any(read == len(self._order(length, seed, earlier[:depth])[0]) for depth, (length, read) in enumerate(earlier)):
            # That read ended the cycle: nothing is left to relay.
            return np.zeros(0, dtype=np.int16), np.zeros(0, dtype=np.int64)
        weights = [self.manifest["sources"][name]["weight"] for name in self.source_names]
        available = [part.windows(seq_len) for part in runs]
        if earlier:
            # A source the earlier reads left without a window has had its share: the relay
            # interleaves the others rather than stop at once.
            weights = [weight if available[index] else 0 for index, weight in enumerate(weights)]
        active = [index for index, weight in enumerate(weights) if weight > 0]
        for index in active:
            if available[index] == 0:
                # The interleave would stop at once: say why rather than hand back an empty cycle.
                name = self.source_names[index]
                raise DataLineError(
                    f"{self.directory}: source {name} has no window of {seq_len + 1} tokens in cycle "
                    f"{self.index} ({self.manifest['sources'][name]['tokens']} tokens); raise the cycle "
                    f"tokens or its share"
                )
        if len(active) == 1:
            source_of_sample = np.full(available[active[0]], active[0], dtype=np.int16)
        else:
            source_of_sample = interleave_sources(weights, available)
        window_of_sample = np.zeros(len(source_of_sample), dtype=np.int64)
        for index in active:
            positions = np.flatnonzero(source_of_sample == index)
            # A relay's shuffle is its own (its depth in the words); a fresh cycle's is unchanged.
            words = [seed, self.index, index, seq_len] + ([len(earlier)] if earlier else [])
            permutation = segment_shuffle(available[index], self.segments, words)
            # The source's k-th sample reads its k-th window in segment-shuffled order; windows past
            # the samples the interleave took (a surplus from share rounding) are the segment tail.
            window_of_sample[positions] = permutation[: len(positions)]
        return source_of_sample, window_of_sample

    def num_samples(self, seq_len: int, seed: int = 0, earlier: Reads = ()) -> int:
        """Samples of the order at `seq_len` (after the reads `earlier`, whose orders depend on `seed`)."""
        self._check(seq_len)
        return len(self._order(seq_len, seed, earlier)[0])

    def unread_targets(self, seq_len: int, seed: int, earlier: Reads = ()) -> int:
        """Targets of the cycle that neither `earlier` nor the order at `seq_len` after them reads:
        each source's stream tail shorter than a window and the share rounding's surplus windows."""
        left = sum(part.total for part in self._runs(seed, earlier))
        return left - self.num_samples(seq_len, seed, earlier) * seq_len

    def order_digest(self, seq_len: int, seed: int, earlier: Reads = ()) -> str:
        """sha256 over the shards' hashes, the reads before, and the (source, window) of every sample in order."""
        self._check(seq_len)
        source_of_sample, window_of_sample = self._order(seq_len, seed, earlier)
        digest = hashlib.sha256()
        for name in self.source_names:
            digest.update(self.manifest["sources"][name]["tokens_file"]["sha256"].encode("ascii"))
        digest.update(f"{seq_len}:{seed}".encode("ascii"))
        if earlier:  # a fresh cycle's digest is the one its manifest and older checkpoints record
            digest.update(("after " + ",".join(f"{length}x{read}" for length, read in earlier)).encode("ascii"))
        digest.update(source_of_sample.astype("<i2").tobytes())
        digest.update(window_of_sample.astype("<i8").tobytes())
        return digest.hexdigest()

    def samples(self, seq_len: int, start: int, count: int, seed: int, earlier: Reads = ()) -> np.ndarray:
        """Samples start .. start + count - 1 of the order (after the reads `earlier`): (count, seq_len + 1) int64."""
        self._check(seq_len)
        source_of_sample, window_of_sample = self._order(seq_len, seed, earlier)
        if start < 0 or count < 0 or start + count > len(source_of_sample):
            raise DataLineError(
                f"{self.directory}: samples {start}..{start + count} are outside cycle {self.index}'s "
                f"{len(source_of_sample)} samples at seq_len {seq_len}"
            )
        runs = self._runs(seed, earlier)
        result = np.empty((count, seq_len + 1), dtype=np.int64)
        sources = source_of_sample[start : start + count]
        windows = window_of_sample[start : start + count]
        for index in np.unique(sources):
            rows = np.flatnonzero(sources == index)
            targets = runs[index].targets(windows[rows], seq_len)  # (rows, seq_len)
            # The row: the first target's own predecessor, then the targets.
            positions = np.concatenate((targets[:, :1] - 1, targets), axis=1)
            result[rows] = self.tokens(self.source_names[index])[positions]
        return result
