"""The trainer's own records in the line directory: rows.jsonl, run.log and heartbeat.

- `RowsFile`: one JSON object per line, every logged row; flushed per row (a reader sees whole
  rows), fsynced when a checkpoint is made durable; on resume cut back to the rows the
  checkpoint counted, so replayed updates are not written twice.
- `RunLog`: timestamped text lines, appended and flushed (the supervisor writes here too).
- `Heartbeat`: a small JSON file (time, update, stage, pid) replaced atomically after every update;
  the supervisor's watchdog reads its age. Not fsynced: it is a liveness signal, not a record.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, TextIO

import psutil

from engine.errors import LineError
from engine.logrotate import MAX_LOG_BYTES, RotatingLog
from engine.process_start import started_since_boot


class RowsFile:
    """Append-only rows.jsonl with an explicit durable point (see the module docstring)."""

    def __init__(self, path: Path):
        self.path = path
        self._handle: TextIO = open(path, "a", encoding="utf-8")  # noqa: SIM115 - held for the run
        self.rows = _count_lines(path)
        self.bytes = path.stat().st_size

    @staticmethod
    def cut_back(path: Path, rows: int, size: int) -> None:
        """Truncate rows.jsonl to the first `rows` rows (`size` bytes), as recorded in a checkpoint.

        A file shorter than the checkpoint says (rows lost to a crash of the disk, or edited)
        cannot be repaired from here: refuse rather than continue with a hole in the record.
        """
        problem = rows_problem(path, rows, size)
        if problem is not None:
            raise LineError(problem)
        if not path.exists():
            path.touch()
            return
        with open(path, "rb+") as handle:
            handle.truncate(size)
            handle.flush()
            os.fsync(handle.fileno())

    def append(self, row: dict[str, Any]) -> None:
        """Write one row and flush it to the OS (whole lines only)."""
        line = json.dumps(row, sort_keys=True, allow_nan=True) + "\n"
        self._handle.write(line)
        self._handle.flush()
        self.rows += 1
        self.bytes += len(line.encode())

    def sync(self) -> None:
        """Make every appended row durable (called before a checkpoint's `latest` moves).

        Called from the checkpoint thread: rows are flushed by `append` in the loop's thread, so
        only the descriptor is synced here (a text file object must not be used from two threads).
        """
        os.fsync(self._handle.fileno())

    def close(self) -> None:
        self._handle.close()


def _count_lines(path: Path) -> int:
    with open(path, "rb") as handle:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: handle.read(1 << 20), b""))


class RunLog:
    """run.log: timestamped lines, echoed to a terminal stream when one is given.

    Rotated past `max_bytes` while the trainer runs (engine.logrotate), not only between launches:
    one launch of a weeks-long line printing a row per update can outgrow any bound on its own.
    """

    def __init__(self, path: Path, echo: TextIO | None = None, max_bytes: int = MAX_LOG_BYTES):
        self._log = RotatingLog(path, max_bytes, stdio_follows=True)  # a crash's traceback lands in run.log
        self._echo = echo

    def write(self, message: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
        self._log.write(f"{stamp} trainer: {message}\n")
        if self._echo is not None:
            print(message, file=self._echo, flush=True)

    def close(self) -> None:
        self._log.close()


def not_a_file_problem(path: Path, what: str) -> str | None:
    """Why `path`, where there is one, is not the regular file `what` must be (a directory, a
    device, unreadable), in one line; None when it is one or there is none."""
    if not os.path.lexists(path):
        return None
    if path.is_dir():
        return f"{path}: a directory, not {what}; move it away"
    if not path.is_file():
        return f"{path}: not a regular file, so not {what}; move it away"
    if not os.access(path, os.R_OK):
        return f"{path}: not readable (permissions)"
    return None


def rows_file_problem(path: Path) -> str | None:
    """Why rows.jsonl is not a file its rows can be read from and appended to (None: it is, or there is none)."""
    return not_a_file_problem(path, "the file of the line's rows")


def heartbeat_file_problem(path: Path) -> str | None:
    """Why the heartbeat is not a file a beat can replace and a reader read (None: it is, or there is none)."""
    return not_a_file_problem(path, "the line's heartbeat file")


def rows_problem(path: Path, rows: int, size: int) -> str | None:
    """Why rows.jsonl cannot be cut back to a checkpoint's `rows` rows in `size` bytes (None: it can):
    not a readable file, missing, shorter than the checkpoint says, or its first `size` bytes not
    `rows` whole rows. What `RowsFile.cut_back` refuses at a start and `nsconsole check` reports
    before one."""
    unusable = rows_file_problem(path)
    if unusable is not None:
        return unusable
    if not path.exists():
        return None if not rows else f"{path}: missing, but the checkpoint counts {rows} rows"
    actual = path.stat().st_size
    if actual < size:
        return f"{path}: {actual} bytes, the checkpoint counts {rows} rows in {size}"
    newlines, last = prefix_lines(path, size)
    if newlines != rows or (size and last != b"\n"):
        return f"{path}: its first {size} bytes do not hold the checkpoint's {rows} rows"
    return None


def prefix_lines(path: Path, size: int) -> tuple[int, bytes]:
    """(newlines in the first `size` bytes of `path`, the last of those bytes), read a MiB at a
    time: a rows.jsonl of months is gigabytes, and a check or a resume must not hold it whole."""
    count, last, left = 0, b"", size
    with open(path, "rb") as handle:
        while left > 0:
            chunk = handle.read(min(left, 1 << 20))
            if not chunk:
                break
            count += chunk.count(b"\n")
            last, left = chunk[-1:], left - len(chunk)
    return count, last


class Heartbeat:
    """The heartbeat file, replaced atomically (rename) on every beat."""

    def __init__(self, path: Path):
        # A beat replaces the file by a rename, which fails over a directory: refused at the start
        # in one line, not as a traceback at the first update's beat.
        problem = heartbeat_file_problem(path)
        if problem is not None:
            raise LineError(problem)
        self.path = path
        self._temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        self._lock = threading.Lock()  # a long phase beats from a side thread (training/phase_beat.py)
        # The beating process's start in seconds since boot: with `pid`, which process beat, whatever
        # the wall clock did since (engine.process_start).
        self._pid_boot_start = started_since_boot(psutil.Process())

    def beat(self, update: int, stage: str, **details: Any) -> None:
        document = {"time": time.time(), "update": update, "stage": stage, "pid": os.getpid(),
                    "pid_boot_start": self._pid_boot_start, **details}  # fmt: skip
        with self._lock:
            self._temporary.write_text(json.dumps(document, sort_keys=True) + "\n", encoding="utf-8")
            os.replace(self._temporary, self.path)


def format_row(row: dict[str, Any]) -> str:
    """The terminal / run.log form of a row: update, tokens, loss, lr, grad norm, tokens/s."""
    skipped = "  SKIPPED (non-finite gradient)" if row.get("skipped") else ""
    return (
        f"update {row['update']:>7}  tokens {row['tokens']:>13,}  loss {row['loss']:.4f}  "
        f"lr {row['lr']:.3e}  grad_norm {row['grad_norm']:.3f}  {row['tokens_per_s']:>9,.0f} tok/s{skipped}"
    )
