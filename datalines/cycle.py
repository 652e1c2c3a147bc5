"""The reader of one prepared cycle: memory-mapped shards, the sample order, exact windows.

A sample is a window of seq_len + 1 tokens of one source's token file: window w of a source is
tokens[w * seq_len : w * seq_len + seq_len + 1] (consecutive windows share one token, so every
token but the first is a target exactly once). The order of samples interleaves the sources at
the cycle's shares (`mixture.interleave_sources`) and reads each source's windows in a seeded
random order within each segment (`mixture.segment_shuffle`). `samples(seq_len, start, count,
seed)` is a pure function of the shards: (cycle, sample index) is an exact resume position.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from datalines.errors import DataLineError
from datalines.mixture import interleave_sources, segment_shuffle
from datalines.shards import open_tokens


class Cycle:
    """A prepared, verified cycle of a data line (see the module docstring)."""

    def __init__(
        self, directory: Path, manifest: dict[str, Any], manifest_sha256: str, segments: int
    ) -> None:
        self.directory = directory
        self.index: int = manifest["cycle"]
        self.manifest = manifest
        self.manifest_sha256 = manifest_sha256
        self.segments = segments
        self.source_names: list[str] = list(manifest["source_order"])
        self._dtype = np.dtype(manifest["token_dtype"])
        self._tokens: dict[str, np.ndarray] = {}
        self._order = lru_cache(maxsize=4)(self._compute_order)

    def tokens(self, source: str) -> np.ndarray:
        """The source's flat token array (memory-mapped, read-only)."""
        if source not in self._tokens:
            info = self.manifest["sources"][source]
            path = self.directory / info["tokens_file"]["name"]
            self._tokens[source] = open_tokens(path, self._dtype, info["tokens"])
        return self._tokens[source]

    def windows(self, source: str, seq_len: int) -> int:
        return max(0, (self.manifest["sources"][source]["tokens"] - 1) // seq_len)

    def _check(self, seq_len: int) -> None:
        if not isinstance(seq_len, int) or seq_len < 1:
            raise DataLineError(f"{self.directory}: seq_len must be a positive integer, got {seq_len!r}")

    def _compute_order(self, seq_len: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """(source index, window index) of every sample of the cycle, in reading order."""
        weights = [self.manifest["sources"][name]["weight"] for name in self.source_names]
        available = [self.windows(name, seq_len) for name in self.source_names]
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
            permutation = segment_shuffle(available[index], self.segments, [seed, self.index, index, seq_len])
            # The source's k-th sample reads its k-th window in segment-shuffled order; windows past
            # the samples the interleave took (a surplus from share rounding) are the segment tail.
            window_of_sample[positions] = permutation[: len(positions)]
        return source_of_sample, window_of_sample

    def num_samples(self, seq_len: int) -> int:
        self._check(seq_len)
        return len(self._order(seq_len, 0)[0])

    def order_digest(self, seq_len: int, seed: int) -> str:
        """sha256 over the shards' hashes and the (source, window) of every sample in order."""
        self._check(seq_len)
        source_of_sample, window_of_sample = self._order(seq_len, seed)
        digest = hashlib.sha256()
        for name in self.source_names:
            digest.update(self.manifest["sources"][name]["tokens_file"]["sha256"].encode("ascii"))
        digest.update(f"{seq_len}:{seed}".encode("ascii"))
        digest.update(source_of_sample.astype("<i2").tobytes())
        digest.update(window_of_sample.astype("<i8").tobytes())
        return digest.hexdigest()

    def samples(self, seq_len: int, start: int, count: int, seed: int) -> np.ndarray:
        """Samples start .. start + count - 1 of the order: (count, seq_len + 1) int64."""
        self._check(seq_len)
        source_of_sample, window_of_sample = self._order(seq_len, seed)
        if start < 0 or count < 0 or start + count > len(source_of_sample):
            raise DataLineError(
                f"{self.directory}: samples {start}..{start + count} are outside cycle {self.index}'s "
                f"{len(source_of_sample)} samples at seq_len {seq_len}"
            )
        result = np.empty((count, seq_len + 1), dtype=np.int64)
        sources = source_of_sample[start : start + count]
        windows = window_of_sample[start : start + count]
        offsets = np.arange(seq_len + 1, dtype=np.int64)
        for index in np.unique(sources):
            rows = np.flatnonzero(sources == index)
            positions = windows[rows, None] * seq_len + offsets  # (rows, seq_len + 1)
            result[rows] = self.tokens(self.source_names[index])[positions]
        return result
