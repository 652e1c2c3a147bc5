"""The host's cores shared among the CPU training lines running on it.

Why: torch's CPU build runs an operation on a team of OpenMP threads that spin while they wait for
work. Two CPU lines on a 2-core host, each with a team of 2, spend most of their time spinning
against each other: `bench/cpu_sharing.py` on this project's 2-core machine (2026-12-06) trained
8,913 pssa-1.5m tokens/s in all with two processes of 2 threads, against 14,038 with one alone
and 19,933 with two processes of 1 thread.

So every CPU trainer that owns its process holds a seat, and so does a `sample`, `chat` or `eval`
on the CPU (a sampler beside a training line spun against it the same way: 29 tokens/s where it
made 134 with one thread): an exclusive `flock` on
`<run dir>/cpu/<pid>.lock` (the registry's directory, one for every process of the user on this
host), which the kernel releases however the trainer ends. Every `CHECK_SECONDS` a trainer counts
the seats held and runs `cores // seats` threads (at least one), where `cores` is the team torch
gave this process at its start. A seat file whose lock nobody holds is a dead trainer's: the
counter removes it.

Determinism: a thread count that changes mid-line changes no bit of the line. The PSSA kernels split
their work per row and channel and add in a fixed order; torch's matrix products and reductions
at this project's shapes gave the same bits at 1 and 2 threads (`test_cpu_share.py` trains a line
whose threads change every update and compares it with one that never shares).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine.supervisor.registry import runtime_dir

CHECK_SECONDS = 2.0
"""How often a trainer counts the seats (a directory listing and a lock try per seat)."""


def seats_directory() -> Path:
    """`<run dir>/cpu`, created 0700 if missing."""
    directory = runtime_dir() / "cpu"
    directory.mkdir(mode=0o700, exist_ok=True)
    return directory


def _held_by_another(path: Path) -> bool:
    """Whether another process holds `path`'s lock; a seat nobody holds is removed (a dead trainer's)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False  # removed meanwhile: its trainer released it
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        # Ours now, so dead. Unlink only the file we locked: a new trainer of the same pid may have
        # renamed a fresh seat onto the name since we opened it.
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                path.unlink()
        return False
    finally:
        os.close(fd)


class CpuSeat:
    """This process's seat among the host's CPU trainers and generators, and the thread count it implies."""

    def __init__(self, directory: Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.directory = directory
        self.cores = torch.get_num_threads()
        """The team torch gave this process at its start: the most threads it runs."""
        self._clock = clock
        self._checked: float | None = None
        self.path = directory / f"{os.getpid()}.lock"
        # Locked under a temporary name, then renamed into place: a counter never sees the seat
        # unlocked (it would take it for a dead trainer's and remove it).
        claiming = directory / f".{os.getpid()}.claiming"
        self._fd = os.open(claiming, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        os.replace(claiming, self.path)

    @classmethod
    def take(cls) -> CpuSeat:
        """A seat in this host's run directory."""
        return cls(seats_directory())

    def seats(self) -> int:
        """Seats held on this host, this one included."""
        others = [path for path in self.directory.glob("*.lock") if path != self.path]
        return 1 + sum(_held_by_another(path) for path in others)

    def share(self) -> str | None:
        """At most every CHECK_SECONDS: run `cores // seats` threads. Returns a line for run.log when
        the count changes, else None."""
        now = self._clock()
        if self._checked is not None and now - self._checked < CHECK_SECONDS:
            return None
        self._checked = now
        seats = self.seats()
        threads = max(1, self.cores // seats)
        before = torch.get_num_threads()
        if threads == before:
            return None
        torch.set_num_threads(threads)
        who = "the only CPU process of nsconsole on" if seats == 1 else f"{seats} CPU processes of nsconsole share"
        return f"CPU threads {before} -> {threads}: {who} this host's {self.cores} cores"

    def release(self) -> None:
        """Give the seat up (the kernel does so at exit too; this also removes the file)."""
        if self._fd < 0:
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        os.close(self._fd)
        self._fd = -1
