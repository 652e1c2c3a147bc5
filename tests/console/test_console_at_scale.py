"""The console on a months-long line: what it holds and asks for does not grow with the line's age.

50,000 small rows stand for weeks of an ns-2b line; the assertions are sizes (points held, calls
made), never times.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from engine.supervisor.rows_digest import HISTORY_BUCKETS, HISTORY_VALIDATIONS
from engine.supervisor.rows_tail import RowsTail
from nsconsole.history import read_at_rest
from nsconsole.row_fetch import SERIES_POINTS, line_rows
from nsconsole.state import FULL_ROWS, MAX_POINTS, RECENT_ROWS, LineBook, LineView
from nsconsole.widgets.row_history import _ask, fetch_history

ROWS = 50_000
SPIKE = 33_333
BOUND = FULL_ROWS + 3 * HISTORY_BUCKETS + HISTORY_VALIDATIONS
"""Points a line's series may hold after an attach: the newest rows whole, the history's buckets, validations."""


def row(update: int) -> dict[str, Any]:
    document: dict[str, Any] = {"update": update, "tokens": update * 512, "loss": 9.0 if update == SPIKE else 3.0,
                                "lr": 0.003, "grad_norm": 1.0, "time": 1000.0 + update, "cycle": update // 10_000,
                                "train/grad_norm/layer00": 5.0 if update == SPIKE else 0.5 + update % 3 / 10}
    if update % 1000 == 0:
        document["val_32/mix"] = 3.5
    return document


@pytest.fixture(scope="module")
def rows_jsonl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("long") / "rows.jsonl"
    path.write_text("".join(json.dumps(row(update), sort_keys=True) + "\n" for update in range(1, ROWS + 1)))
    return path


def test_a_line_s_series_stays_bounded_as_rows_arrive_and_keeps_its_spike() -> None:
    view = LineView("long", "/lines/long")
    for update in range(1, ROWS + 1):
        view.add_row(row(update))
    assert len(view.series) <= MAX_POINTS
    assert view.series.update[-FULL_ROWS:] == list(range(ROWS - FULL_ROWS + 1, ROWS + 1))
    assert 9.0 in view.series.loss
    assert view.update == ROWS and len(view.recent_rows) == RECENT_ROWS


class TailClient:
    """A supervisor's reads over a rows.jsonl (the supervisor's own `RowsTail`), counting the calls;
    as `LiveLines` too (`call(key, ...)`, `methods(key)`) for a line's history."""

    def __init__(self, tail: RowsTail) -> None:
        self.tail = tail
        self.server = {"methods": ["history", "rows", "series", "status"]}
        self.calls: list[str] = []

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.calls.append(method)
        if method == "status":
            return {"rows": self.tail.count}
        if method == "series":
            points, next_index = self.tail.series(params["name"], params["since"], params["stride"])
            return {"points": points, "next": next_index, "total": self.tail.count}
        if method == "history":
            rows, next_index = self.tail.history(params["since"])
        else:
            rows, next_index = self.tail.read(params["since"], params["limit"])
        return {"rows": rows, "next": next_index, "total": self.tail.count}

    async def call_line(self, key: str, method: str, **params: Any) -> dict[str, Any]:
        return await self.call(method, **params)

    def methods(self, key: str) -> frozenset[str]:
        return frozenset(self.server["methods"])


def test_attaching_fetches_the_newest_rows_and_a_downsampled_history(rows_jsonl: Path) -> None:
    tail = RowsTail(rows_jsonl)
    tail.catch_up()
    client = TailClient(tail)
    view = LineView("long", rows_jsonl.parent)
    view.apply_rows(asyncio.run(line_rows(client.call, client.server["methods"])), 0)
    assert client.calls.count("rows") <= FULL_ROWS * 200 // (64 * 1024) + 2
    assert len(view.series) <= BOUND
    assert view.series.update[0] == 1 and view.series.update[-FULL_ROWS:] == list(range(ROWS - FULL_ROWS + 1, ROWS + 1))
    assert 9.0 in view.series.loss and view.update == ROWS
    assert view.series.update == sorted(set(view.series.update))
    assert view.validations[-1]["update"] == ROWS and view.val_loss == 3.5


def test_a_line_at_rest_is_read_as_its_newest_rows_and_a_downsampled_history(rows_jsonl: Path, tmp_path: Path) -> None:
    line = tmp_path / "line"
    line.mkdir()
    (line / "rows.jsonl").symlink_to(rows_jsonl)
    (line / "supervisor.json").write_text(json.dumps({"state": "stopped", "pid": 1}))
    resting = read_at_rest(line)
    assert resting is not None
    assert len(resting.rows) <= BOUND
    assert resting.rows[-FULL_ROWS:] == [row(update) for update in range(ROWS - FULL_ROWS + 1, ROWS + 1)]
    assert any(found["loss"] == 9.0 for found in resting.rows)


def test_a_pinned_training_reading_of_a_long_line_is_asked_as_a_downsampled_series(rows_jsonl: Path) -> None:
    """A gradient norm pinned to the curves: about 2,000 buckets of its lowest and highest values, in
    a few `series` calls (it was 50,000 rows fetched whole, in pages of 21 at ns-2b's row size)."""
    tail = RowsTail(rows_jsonl)
    tail.catch_up()
    client = TailClient(tail)
    link = SimpleNamespace(call=client.call_line, methods=client.methods)
    history = asyncio.run(_ask(link, "long", ("train/grad_norm/layer00",), math.inf))  # type: ignore[arg-type]
    values = history.values["train/grad_norm/layer00"]
    assert client.calls.count("series") <= 8 and "rows" not in client.calls
    assert len(values) <= 2 * SERIES_POINTS and 5.0 in values  # the spike stays
    assert history.update == sorted(history.update) and ROWS - history.update[-1] < math.ceil(ROWS / SERIES_POINTS)
    assert all(value == row(int(update))["train/grad_norm/layer00"] for update, value in zip(history.update, values))


def test_a_pinned_training_reading_of_a_long_line_at_rest_covers_the_whole_line(rows_jsonl: Path, tmp_path: Path) -> None:
    """No supervisor to ask: the console buckets the file itself, as `series` does, so the reading is
    drawn from the line's first update (it had the newest `FULL_ROWS` rows only)."""
    line = tmp_path / "line"
    line.mkdir()
    (line / "rows.jsonl").symlink_to(rows_jsonl)
    (line / "supervisor.json").write_text(json.dumps({"state": "finished", "pid": 1}))
    name = "train/grad_norm/layer00"
    history = asyncio.run(fetch_history(None, LineBook(), str(line), (name,)))
    values = history.values[name]
    assert history.update[0] <= math.ceil(ROWS / SERIES_POINTS) and ROWS - history.update[-1] < math.ceil(ROWS / SERIES_POINTS)
    assert len(values) <= 2 * SERIES_POINTS and 5.0 in values  # the spike stays
    assert all(value == row(int(update))[name] for update, value in zip(history.update, values))
