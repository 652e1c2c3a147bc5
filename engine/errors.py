"""Errors a user can act on.

Anything raised as a `LineError` is printed by the command line as one line (no traceback)
naming the file and the problem, and the command exits with status 2. Raise it only *before*
anything is written, or after whatever was already saved is known to be intact.
"""

from __future__ import annotations

import errno

DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
"""No space left on the device (bytes or inodes), or the user's quota reached: the same to a line."""


def disk_full_error(error: BaseException) -> OSError | None:
    """The disk-full OSError `error` is or was raised from (a write in a `finally` may carry it as
    its context), else None."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in DISK_FULL_ERRNOS:
            return current
        current = current.__cause__ or current.__context__
    return None


class LineError(Exception):
    """A problem with a training line's files or settings that the user can fix."""


class ConfigError(LineError):
    """run.json (or host.json) is missing, malformed or invalid."""


class CheckpointError(LineError):
    """A checkpoint is missing, truncated or corrupted."""


class DiskFull(LineError):
    """Free disk fell below `guards.min_free_disk_gb`: the line stopped for the operator."""


class NonFiniteLogits(LineError):
    """A model's next-token logits hold NaN or inf: no token can be drawn from them. Finite
    weights can still get there (activations that overflow in a diverged model); the draw would
    otherwise be a torch error (multinomial) or, at temperature 0, a silent argmax of NaN."""


def is_out_of_memory(error: BaseException) -> bool:
    """A device allocation failed (torch.OutOfMemoryError, or a RuntimeError that says so: a
    failed allocation inside a graph capture or a compiled kernel arrives as one)."""
    return type(error).__name__ == "OutOfMemoryError" or "out of memory" in str(error).lower()
