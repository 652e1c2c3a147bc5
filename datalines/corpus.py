"""A source file's documents split into held-out and training, the training ones in a seeded order.

Training documents of a file are shuffled once with a seed derived from the line's seed and the
file's sha256, and cycles take them in that order: the shuffle is a pure function of pinned
inputs, so any cycle can be rebuilt.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def file_seed_words(seed: int, file: SourceFile) -> list[int]:
    digest = int(file.sha256[:16], 16) if file.sha256 else 0
    return [seed, digest >> 32, digest & 0xFFFFFFFF]


def split_documents(texts: list[str], fraction: float, seed_words: list[int]) -> FileDocuments:
    training = [text for text in texts if not is_held_out(text, fraction)]
    heldout = [text for text in texts if is_held_out(text, fraction)]
    generator = np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed_words)))
    order = generator.permutation(len(training))
    return FileDocuments(training=[training[index] for index in order], heldout=heldout)


def file_documents(source: Source, file: SourceFile, seed: int) -> FileDocuments:
    texts = source.documents(file)
    return split_documents(texts, source.spec.heldout_fraction, file_seed_words(seed, file))


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
