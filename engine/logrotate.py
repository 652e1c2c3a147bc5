"""Bounded logs: run.log and supervisor.out are rotated past 256 MB, keeping the newest few.

Rotation renames: `run.log.<keep-1>` -> `run.log.<keep>` (the oldest dropped), ..., `run.log` ->
`run.log.1`; the next write creates a fresh `run.log`. Several processes append to run.log (the
supervisor, and the trainer through its stdout), so a writer must notice that another has
rotated: `RotatingLog` re-opens when the path no longer names the file it holds, and rotates
under an exclusive flock on the file being rotated, so two writers never rotate the same file
twice. A descriptor handed to a child (the trainer's stdout) keeps writing to the file it was
opened on; the supervisor calls `rotate_if_needed` before each launch so that file is bounded
by one trainer's life. Within that life the trainer's own log moves its stdout and stderr along
(`stdio_follows`): a crash's traceback, printed after a few rotations of a long launch, would
otherwise go to a rotated file, or to one deleted as the oldest.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import threading
from pathlib import Path

MAX_LOG_BYTES = 256 * 1024 * 1024
KEEP_ROTATED = 3


def rotated_path(path: Path, number: int) -> Path:
    return path.with_name(f"{path.name}.{number}")


def rotate(path: Path | str, keep: int = KEEP_ROTATED) -> None:
    """Shift `path` to `path.1` (and each older one up by one), keeping `keep` rotated files."""
    path = Path(path)
    rotated_path(path, keep).unlink(missing_ok=True)
    for number in range(keep - 1, 0, -1):
        older = rotated_path(path, number)
        if older.exists():
            os.replace(older, rotated_path(path, number + 1))
    if path.exists():
        os.replace(path, rotated_path(path, 1))


def rotate_if_needed(path: Path | str, max_bytes: int = MAX_LOG_BYTES, keep: int = KEEP_ROTATED) -> bool:
    """Rotate `path` if it is past `max_bytes`; True when it did."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        # Under the lock, re-check that the path still names this file and that it is still big:
        # another writer may have rotated it while we waited.
        if not _same_file(path, fd) or os.fstat(fd).st_size <= max_bytes:
            return False
        rotate(path, keep)
        return True
    finally:
        os.close(fd)


def _same_file(path: Path, fd: int) -> bool:
    try:
        on_disk = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (on_disk.st_dev, on_disk.st_ino) == (held.st_dev, held.st_ino)


class RotatingLog:
    """An append-only text log that stays under `max_bytes` (plus one write) per file.

    Thread-safe; safe beside other processes appending to the same path (see module docstring).
    """

    def __init__(
        self, path: Path | str, max_bytes: int = MAX_LOG_BYTES, keep: int = KEEP_ROTATED, stdio_follows: bool = False
    ) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.keep = keep
        self.stdio_follows = stdio_follows
        """Each (re)open points this process's stdout and stderr at the new file, where they were on
        this log's files (a supervisor's trainer: launched with its output on run.log)."""
        self._fd: int | None = None
        self._lock = threading.Lock()

    def write(self, text: str) -> None:
        data = text.encode("utf-8", errors="replace")
        with self._lock:
            fd = self._current_fd()
            os.write(fd, data)
            past_cap = os.fstat(fd).st_size > self.max_bytes
            if past_cap and rotate_if_needed(self.path, self.max_bytes, self.keep):
                self._close_fd()

    def fileno(self) -> int:
        """The descriptor of the current file (for a child's stdout: it stays on that file)."""
        with self._lock:
            return self._current_fd()

    def close(self) -> None:
        with self._lock:
            self._close_fd()

    def _current_fd(self) -> int:
        if self._fd is not None and not _same_file(self.path, self._fd):
            self._close_fd()  # another writer rotated it
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            if self.stdio_follows:
                self._move_stdio_here()
        return self._fd

    def _move_stdio_here(self) -> None:
        """Point stdout and stderr at the current file where they are on this log or a rotated one
        (a terminal, or any other file, is left alone)."""
        assert self._fd is not None
        ours = {str(self.path.resolve())} | {str(rotated_path(self.path, n).resolve()) for n in range(1, self.keep + 1)}
        for std in (1, 2):
            try:
                target = os.readlink(f"/proc/self/fd/{std}").removesuffix(" (deleted)")
            except OSError:
                continue  # closed, or no /proc
            if target in ours and not _same_file(self.path, std):
                for stream in (sys.stdout, sys.stderr):
                    with contextlib.suppress(AttributeError, OSError, ValueError):  # replaced, or closed
                        if stream.fileno() == std:
                            stream.flush()  # what is buffered belongs to the old file
                os.dup2(self._fd, std)

    def _close_fd(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
