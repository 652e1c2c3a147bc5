"""A line's rows asked of its supervisor, in what does not grow with the line's age.

`line_rows`: the newest `FULL_ROWS` whole after the downsampled history of the older ones (what the
console holds of a line it attaches to, and of a branch's trunk); `whole_row`: one row too large
for a message, read in pieces; `reading_points`: one reading over the whole line, downsampled by the
supervisor (a pinned training metric). Each takes `call(method, **params)`, a client's call to that
line's supervisor, and `methods`, those its hello named: an older supervisor is asked what it has.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from engine.protocol import wire
from engine.supervisor.reads import parse_json
from nsconsole.client import RemoteError
from nsconsole.state import FULL_ROWS, joined_rows

Call = Callable[..., Awaitable[Any]]

SERIES_POINTS = 2048
"""Buckets a pinned reading's history is asked in (each its lowest and highest value)."""


async def line_rows(call: Call, methods: Collection[str]) -> list[dict[str, Any]]:
    """The line's rows: the newest `FULL_ROWS` whole (one too large for a message read in pieces)
    after the downsampled history (`history`), so what an attach costs does not grow with the line's
    age; every row from a supervisor without `history`."""
    if "history" not in methods:
        return await rows_from(call, 0)
    reply = await call("history", since=0)
    history, since = list(reply.get("rows") or []), int(reply.get("next", 0))
    newest_from = max(0, int(reply.get("total", 0)) - FULL_ROWS)
    while newest_from and since < newest_from and reply.get("rows"):
        reply = await call("history", since=since)
        history += reply.get("rows") or []
        since = int(reply.get("next", since))
    newest = [await whole_row(call, methods, row) if "omitted" in row else row
              for row in await rows_from(call, newest_from)]  # fmt: skip
    return joined_rows(history, [row for row in newest if "omitted" not in row])


async def rows_from(call: Call, since: int) -> list[dict[str, Any]]:
    """Every row from index `since`, asked in pages (`omitted` markers as they come)."""
    rows: list[dict[str, Any]] = []
    while True:
        reply = await call("rows", since=since, limit=wire.MAX_ROWS_PER_CALL)
        page = reply.get("rows") or []
        rows += page
        since = int(reply.get("next", since + len(page)))
        if not page or since >= int(reply.get("total", since)):
            return rows


async def whole_row(call: Call, methods: Collection[str], marker: dict[str, Any]) -> dict[str, Any]:
    """The row an `omitted` marker stands for (one too large for a message: an ns-2b validation,
    with its probes and samples, is about 350 KB), read in pieces with `row`; the marker itself
    when the supervisor has no `row` (an older one) or the row is gone (cut back meanwhile)."""
    index = marker.get("index")
    if not isinstance(index, int) or "row" not in methods:
        return marker
    pieces: list[str] = []
    offset = 0
    try:
        while True:
            reply = await call("row", index=index, offset=offset)
            pieces.append(str(reply.get("text", "")))
            offset = int(reply.get("next", offset))
            if offset >= int(reply.get("size", 0)) or not reply.get("text"):
                break
    except RemoteError:
        return marker  # cut back meanwhile: the rows that replace it come as news
    return parse_json("".join(pieces).encode("utf-8")) or marker


async def reading_points(call: Call, name: str, total_rows: int) -> list[list[Any]]:
    """Reading `name` over the whole line as `[index, update, tokens, time, value]` points, about
    `SERIES_POINTS` buckets of rows each as its lowest and highest value (`series`: the supervisor
    reads rows.jsonl once, where fetching a line of months row by row took tens of thousands of calls)."""
    stride = series_stride(total_rows)
    points: list[list[Any]] = []
    since = 0
    while True:
        reply = await call("series", name=name, since=since, stride=stride)
        points += reply.get("points") or []
        next_index = int(reply.get("next", since))
        if next_index <= since or next_index >= int(reply.get("total", next_index)):
            return points
        since = next_index


def series_stride(total_rows: int) -> int:
    """Rows a `series` bucket takes so that a line of `total_rows` comes in about `SERIES_POINTS`."""
    return max(1, math.ceil(total_rows / SERIES_POINTS))
