"""Atomic file replacement: a reader sees the old file or the new one, never half of either.

Every small state file of a line (run.json, accepted_run.json, STOP, ...) is written through
here: the text goes to a temporary file in the same directory, is fsynced, renamed over the
target, and the directory is fsynced so the rename itself survives a power loss.

The file gets the mode a plain `open(path, "w")` would give it: a replaced file keeps its own,
a new one gets 0666 less the umask (`tempfile.mkstemp` makes 0600 files, which left a line's
run.json unreadable to the group that shares the machine once a command had rewritten it).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC


def write_text_atomic(path: Path | str, text: str) -> None:
    """Replace `path` with `text` (UTF-8) atomically and durably."""
    target = Path(path)
    # The temporary file must live in the target's directory: rename is only atomic
    # within one filesystem.
    descriptor, temporary = _create_temporary(target)
    try:
        with contextlib.suppress(FileNotFoundError):  # a new file: open's 0666 under the umask stands
            os.fchmod(descriptor, stat.S_IMODE(os.stat(target).st_mode))
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    fsync_directory(target.parent)


def _create_temporary(target: Path) -> tuple[int, Path]:
    """A new hidden file beside `target`, opened for writing, mode 0666 under the umask."""
    while True:
        temporary = target.parent / f".{target.name}.{secrets.token_hex(4)}.tmp"
        try:
            return os.open(temporary, _CREATE, 0o666), temporary
        except FileExistsError:
            continue


def fsync_directory(directory: Path | str) -> None:
    """Make a rename or creation inside `directory` durable."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
