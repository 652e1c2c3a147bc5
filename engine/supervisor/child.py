"""A child of the supervisor that ends with it.

`die_with_parent(PID)` sets `PR_SET_PDEATHSIG` to SIGTERM (the kernel sends it when the parent
dies, however it dies) and checks that `PID` is still the parent (one that died before the prctl
would otherwise go unnoticed). The trainer (`engine/training/main.py`) and the supervisor's other
children (`engine/supervisor/children.py`) call it first. A SIGTERM stops each cleanly: the
trainer at its next update with a checkpoint, the preparer with its status saying `stopped`.
"""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> bool:
    """Ask for SIGTERM when the parent dies; False when it already has (we were reparented)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    # Checked after the prctl: a parent that died before it would otherwise go unnoticed.
    return os.getppid() == parent_pid
