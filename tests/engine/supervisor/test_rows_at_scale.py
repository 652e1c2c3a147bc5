"""rows.jsonl of a months-long line: what the supervisor holds and sends does not grow with it.

A line at ns-2b's pace logs ~43,000 rows a day; these tests use 50,000 small rows and assert sizes
(index entries, history points, rows parsed), never times.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import engine.rows as rows_module
import engine.wandb.rows as wandb_rows
from engine.protocol import wire
from engine.rows import rows_problem
from engine.supervisor import rows_digest, rows_tail
from engine.supervisor.rows_digest import HISTORY_BUCKETS, HISTORY_VALIDATIONS
from engine.supervisor.rows_tail import RECENT_INDEX, SPARSE_STRIDE, RowsTail

ROWS = 50_000
SPIKE = 33_333


def row(update: int, tag: str = "") -> dict[str, Any]:
    loss = 9.0 if update == SPIKE else 3.0 + 1.0 / update
    document: dict[str, Any] = {"update": update, "tokens": update * 512, "loss": loss, "lr": 0.003,
                                "grad_norm": 1.0, "time": 1000.0 + update, "train/grad_norm/layer00": 0.5}
    if tag:
        document["tag"] = tag
    if update % 1000 == 0:
        document.update({"val_32/mix": 3.5, "val_32/dendritic/layer00/firing": 0.1, "seq_len": 32})
    return document


def write_rows(path: Path, updates: range, tag: str = "") -> None:
    with open(path, "a", encoding="utf-8") as handle:
        for update in updates:
            handle.write(json.dumps(row(update, tag), sort_keys=True) + "\n")


@pytest.fixture(scope="module")
def long_rows(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("long") / "rows.jsonl"
    write_rows(path, range(1, ROWS + 1))
    return path


def test_the_index_and_history_stay_bounded_and_a_spike_stays_visible(long_rows: Path) -> None:
    tail = RowsTail(long_rows)
    tail.catch_up()
    assert tail.count == ROWS
    assert len(tail._recent) == RECENT_INDEX
    assert len(tail._sparse_offsets) == ROWS // SPARSE_STRIDE + 1
    history = tail.digest.rows(0)
    assert len(history) <= 3 * HISTORY_BUCKETS + HISTORY_VALIDATIONS
    updates = [point["update"] for _, point in history]
    assert updates == sorted(updates) and SPIKE in updates
    assert all(set(point) <= {*rows_digest.COMPACT_KEYS, "seq_len", "val_32/mix"} for _, point in history)


def test_rows_are_read_at_any_index_through_the_sparse_index(long_rows: Path) -> None:
    tail = RowsTail(long_rows)
    tail.catch_up()
    for since in (0, 1, SPARSE_STRIDE - 1, SPARSE_STRIDE, 12_345, ROWS - RECENT_INDEX - 1, ROWS - 3):
        rows, next_index = tail.read(since, 3)
        assert [found["update"] for found in rows] == list(range(since + 1, since + 4))[: ROWS - since]
        assert next_index == since + len(rows)


def test_the_history_reply_is_paged_and_covers_the_line(long_rows: Path) -> None:
    tail = RowsTail(long_rows)
    tail.catch_up()
    since, pages, points = 0, 0, []
    while since < tail.count:
        rows, since = tail.history(since)
        points += rows
        pages += 1
        assert len(json.dumps(rows)) <= rows_tail.REPLY_BUDGET_BYTES
    assert pages < 10 and len(points) <= 3 * HISTORY_BUCKETS + HISTORY_VALIDATIONS
    assert points[0]["update"] == 1 and points[-1]["update"] > ROWS - 2 * ROWS // HISTORY_BUCKETS


@pytest.mark.parametrize("stride", [1, 7, 500])
def test_the_series_reply_fits_a_message_and_holds_each_bucket_s_extremes(long_rows: Path, stride: int) -> None:
    tail = RowsTail(long_rows)
    tail.catch_up()
    since, points = 0, []
    while since < tail.count:
        page, next_index = tail.series("loss", since, stride)
        reply = wire.encode(wire.make_result(1, {"points": page, "next": next_index, "total": tail.count}))
        assert len(reply) <= wire.MAX_LINE_BYTES and next_index > since
        points += page
        since = next_index
    assert [point[0] for point in points] == sorted({point[0] for point in points})
    assert all(point[1:] == [row(point[0] + 1)[key] for key in ("update", "tokens", "time", "loss")]
               for point in points)
    assert len(points) <= 2 * -(-ROWS // stride) and 9.0 in [point[-1] for point in points]
    assert tail.series("no such reading", 0, 500) == ([], tail.count)  # no row holds it: one call, no points


def test_a_series_call_reads_a_bounded_part_of_the_file_and_the_pages_add_up(
    long_rows: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tail = RowsTail(long_rows)
    tail.catch_up()
    whole, _ = tail.series("val_32/mix", 0, 7)  # one call: the scan bound is far past this file
    monkeypatch.setattr(rows_tail, "SERIES_SCAN_BYTES", 256 << 10)
    since, calls, points = 0, 0, []
    while since < tail.count:
        page, next_index = tail.series("val_32/mix", since, 7)
        assert next_index > since and (next_index - since) % 7 == 0 or next_index == tail.count
        points += page
        since, calls = next_index, calls + 1
    assert points == whole and len(whole) == ROWS // 1000
    assert calls >= long_rows.stat().st_size // (256 << 10)


def test_a_cut_back_past_the_newest_rows_is_news_again(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    write_rows(path, range(1, 20_001))
    tail = RowsTail(path)
    tail.catch_up()
    kept = 5_000
    with open(path, "rb+") as handle:
        handle.truncate(sum(len(line) for line in path.read_bytes().splitlines(keepends=True)[:kept]))
    write_rows(path, range(kept + 1, kept + 11), tag="replayed")
    news = tail.poll()
    assert news[-1] == row(kept + 10, "replayed")
    assert kept - SPARSE_STRIDE < news[0]["update"] <= kept + 1
    assert tail.count == kept + 10
    assert tail.read(kept, 1)[0] == [row(kept + 1, "replayed")]
    assert max(point["update"] for _, point in tail.digest.rows(0)) == kept + 10


def test_a_checkpoint_s_rows_are_checked_a_mebibyte_at_a_time(long_rows: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reads = []

    class Bounded:
        def __init__(self, handle: Any) -> None:
            self.handle = handle

        def __enter__(self) -> Bounded:
            return self

        def __exit__(self, *exc: object) -> None:
            self.handle.close()

        def read(self, size: int = -1) -> bytes:
            reads.append(size)
            return self.handle.read(size)

    monkeypatch.setattr(rows_module, "open", lambda path, mode: Bounded(path.open(mode)), raising=False)
    size = long_rows.stat().st_size
    assert rows_problem(long_rows, ROWS, size) is None
    assert rows_problem(long_rows, ROWS - 1, size) is not None
    assert reads and max(reads) <= 1 << 20


def test_w_and_b_re_sends_a_gap_without_parsing_the_rows_before_it(
    long_rows: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parsed = []
    loads = json.loads
    monkeypatch.setattr(wandb_rows.json, "loads", lambda text: parsed.append(1) or loads(text))
    sent = [found["update"] for found in wandb_rows.read_rows(long_rows, after=ROWS - 100)]
    assert sent == list(range(ROWS - 99, ROWS + 1))
    assert len(parsed) == 100
