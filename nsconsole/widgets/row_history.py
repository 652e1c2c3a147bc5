"""Rows of a line that the console does not hold in full: a branch's trunk up to the fork (drawn
under the branch's curves) and the whole history of a reading pinned to the curves.

A line whose supervisor the console is attached to is asked, in what does not grow with the line's
age: a trunk as the console holds a line (`nsconsole.row_fetch.line_rows`: its newest rows after a
downsampled history), a pinned reading as about 2,000 buckets of its lowest and highest values
(`series`). Otherwise its rows.jsonl is read, but only at rest (`nsconsole.history.read_at_rest`: no
live supervisor or trainer writes it; a pinned reading is then bucketed from the file as a
supervisor's `series` would: `resting_series`). A line being written whose supervisor is not
attached raises `HistoryUnavailable`: the caller asks again later.
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from engine.supervisor.rows_digest import COMPACT_KEYS
from nsconsole.history import read_at_rest, resting_series
from nsconsole.row_fetch import line_rows, reading_points
from nsconsole.state import LineBook, LineView


class HistoryUnavailable(Exception):
    """The rows cannot be had now (the line is written and its supervisor is not attached)."""


class RowsCaller(Protocol):
    """The console's live link (`LiveLines`), as far as a history needs it."""

    async def call(self, key: str, method: str, **params: Any) -> Any: ...

    def methods(self, key: str) -> frozenset[str]: ...


@dataclass
class History:
    """Named numbers of a line's rows along its update, tokens and time, row by row."""

    names: tuple[str, ...]
    """The readings kept (a row holding none of them is left out)."""
    update: list[float] = field(default_factory=list)
    tokens: list[float] = field(default_factory=list)
    time: list[float] = field(default_factory=list)
    values: dict[str, list[float]] = field(default_factory=dict)
    """Each name's value per kept row (NaN where the row lacks it)."""

    def add(self, row: dict[str, Any]) -> None:
        if "omitted" in row or not any(name in row for name in self.names):
            return
        self.update.append(_number(row.get("update")))
        self.tokens.append(_number(row.get("tokens")))
        self.time.append(_number(row.get("time")))
        for name in self.names:
            self.values.setdefault(name, []).append(_number(row.get(name)))

    def add_point(self, point: list[Any]) -> None:
        """One `[index, update, tokens, time, value]` point of a `series` reply (one name's history)."""
        _, update, tokens, when, value = point
        self.update.append(_number(update))
        self.tokens.append(_number(tokens))
        self.time.append(_number(when))
        self.values.setdefault(self.names[0], []).append(_number(value))

    def add_points_until(self, points: Iterable[list[Any]], until_update: float) -> History:
        """`add_point` each point up to `until_update`; this history."""
        for point in points:
            if _number(point[1]) > until_update:
                break
            self.add_point(point)
        return self

    def add_rows_until(self, rows: Iterable[dict[str, Any]], until_update: float) -> History:
        """`add` each row up to `until_update`; this history."""
        for row in rows:
            if _number(row.get("update")) > until_update:
                break
            self.add(row)
        return self

    def extend(self, rows: Iterable[dict[str, Any]]) -> None:
        """Rows newer than the last one held (a row at or before it is already in)."""
        last = self.last_update
        for row in rows:
            if _number(row.get("update")) > last:
                self.add(row)

    @property
    def last_update(self) -> float:
        """The newest update held; -inf while none is."""
        return self.update[-1] if self.update else -math.inf


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    return float(value)


def find_line(book: LineBook, path: str) -> LineView | None:
    """The book's line at `path` (compared resolved: run.json and branches.json hold absolute paths)."""
    wanted = Path(path).resolve()
    return next((line for line in book if Path(line.path).resolve() == wanted), None)


async def fetch_history(
    live: RowsCaller | None, book: LineBook, path: str, names: tuple[str, ...], until_update: float = math.inf
) -> History:
    """The rows of the line at `path` up to `until_update`, asked or read (see the module docstring)."""
    line = find_line(book, path)
    if line is not None and line.connected and live is not None:
        return await _ask(live, line.key, names, until_update)
    if len(names) == 1 and names[0] not in COMPACT_KEYS:
        points = await asyncio.to_thread(resting_series, path, names[0])
        if points is None:
            raise HistoryUnavailable(f"{path}: being written and its supervisor is not attached")
        return History(names).add_points_until(points, until_update)
    resting = await asyncio.to_thread(read_at_rest, path)
    if resting is None:
        raise HistoryUnavailable(f"{path}: being written and its supervisor is not attached")
    return History(names).add_rows_until(resting.rows, until_update)


async def _ask(live: RowsCaller, key: str, names: tuple[str, ...], until_update: float) -> History:
    methods = live.methods(key)
    call = functools.partial(live.call, key)
    if len(names) == 1 and names[0] not in COMPACT_KEYS and "series" in methods:
        total = int((await call("status")).get("rows") or 0)
        return History(names).add_points_until(await reading_points(call, names[0], total), until_update)
    return History(names).add_rows_until(await line_rows(call, methods), until_update)
