"""Reading rows.jsonl for W&B: the rows to re-send or backfill, in order.

The trainer appends rows.jsonl while the mirror reads it, so its last line may be torn; such a
line (or any line that is not a JSON object with an integer `update`) is skipped, never fatal.
A row's W&B step is its `update`.
"""

from __future__ import annotations

import json
import logging
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
