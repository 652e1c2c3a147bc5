"""A child of the supervisor that ends with it: `python -m engine.supervisor.child PID PROGRAM [ARG...]`.

Sets `PR_SET_PDEATHSIG` to SIGTERM (the kernel sends it when the parent dies, however it dies;
it survives the `exec`), checks that the parent `PID` is still the parent (one that died before
the prctl would otherwise go unnoticed) and executes PROGRAM in its place. The supervisor runs
the data preparer this way; the trainer (`engine/training/main.py`) calls `die_with_parent`
itself. A SIGTERM stops either cleanly: the trainer at its next update with a checkpoint, the
preparer with its status saying `stopped`.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Sequence

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> bool:
    """Ask for SIGTERM when the parent dies; False when it already has (we were reparented)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    # Checked after the prctl: a parent that died before it would otherwise go unnoticed.
    return os.getppid() == parent_pid


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if len(arguments) < 2 or not arguments[0].isdigit():
        print("usage: python -m engine.supervisor.child PARENT_PID PROGRAM [ARG...]", file=sys.stderr)
        return 2
    if not die_with_parent(int(arguments[0])):
        return 128 + signal.SIGTERM
    os.execvp(arguments[1], arguments[1:])
    return 127  # not reached: execvp replaces this process or raises


if __name__ == "__main__":
    raise SystemExit(main())
