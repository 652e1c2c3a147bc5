"""A source file's documents split into held-out and training, the training ones in a seeded order.

Training documents of a file are shuffled once with a seed derived from the line's seed and the
file's sha256, and cycles take them in that order: the shuffle is a pure function of pinned
inputs, so any cycle can be rebuilt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from datalines.heldout import is_held_out
from datalines.sources import Source, SourceFile


@dataclass(frozen=True)
class FileDocuments:
    """The documents of one source file, after the held-out split and the shuffle."""

    training: list[str]
    """Training documents in their shuffled order (the order cycles take them in)."""
    heldout: list[str]
    """Held-out documents in file order (validation only, never trained on)."""
    invalid_utf8: dict[int, int] = field(default_factory=dict)
    """Training document (its index in `training`) -> its bytes that were not UTF-8 (replaced by
    U+FFFD when it was read); only documents that had any."""


def file_seed_words(seed: int, file: SourceFile) -> list[int]:
    digest = int(file.sha256[:16], 16) if file.sha256 else 0
    return [seed, digest >> 32, digest & 0xFFFFFFFF]


def split_documents(
    texts: list[str], fraction: float, seed_words: list[int], invalid_utf8: dict[int, int] | None = None
) -> FileDocuments:
    """Split `texts` (file order) into training and held-out and shuffle the training ones;
    `invalid_utf8` (document index in file order -> bytes) follows each training document."""
    held_out = [is_held_out(text, fraction) for text in texts]
    training_indices = [index for index, out in enumerate(held_out) if not out]
    generator = np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed_words)))
    order = [training_indices[position] for position in generator.permutation(len(training_indices)).tolist()]
    invalid = invalid_utf8 or {}
    return FileDocuments(
        training=[texts[index] for index in order],
        heldout=[text for text, out in zip(texts, held_out) if out],
        invalid_utf8={position: invalid[index] for position, index in enumerate(order) if index in invalid},
    )


def file_documents(source: Source, file: SourceFile, seed: int) -> FileDocuments:
    read = source.read(file)
    return split_documents(read.texts, source.spec.heldout_fraction, file_seed_words(seed, file), read.invalid_utf8)


def text_bytes(texts: list[str]) -> np.ndarray:
    """UTF-8 byte length of each text (int64)."""
    lengths = (len(text.encode("utf-8", "surrogatepass")) for text in texts)
    return np.fromiter(lengths, dtype=np.int64, count=len(texts))


class DocumentLengths:
    """Byte lengths of each file's training documents, read once per process (planning needs only these)."""

    def __init__(self, source: Source, seed: int) -> None:
        self.source = source
        self.seed = seed
        self._lengths: dict[int, np.ndarray] = {}

    def of(self, file_index: int) -> np.ndarray:
        if file_index not in self._lengths:
            documents = file_documents(self.source, self.source.files[file_index], self.seed)
            self._lengths[file_index] = text_bytes(documents.training)
        return self._lengths[file_index]
