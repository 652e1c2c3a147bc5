"""Room kept for the supervisor's last words on a full disk.

When the disk fills between two checkpoints, the trainer stops (`TrainerExitCode.DISK_FULL`) and
the supervisor must still record why: supervisor.json's state `disk-full`, its event, a few
run.log lines. A full disk has no block for them (an atomic rewrite needs a new file), so each
supervisor sets aside `RESERVE_BYTES` in the line directory at its start and gives them back
at the first write that finds the disk full, then writes again.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from engine.errors import DISK_FULL_ERRNOS

RESERVE_NAME = ".supervisor.reserve"
RESERVE_BYTES = 1 << 20
"""Set aside at each start: far more than supervisor.json and the last run.log lines take."""


def is_disk_full(error: BaseException) -> bool:
    return isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS


class DiskReserve:
    """A file of `size` allocated bytes that `release()` frees for the writes that need them."""

    def __init__(self, path: Path, size: int = RESERVE_BYTES) -> None:
        self.path = path
        self.size = size

    def make(self) -> bool:
        """Allocate it (its blocks, not a sparse file); False when the disk has no room even for it."""
        try:
            descriptor = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError:
            return False
        try:
            os.posix_fallocate(descriptor, 0, self.size)
            os.fsync(descriptor)
        except OSError:
            os.close(descriptor)
            self.path.unlink(missing_ok=True)
            return False
        os.close(descriptor)
        return True

    def release(self) -> bool:
        """Free it; False when there was nothing left to free."""
        with contextlib.suppress(OSError):
            if self.path.exists():
                self.path.unlink()
                return True
        return False
