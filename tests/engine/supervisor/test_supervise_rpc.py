"""The supervisor's RPC handler and its view of rows.jsonl, on real files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine.errors import LineError
from engine.layout import LineLayout
from engine.protocol import wire
from engine.supervisor.rows_digest import is_validation_row
from engine.supervisor.rows_tail import REPLY_BUDGET_BYTES, RowsTail
from engine.supervisor.rpc import LineHandler, PausedWork


class View:
    """The parts of a supervisor the handler reads."""

    def __init__(self, root: Path) -> None:
        self.layout = LineLayout(root)
        self.rows_tail = RowsTail(self.layout.rows_jsonl)
        self.request_log = wire.RequestLog()
        self.stops: list[int | None] = []
        self.paused: list[PausedWork] = []
        self.forks = None  # the handler reaches it only with a complete request

    def between_launches(self, work: PausedWork) -> dict[str, Any]:
        self.paused.append(work)
        return {}

    def state_for_status(self) -> dict[str, Any]:
        return {"state": "training"}

    def request_stop(self, at_cycle_end: int | None) -> None:
        self.stops.append(at_cycle_end)


@pytest.fixture
def view(tmp_path: Path) -> View:
    (tmp_path / "run.json").write_text("{}")
    return View(tmp_path)


def append_rows(path: Path, updates: range, pad: int = 0, loss: float = 1.0) -> None:
    with open(path, "a") as handle:
        for update in updates:
            handle.write(json.dumps({"update": update, "loss": loss, "pad": "x" * pad}) + "\n")


def test_the_tail_sees_whole_rows_only_and_follows_a_cut_back(view: View) -> None:
    path = view.layout.rows_jsonl
    assert view.rows_tail.poll() == []
    append_rows(path, range(1, 6))
    with open(path, "a") as handle:
        handle.write('{"update": 6, "lo')  # a row caught mid-write
    assert [row["update"] for row in view.rows_tail.poll()] == [1, 2, 3, 4, 5]
    with open(path, "a") as handle:
        handle.write('ss": 1.0}\n')
    assert [row["update"] for row in view.rows_tail.poll()] == [6]
    # A resume cuts rows.jsonl back to the checkpoint's 3 rows and writes the replayed updates again.
    kept = b"".join(path.read_bytes().splitlines(keepends=True)[:3])
    path.write_bytes(kept)
    append_rows(path, range(4, 8), loss=0.5)  # replayed rows differ (their time, at least)
    replayed = [(row["update"], row["loss"]) for row in view.rows_tail.poll()]
    assert replayed == [(4, 0.5), (5, 0.5), (6, 0.5), (7, 0.5)]
    assert view.rows_tail.count == 7
    rows, next_index = view.rows_tail.read(2, 10)
    assert [row["update"] for row in rows] == [3, 4, 5, 6, 7] and next_index == 7
    path.write_bytes(b"")  # and a file cut to nothing
    assert view.rows_tail.poll() == [] and view.rows_tail.count == 0


def test_rows_are_paged_within_the_line_cap(view: View) -> None:
    append_rows(view.layout.rows_jsonl, range(1, 201), pad=1000)
    view.rows_tail.poll()
    handler = LineHandler(view)
    first = handler.rows(since=0, limit=4096)
    assert 0 < len(first["rows"]) < 200 and first["total"] == 200
    assert len(wire.encode(wire.make_result(1, first))) <= wire.MAX_LINE_BYTES
    everything = first["rows"]
    since = first["next"]
    while since < 200:
        page = handler.rows(since=since, limit=4096)
        everything += page["rows"]
        since = page["next"]
    assert [row["update"] for row in everything] == list(range(1, 201))
    assert handler.rows(since=500, limit=10) == {"rows": [], "next": 500, "total": 200}


def test_a_row_past_the_cap_is_named_not_sent(view: View) -> None:
    append_rows(view.layout.rows_jsonl, range(1, 2), pad=REPLY_BUDGET_BYTES)
    view.rows_tail.poll()
    [row] = LineHandler(view).rows(since=0, limit=10)["rows"]
    assert row["index"] == 0 and "past the reply cap" in row["omitted"]


def test_log_reads_whole_characters(view: View) -> None:
    view.layout.run_log.write_text("naïve ünïcode\n", encoding="utf-8")
    handler = LineHandler(view)
    text, offset = "", 0
    while True:
        chunk = handler.log(offset=offset, length=3)
        if chunk["next"] == offset:
            break
        text += chunk["text"]
        offset = chunk["next"]
    assert text == "naïve ünïcode\n" and chunk["size"] == len("naïve ünïcode\n".encode())


def test_stop_writes_the_request_and_the_other_mutations_refuse_bad_calls_before_pausing(view: View) -> None:
    handler = LineHandler(view)
    reply = handler.stop(at_cycle_end=2)
    assert reply["stopping"] and reply["when"] == "at the end of cycle 2" and view.stops == [2]
    assert json.loads(view.layout.stop.read_text())["at_cycle_end"] == 2
    checkpoints = view.layout.checkpoints
    (checkpoints / "u00000003").mkdir(parents=True)
    (checkpoints / "latest").write_text("u00000003\n")
    refusals = [
        (lambda: handler.branch("/b", None, None, "decay:1e3", "/d"), "give at_cycle"),
        (lambda: handler.branch("/b", 1, 7, "decay:1e3", "/d"), "not at_update"),
        (lambda: handler.branch("/b", 1, None, None, "/d"), "give a plan"),
        (lambda: handler.branch("/b", 1, None, "decay:1e3", None), "own data line"),
        (lambda: handler.rollback(2), r"u00000002: no such checkpoint \(the line has u00000003\)"),
        (lambda: handler.rollback(3), r"not before the line's latest checkpoint \(u00000003\)"),
        (lambda: handler.tune(False), "run.json"),  # `{}` is no run.json
    ]
    for call, message in refusals:
        with pytest.raises(LineError, match=message):
            call()
    assert view.paused == []  # the trainer was never stopped for a call that could not be done


def test_gpu_reports_the_devices_and_their_leases(view: View) -> None:
    reply = LineHandler(view).gpu()
    assert set(reply) == {"available", "reason", "driver", "devices", "leases"}
    assert len(reply["leases"]) == len(reply["devices"])


def test_validation_rows_are_told_apart() -> None:
    assert is_validation_row({"update": 3, "val_4096/mix": 3.2})
    assert is_validation_row({"ema/val_4096/mix": 3.2})
    assert not is_validation_row({"update": 3, "loss": 3.0})
