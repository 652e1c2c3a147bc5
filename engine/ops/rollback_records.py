"""A line's record of its rollbacks: the rows.rolledback-<time>.jsonl copies a rollback keeps.

Kept apart from the rollback operation (engine.ops.rollback, which reopens data cycles and so
loads numpy and pyarrow) because the console reads the record on its light start.
"""

from __future__ import annotations

import calendar
import time
from pathlib import Path

from engine.layout import LineLayout

ROLLED_BACK_ROWS_PREFIX = "rows.rolledback-"
"""rows.rolledback-<UTC time>[-N].jsonl: a rollback's copy of rows.jsonl, and the record of when it was made."""
STAMP_FORMAT = "%Y%m%dT%H%M%SZ"


def rolled_back_rows_path(layout: LineLayout) -> Path:
    """rows.rolledback-<UTC time>.jsonl, numbered when a rollback in the same second made one already."""
    stamp = time.strftime(STAMP_FORMAT, time.gmtime())
    path = layout.root / f"{ROLLED_BACK_ROWS_PREFIX}{stamp}.jsonl"
    number = 2
    while path.exists():
        path = layout.root / f"{ROLLED_BACK_ROWS_PREFIX}{stamp}-{number}.jsonl"
        number += 1
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
