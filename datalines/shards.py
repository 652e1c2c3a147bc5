"""Token shards: per source per cycle, a flat token file and its document offsets, memory-mapped to read.

`<source>.tokens` holds the cycle's documents of that source, each followed by the EOS id, as
little-endian uint16 (vocab <= 65536) or int32; `<source>.docs` holds int64 offsets, one per
document start plus the end. Both are streamed to a temporary name (hashed as they are written,
so a cycle never has to fit in memory) and renamed when complete.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from datalines.errors import DataLineError
from datalines.files import fsync_directory, temporary_name

TOKENS_SUFFIX = ".tokens"
OFFSETS_SUFFIX = ".docs"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<i4")


class ShardWriter:
    """Appends arrays to a file under a temporary name; `close()` renames it and returns its entry."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.temporary = temporary_name(path)
        self.handle = open(self.temporary, "wb")  # noqa: SIM115 (closed in close())
        self.digest = hashlib.sha256()
        self.size = 0

    def write(self, array: np.ndarray) -> None:
        data = np.ascontiguousarray(array).tobytes()
        self.handle.write(data)
        self.digest.update(data)
        self.size += len(data)

    def close(self) -> dict[str, Any]:
        """Flush, fsync and rename; returns `{name, bytes, sha256}` for the manifest."""
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.handle.close()
        os.replace(self.temporary, self.path)
        fsync_directory(self.path.parent)
        return {"name": self.path.name, "bytes": self.size, "sha256": self.digest.hexdigest()}

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if not self.handle.closed:  # left by an error: never leave a half file behind
            self.handle.close()
            self.temporary.unlink(missing_ok=True)


def write_array_atomic(path: Path, array: np.ndarray) -> dict[str, Any]:
    """Write one array's raw bytes atomically; returns `{name, bytes, sha256}` for the manifest."""
    with ShardWriter(path) as writer:
        writer.write(array)
        return writer.close()


def join_documents(
    documents: list[np.ndarray], eos_id: int, dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, offsets): the documents each followed by EOS; int64 start offset of each, plus the end."""
    lengths = np.fromiter((len(document) + 1 for document in documents), dtype=np.int64, count=len(documents))
    offsets = np.zeros(len(documents) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.full(int(offsets[-1]), eos_id, dtype=dtype)
    for start, document in zip(offsets[:-1], documents):
        tokens[start : start + len(document)] = document
    return tokens, offsets


def open_tokens(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
    """The token file as a read-only memory map of exactly `count` tokens."""
    try:
        if count == 0:
            return np.zeros(0, dtype=dtype)
        return np.memmap(path, dtype=dtype, mode="r", shape=(count,))
    except (OSError, ValueError) as error:
        raise DataLineError(f"{path}: token shard cannot be mapped ({error})") from None
