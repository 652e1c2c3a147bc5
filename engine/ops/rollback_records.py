"""A line's record of its rollbacks: the rows.rolledback-<time>.jsonl files a rollback keeps.

Each holds the rows its rollback set aside: rows.jsonl past the rows of the checkpoint the line went
back to, byte for byte (`keep_rolled_back_rows`). Files made before that held the whole rows.jsonl
as it was, gigabytes on a line of months; their rows past the point are the same, and what reads
these files -- the time in the name (`rollback_times`: the console's history, a supervisor's
`status`) -- reads both alike.

Kept apart from the rollback operation (engine.ops.rollback, which reopens data cycles and so
loads numpy and pyarrow) because the console reads the record on its light start.
"""

from __future__ import annotations

import calendar
import os
import shutil
import time
from pathlib import Path

from engine.atomic import fsync_directory
from engine.layout import LineLayout

ROLLED_BACK_ROWS_PREFIX = "rows.rolledback-"
"""rows.rolledback-<UTC time>[-N].jsonl: the rows a rollback set aside, and the record of when it was made."""
STAMP_FORMAT = "%Y%m%dT%H%M%SZ"
_PARTIAL_SUFFIX = ".partial"
"""`.<name>.partial`: a copy being written (hidden, so no reader counts it as a rollback yet)."""
_COPY_CHUNK = 8 << 20


def rolled_back_rows_path(layout: LineLayout) -> Path:
    """rows.rolledback-<UTC time>.jsonl, numbered when a rollback in the same second made one already."""
    stamp = time.strftime(STAMP_FORMAT, time.gmtime())
    path = layout.root / f"{ROLLED_BACK_ROWS_PREFIX}{stamp}.jsonl"
    number = 2
    while path.exists():
        path = layout.root / f"{ROLLED_BACK_ROWS_PREFIX}{stamp}-{number}.jsonl"
        number += 1
    return path


def keep_rolled_back_rows(layout: LineLayout, after_bytes: int) -> Path:
    """Keep the rows a rollback sets aside, rows.jsonl past its first `after_bytes` bytes (the rows
    of the checkpoint it goes back to), as rows.rolledback-<time>.jsonl; returns that path.

    Written under a hidden name, fsynced and renamed into place: a crash leaves no file that
    records a rollback which did not happen (a leftover is removed by the next rollback).
    """
    for leftover in layout.root.glob(f".{ROLLED_BACK_ROWS_PREFIX}*{_PARTIAL_SUFFIX}"):
        leftover.unlink(missing_ok=True)
    path = rolled_back_rows_path(layout)
    partial = path.with_name(f".{path.name}{_PARTIAL_SUFFIX}")
    try:
        with open(layout.rows_jsonl, "rb") as rows, open(partial, "wb") as copy:
            rows.seek(after_bytes)
            shutil.copyfileobj(rows, copy, _COPY_CHUNK)
            copy.flush()
            os.fsync(copy.fileno())
        os.replace(partial, path)
    except BaseException as error:
        partial.unlink(missing_ok=True)  # a full disk, say: nothing half-written is left behind
        if isinstance(error, OSError) and error.filename is None:  # a failed write names no file
            raise OSError(error.errno, error.strerror, str(path)) from None
        raise
    fsync_directory(layout.root)
    return path


def rollback_times(layout: LineLayout) -> list[float]:
    """When each rollback of the line was made (Unix seconds, oldest first), read from the names of
    its rows.rolledback-<time>.jsonl copies: whoever made it (a supervisor, or `nsconsole rollback`
    on a line nothing ran), and however many supervisors ago. A file of another name is skipped."""
    times = []
    for path in layout.root.glob(f"{ROLLED_BACK_ROWS_PREFIX}*.jsonl"):
        stamp = path.name[len(ROLLED_BACK_ROWS_PREFIX):].split(".", 1)[0].split("-", 1)[0]
        try:
            times.append(float(calendar.timegm(time.strptime(stamp, STAMP_FORMAT))))
        except ValueError:
            continue
    return sorted(times)
