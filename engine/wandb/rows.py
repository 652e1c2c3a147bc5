"""Reading rows.jsonl for W&B: the rows to re-send or backfill, in order.

The trainer appends rows.jsonl while the mirror reads it, so its last line may be torn; such a
line (or any line that is not a JSON object with an integer `update`) is skipped, never fatal.
A row's W&B step is its `update`.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from engine.config.run import SAMPLES_KEY

logger = logging.getLogger("nsconsole.wandb")


def row_update(row: Any) -> int | None:
    """The row's update (its W&B step), or None for something that is not a row."""
    if not isinstance(row, dict):
        return None
    update = row.get("update")
    if isinstance(update, bool) or not isinstance(update, int) or update < 0:
        return None
    return update


def row_values(row: dict[str, Any]) -> dict[str, Any]:
    """What W&B gets of a row: every key but `update`, which is the step, and a validation's
    samples: text that W&B's history would keep as an opaque list per step, no series to plot
    (rows.jsonl and the console's samples tab hold them)."""
    return {key: value for key, value in row.items() if key not in ("update", SAMPLES_KEY)}


def read_rows(path: Path, after: int | None = None, through: int | None = None) -> Iterator[dict[str, Any]]:
    """The rows of `path` with `after < update <= through` (None: unbounded), in file order.

    Updates are kept strictly increasing (a row not above the previous one yielded is skipped):
    W&B steps must only grow within a run.
    """
    try:
        handle = path.open("r", encoding="utf-8")
    except FileNotFoundError:
        return
    last = after
    with handle:
        start = 0 if after is None else rows_start_after(path, after)
        handle.seek(start)
        for line_number, line in enumerate(handle, start=1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                # A torn last line is normal while the trainer writes; anything else is worth a word.
                if line.endswith("\n"):
                    logger.warning("%s: line %d is not JSON; not sent to W&B", path.name, line_number)
                continue
            update = row_update(row)
            if update is None:
                logger.warning("%s: line %d has no integer update; not sent to W&B", path.name, line_number)
                continue
            if through is not None and update > through:
                break
            if last is not None and update <= last:
                continue
            last = update
            yield row


_UPDATE = re.compile(rb'"update": (\d+)')
BACKWARD_BLOCK = 1 << 20
"""Bytes read at a time while looking for where a gap begins, from the end of rows.jsonl."""


def rows_start_after(path: Path, after: int) -> int:
    """The byte offset just past the last row at or before update `after`, found by reading
    rows.jsonl backwards (the trainer cuts it back on a resume, so its updates only grow):
    re-sending a gap costs what the gap holds, not the months of rows before it. 0 when every row
    is after `after`."""
    with open(path, "rb") as handle:
        end = os.fstat(handle.fileno()).st_size
        carry = b""  # the line the later block began inside, up to that block's start
        while end > 0:
            begin = max(0, end - BACKWARD_BLOCK)
            handle.seek(begin)
            data = handle.read(end - begin) + carry
            whole_from = data.find(b"\n") + 1 if begin else 0  # where this block's whole lines begin
            if begin and not whole_from:
                carry, end = data, begin
                continue
            cursor = begin + whole_from
            starts = []
            lines = data[whole_from:].split(b"\n")[:-1]  # the last piece: a torn line, or nothing
            for line in lines:
                starts.append(cursor)
                cursor += len(line) + 1
            for line, line_start in zip(reversed(lines), reversed(starts), strict=True):
                match = _UPDATE.search(line)
                if match is not None and int(match[1]) <= after:
                    return line_start + len(line) + 1
            carry, end = data[:whole_from], begin
    return 0
