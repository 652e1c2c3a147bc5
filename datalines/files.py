"""File primitives of a data line: atomic writes, sha256 pins and JSON reads with clear errors.

Every file a data line keeps is written to a temporary name in the same directory, flushed to
disk and renamed, so a kill at any moment leaves either the old file or the new one, never a
half-written file under the final name.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from datalines.errors import DataLineError

_HASH_CHUNK_BYTES = 1 << 22


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


@contextlib.contextmanager
def directory_lock(directory: Path) -> Iterator[None]:
    """An exclusive flock on a directory, released when the block ends (or the process dies)."""
    descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # closing the descriptor drops the lock


def temporary_name(path: Path) -> Path:
    """A sibling name that never looks like a finished file (readers ignore `.tmp-*`)."""
    return path.with_name(f".tmp-{os.getpid()}-{path.name}")


def write_bytes_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_name(path)
    try:
        with open(temporary, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        # A full disk (ENOSPC) mid-write, or a signal: no half-written temporary left beside the
        # file until the next preparer's clean-up; the file itself is as it was.
        temporary.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


def canonical_json(value: Any) -> bytes:
    """The one byte encoding of a JSON value we hash and store (sorted keys, fixed spacing)."""
    return (json.dumps(value, indent=1, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def write_json_atomic(path: Path, value: Any) -> None:
    write_bytes_atomic(path, canonical_json(value))


class JSONObject(dict[str, Any]):
    """A parsed JSON object that remembers a key it held twice (`repeated`): JSON keeps only the
    last value, so a key added by hand above an existing one (an `allow_changes` at the top of a
    run.json that has one further down, a second `shares` in a recipe) would be silently ignored.
    The readers of hand-edited files (run.json, host.json, a recipe) refuse it, naming the key."""

    repeated: str | None = None

    @classmethod
    def from_pairs(cls, pairs: list[tuple[str, Any]]) -> JSONObject:
        """`json.loads`'s `object_pairs_hook`."""
        document = cls()
        for key, value in pairs:
            if key in document and document.repeated is None:
                document.repeated = key
            document[key] = value
        return document


def read_json(path: Path, object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None) -> Any:
    """Parse a JSON file, raising `DataLineError` naming the file when it is missing or malformed;
    `object_pairs_hook` builds each object from its (key, value) pairs, as `json.loads`'s does."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataLineError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise DataLineError(f"{path}: cannot be read ({error})") from None
    try:
        return json.loads(text, object_pairs_hook=object_pairs_hook)
    except json.JSONDecodeError as error:
        raise DataLineError(f"{path}: not valid JSON ({error})") from None
