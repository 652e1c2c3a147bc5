"""How the console holds a line's rows between redraws.

Rows are kept compactly (`Series`: the handful of numbers the table and the curves need: every
row of the newest ones, a downsampled history of the older ones, at most `MAX_POINTS`), plus the
newest full rows and the newest validation rows. A resumed trainer writes the
replayed updates again: a row whose update is not past the last one cuts the series back first.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from engine.supervisor.rows_digest import extremes

RECENT_ROWS = 256
"""Full rows kept per line (the health checks look at these)."""
FULL_ROWS = 2048
"""The newest rows the console reads whole when it attaches to a line (or reads one at rest); the
older ones come as the downsampled history (`engine.supervisor.rpc.RowsDigest`)."""
MAX_POINTS = 8192
"""Points a line's `Series` holds at most: past it, all but its newest `FULL_ROWS` are thinned
(`Series.thin`), so a console left open for weeks holds what it held on the first day."""
THIN_GROUP = 6
"""Consecutive points that `Series.thin` replaces by their `extremes` (at most 3 of them)."""
MAX_VALIDATIONS = 512
"""Validation rows kept per line."""

_VAL_MIX = re.compile(r"^val_(\d+)/mix$")


@dataclass
class Series:
    """The numbers of every training row the table and the curves need, column by column."""

    update: list[int] = field(default_factory=list)
    tokens: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    time: list[float] = field(default_factory=list)
    """When each row was written (Unix time; the curves' time axis)."""
    cycle: list[float] = field(default_factory=list)
    """The data cycle of each row's update (the curves mark where one ends)."""

    def __len__(self) -> int:
        return len(self.update)

    def append(self, row: dict[str, Any]) -> None:
        self.update.append(int(row["update"]))
        self.tokens.append(_number(row.get("tokens")))
        self.loss.append(_number(row.get("loss")))
        self.lr.append(_number(row.get("lr")))
        self.grad_norm.append(_number(row.get("grad_norm")))
        self.tokens_per_s.append(_number(row.get("tokens_per_s")))
        self.skipped.append(bool(row.get("skipped")))
        self.time.append(_number(row.get("time")))
        self.cycle.append(_number(row.get("cycle")))

    def thin(self, keep_newest: int) -> None:
        """Replace every `THIN_GROUP` consecutive points before the newest `keep_newest` by their
        `extremes` (lowest and highest loss, highest gradient norm): about half as many points, and
        a spike stays visible."""
        older = len(self) - keep_newest
        if older < THIN_GROUP:
            return
        points = [(index, {name: getattr(self, name)[index] for name in ("loss", "grad_norm")})
                  for index in range(older)]
        kept = [index for start in range(0, older, THIN_GROUP) for index, _ in extremes(points[start:start + THIN_GROUP])]
        kept += range(older, len(self))
        for column in self._columns():
            column[:] = [column[index] for index in kept]

    def cut_from(self, update: int) -> None:
        """Drop every row of `update` and later (a resume writes them again)."""
        keep = len(self.update)
        while keep and self.update[keep - 1] >= update:
            keep -= 1
        for column in self._columns():
            del column[keep:]

    def _columns(self) -> tuple[list[Any], ...]:
        return tuple(getattr(self, name) for name in COLUMN_NAMES)


COLUMN_NAMES = ("update", "tokens", "loss", "lr", "grad_norm", "tokens_per_s", "skipped", "time", "cycle")
"""`Series`' columns, in its order."""


def joined_rows(history: list[dict[str, Any]], newest: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A line's rows as the console holds them: the downsampled history before the newest rows,
    then the newest rows whole."""
    first = next((row.get("update") for row in newest if isinstance(row.get("update"), int)), None)
    older = history if first is None else [row for row in history if _number(row.get("update")) < first]
    return [*older, *newest]


def _number(value: Any) -> float:
    """A row's number, NaN where it is missing or not a number (a NaN loss arrives as null)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    return float(value)


def validation_loss(row: dict[str, Any]) -> float | None:
    """The headline validation loss of a validation row: `val_<L>/mix` at the row's length if present."""
    seq_len = row.get("seq_len")
    preferred = f"val_{seq_len}/mix"
    if isinstance(row.get(preferred), (int, float)):
        return float(row[preferred])
    mixes = sorted((int(match[1]), key) for key in row if (match := _VAL_MIX.match(key)))
    if mixes and isinstance(row[mixes[0][1]], (int, float)):
        return float(row[mixes[0][1]])
    for key, value in row.items():
        if key.startswith("val_") and key.endswith("/mean") and isinstance(value, (int, float)):
            return float(value)
    return None
