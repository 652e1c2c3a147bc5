"""The console on a months-long line: what it holds and asks for does not grow with the line's age.

50,000 small rows stand for weeks of an ns-2b line; the assertions are sizes (points held, calls
made), never times.
"""

from __future__ import annotations

import asyncio
import functools
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from engine.supervisor.rows_digest import HISTORY_BUCKETS, HISTORY_VALIDATIONS
from engine.supervisor.rows_tail import RowsTail
from nsconsole.history import read_at_rest
from nsconsole.live import _Attachment
from nsconsole.state import FULL_ROWS, MAX_POINTS, RECENT_ROWS, LineView

ROWS = 50_000
SPIKE = 33_333
BOUND = FULL_ROWS + 3 * HISTORY_BUCKETS + HISTORY_VALIDATIONS
"""Points a line's series may hold after an attach: the newest rows whole, the history's buckets, validations."""


def row(update: int) -> dict[str, Any]:
    document: dict[str, Any] = {"update": update, "tokens": update * 512, "loss": 9.0 if update == SPIKE else 3.0,
                                "lr": 0.003, "grad_norm": 1.0, "time": 1000.0 + update, "cycle": update // 10_000}
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
    """A supervisor's `rows` and `history` over a rows.jsonl, counting the calls."""

    def __init__(self, tail: RowsTail) -> None:
        self.tail = tail
        self.server = {"methods": ["history", "rows"]}
        self.calls: list[str] = []

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.calls.append(method)
        if method == "history":
            rows, next_index = self.tail.history(params["since"])
        else:
            rows, next_index = self.tail.read(params["since"], params["limit"])
        return {"rows": rows, "next": next_index, "total": self.tail.count}


def test_attaching_fetches_the_newest_rows_and_a_downsampled_history(rows_jsonl: Path) -> None:
    tail = RowsTail(rows_jsonl)
    tail.catch_up()
    client = TailClient(tail)
    view = LineView("long", rows_jsonl.parent)
    attachment = SimpleNamespace(state=view)
    attachment._fetch_from = functools.partial(_Attachment._fetch_from, attachment)
    asyncio.run(_Attachment._fetch_rows(attachment, client))  # type: ignore[arg-type]
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
