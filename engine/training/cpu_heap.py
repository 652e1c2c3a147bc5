"""Keep a CPU training process's freed memory for its next update (glibc's malloc).

A CPU update allocates and frees the same large temporaries every time (the logits and their
log-softmax: 4 MiB each at 8 x 64 tokens and vocab 2048). By default glibc gives blocks above its
mmap threshold back to the kernel as they are freed, and trims the heap's free top once it passes
the trim threshold (twice the mmap threshold, which it raises as large blocks come and go), so the
next update takes the same memory back as fresh pages: 1,000-2,000 page faults and about 3-4 ms of
a 30 ms pssa-1.5m or transformer-1.5m update on the 2-core dev machine (bench/RESULTS.md,
session 16). With the mmap threshold fixed at its ceiling (32 MiB on 64-bit) and the trim threshold
at 1 GiB the temporaries stay in the heap: no page fault after the first update. The cost: the
process keeps its peak resident memory, which its next update needs again anyway.

The setting is process-wide, so it is made only in a process that trains or benchmarks on the
CPU, never in the supervisor or the console, and not in a GPU trainer (whose host copies of a
checkpoint, hundreds of MiB to GiB, would then stay resident between checkpoints).
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""glibc's `mallopt` parameter numbers (malloc.h)."""

MMAP_THRESHOLD_BYTES = 32 << 20
"""glibc's largest mmap threshold on 64-bit (`DEFAULT_MMAP_THRESHOLD_MAX`): blocks above it are
still mapped and unmapped on their own (a larger value is refused)."""

TRIM_THRESHOLD_BYTES = 1 << 30
"""Free memory at the heap's top kept before glibc returns it to the kernel."""


def keep_freed_memory() -> bool:
    """Set glibc's thresholds as above; False where the C library has no `mallopt` or refuses
    them (not glibc), and nothing changes."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # The mmap threshold first: setting either turns off glibc's moving threshold, and with the
    # trim threshold alone every block over 128 KiB would be mapped anew.
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
