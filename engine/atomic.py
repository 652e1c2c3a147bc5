"""Atomic file replacement: a reader sees the old file or the new one, never half of either.

Every small state file of a line (run.json, accepted_run.json, STOP, ...) is written through
here: the text goes to a temporary file in the same directory, is fsynced, renamed over the
target, and the directory is fsynced so the rename itself survives a power loss.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_text_atomic(path: Path | str, text: str) -> None:
    """Replace `path` with `text` (UTF-8) atomically and durably."""
    target = Path(path)
    # The temporary file must live in the target's directory: rename is only atomic
    # within one filesystem.
    descriptor, temporary_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary_name, target)
    except BaseException:
        Path(temporary_name).unlink(missing_ok=True)
        raise
    fsync_directory(target.parent)


def fsync_directory(directory: Path | str) -> None:
    """Make a rename or creation inside `directory` durable."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
