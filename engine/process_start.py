"""Which process a pid names, across steps of the wall clock.

psutil gives a process's start as the boot time the kernel reports now plus the clock ticks from
boot to the start; that boot time moves with every step of the wall clock (an NTP step, a resumed
VM), so a start recorded before a step no longer matches the same process's after it, and a live
process looks like one that reused its pid. Seconds since boot do not move: they are what the
supervisor's registry entry, supervisor.json and the heartbeat record to tell the two apart.
"""

from __future__ import annotations

import psutil

SAME_START_TOLERANCE_S = 0.05
"""Start times come from clock ticks (10 ms on Linux); allow for their rounding."""


def started_since_boot(process: psutil.Process) -> float:
    """`process`'s start in seconds since boot (its wall-clock start less the boot time read now)."""
    return process.create_time() - psutil.boot_time()


def started_as_recorded(process: psutil.Process, boot_start: float) -> bool:
    """Whether `process` started when `boot_start` (seconds since boot) says: the same process."""
    return abs(started_since_boot(process) - boot_start) <= SAME_START_TOLERANCE_S


def is_recorded_process(process: psutil.Process, boot_start: object, started_by: object) -> bool:
    """Whether `process` is the one recorded: started at `boot_start` (seconds since boot) where that
    was recorded, else (files of an older version) no later than `started_by` (a wall-clock time, a
    second's slack for the ticks' rounding), else taken as it."""
    if isinstance(boot_start, (int, float)) and not isinstance(boot_start, bool):
        return started_as_recorded(process, float(boot_start))
    if isinstance(started_by, (int, float)) and not isinstance(started_by, bool):
        return process.create_time() <= float(started_by) + 1.0
    return True


def recorded_process_alive(pid: object, boot_start: object, started_by: object) -> bool:
    """Whether `pid` runs (not a zombie) and is the process a file recorded (`is_recorded_process`),
    not a younger one that reused the pid; another user's process counts as running."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        return is_recorded_process(process, boot_start, started_by)
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True
