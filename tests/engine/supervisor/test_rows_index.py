"""The saved index of rows.jsonl (`RowsTail.save` / `load`, `<line>/rows.index.json`): a start reads
only the rows after it, whatever the line's age, and trusts nothing in it that the file no longer
holds (a rollback, a resume's cut) or that is not an index."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.lines import make_data_line, make_line
from helpers.supervise import ROWS_TRAINER, RUNNER, end_line_processes

from engine.layout import LineLayout
from engine.supervisor.publishing import ROWS_INDEX_EVERY
from engine.supervisor.rows_digest import compact_row
from engine.supervisor.rows_tail import SPARSE_STRIDE, RowsTail
from engine.supervisor.start import INDEX_BYTES_PER_S, answer_wait

pytestmark = pytest.mark.usefixtures("private_host")  # conftest: an empty host.json, a private runtime dir


def row(update: int, loss: float = 3.0) -> dict[str, Any]:
    document: dict[str, Any] = {"update": update, "tokens": update * 512, "loss": loss, "lr": 0.003,
                                "grad_norm": 9.0 if update == 7_777 else 1.0, "time": 1000.0 + update}
    if update % 1000 == 0:
        document["val_32/mix"] = loss + 0.5
    return document


def lines(updates: range, loss: float = 3.0) -> str:
    return "".join(json.dumps(row(update, loss), sort_keys=True) + "\n" for update in updates)


def same_tail(tail: RowsTail, fresh: RowsTail, cut: bool = False) -> None:
    """`tail` holds what a tail that read the whole file holds. After a cut (`cut`) its downsampled
    history is another valid one (the bucket the cut fell in keeps the extremes it had chosen before
    the cut): each of its points is then the file's row at that index, and the rows after the cut are there."""
    assert tail.count == fresh.count
    if not cut:
        assert tail.digest.rows(0) == fresh.digest.rows(0)
    else:
        file_rows = tail.path.read_bytes().splitlines(keepends=True)
        assert all(point == compact_row(file_rows[index]) for index, point in tail.digest.rows(0))
        assert tail.digest.rows(0)[-1] == fresh.digest.rows(0)[-1]
    for index in (0, 1, SPARSE_STRIDE - 1, SPARSE_STRIDE, fresh.count // 2, fresh.count - 1):
        assert tail.read(index, 1, budget=None) == fresh.read(index, 1, budget=None)
    assert tail.row_text(fresh.count - 1, 0, 100) == fresh.row_text(fresh.count - 1, 0, 100)


def read_through(path: Path) -> RowsTail:
    fresh = RowsTail(path)
    fresh.catch_up()
    return fresh


def test_a_tail_loaded_from_its_index_reads_only_the_rows_after_it(tmp_path: Path) -> None:
    rows_jsonl, index = tmp_path / "rows.jsonl", tmp_path / "rows.index.json"
    rows_jsonl.write_text(lines(range(1, 30_001)))
    first = RowsTail.load(rows_jsonl, index)  # no index yet: read through
    first.catch_up()
    assert first.rows_read == 30_000
    first.save(index)
    with rows_jsonl.open("a") as handle:
        handle.write(lines(range(30_001, 30_101)))
    loaded = RowsTail.load(rows_jsonl, index)
    assert loaded.count == 30_000 and loaded.rows_read == 0
    assert [index for index, _ in loaded.poll_indexed()] == list(range(30_000, 30_100))  # news: the new rows
    assert loaded.rows_read == 100
    same_tail(loaded, read_through(rows_jsonl))
    assert any(point["grad_norm"] == 9.0 for _, point in loaded.digest.rows(0))  # the spike kept


@pytest.mark.parametrize("cut_to", [29_990, 25_000, 1_500, 0])
def test_a_file_cut_back_after_its_index_was_saved_is_read_again_from_the_cut(tmp_path: Path, cut_to: int) -> None:
    """A rollback (or a resume) cut rows.jsonl back, and the trainer wrote other rows since: the
    loaded index walks back to the last row the file still holds, however far back."""
    rows_jsonl, index = tmp_path / "rows.jsonl", tmp_path / "rows.index.json"
    rows_jsonl.write_text(lines(range(1, 30_001)))
    read_through(rows_jsonl).save(index)
    rows_jsonl.write_text(lines(range(1, cut_to + 1)) + lines(range(cut_to + 1, cut_to + 2_001), loss=2.0))
    loaded = RowsTail.load(rows_jsonl, index)
    loaded.catch_up()
    fresh = read_through(rows_jsonl)
    same_tail(loaded, fresh, cut=True)
    assert loaded.read(cut_to, 1, budget=None)[0][0]["loss"] == 2.0
    assert loaded.rows_read <= fresh.count - cut_to + SPARSE_STRIDE + 1


@pytest.mark.parametrize("damage", ["not json", '{"format": 99}', '{"format": 1, "rows": 5}',
                                    '{"format": 1, "rows": 3000, "end": 10, "sparse_offsets": [0], '
                                    '"sparse_digests": [0], "recent": [], "history": {}}'])
def test_an_index_that_is_not_one_is_a_fresh_start(tmp_path: Path, damage: str) -> None:
    rows_jsonl, index = tmp_path / "rows.jsonl", tmp_path / "rows.index.json"
    rows_jsonl.write_text(lines(range(1, 3_001)))
    index.write_text(damage)
    loaded = RowsTail.load(rows_jsonl, index)
    assert loaded.count == 0
    loaded.catch_up()
    assert loaded.rows_read == 3_000
    same_tail(loaded, read_through(rows_jsonl))


def test_a_cut_within_the_newest_rows_across_a_sparse_entry_keeps_old_rows_readable(tmp_path: Path) -> None:
    """A cut back to a multiple of SPARSE_STRIDE within the newest rows dropped no sparse entry, so
    the rows after it were indexed twice there and an old row read later came from the wrong place."""
    rows_jsonl = tmp_path / "rows.jsonl"
    rows_jsonl.write_text(lines(range(1, 5_001)))
    tail = read_through(rows_jsonl)
    rows_jsonl.write_text(lines(range(1, 4 * SPARSE_STRIDE + 1)) + lines(range(4 * SPARSE_STRIDE + 1, 20_001), 2.0))
    tail.poll()
    same_tail(tail, read_through(rows_jsonl), cut=True)
    assert tail.read(5_000, 1, budget=None)[0] == [row(5_001, 2.0)]


@pytest.mark.slow
def test_a_supervisor_saves_the_index_and_the_next_one_starts_from_it(tmp_path: Path) -> None:
    line = make_line(tmp_path, make_data_line(tmp_path / "data_root", prepare=1))
    (line / "rows.jsonl").write_text(lines(range(1, ROWS_INDEX_EVERY + 1001)))  # weeks of rows, in small
    (tmp_path / "trainer.py").write_text(ROWS_TRAINER)
    (tmp_path / "runner.py").write_text(RUNNER)
    settings = {"poll_seconds": 0.1, "run_preparer": False,
                "trainer_command": [sys.executable, str(tmp_path / "trainer.py"), str(line), str(tmp_path / "go")]}
    runners: list[subprocess.Popen[bytes]] = []
    try:
        for _ in ("first", "second"):
            started_at = len((line / "run.log").read_text()) if (line / "run.log").exists() else 0
            runners.append(subprocess.Popen([sys.executable, str(tmp_path / "runner.py"), str(line),
                                             json.dumps(settings)]))
            deadline = time.monotonic() + 120
            while "supervisor started" not in ((line / "run.log").read_text()[started_at:]
                                               if (line / "run.log").exists() else ""):
                assert time.monotonic() < deadline, "the supervisor did not start"
                time.sleep(0.1)
            runners[-1].terminate()  # SIGTERM: it stops its trainer and saves the index as it ends
            assert runners[-1].wait(timeout=60) == 0
        said = [text for text in (line / "run.log").read_text().splitlines() if "rows.jsonl:" in text]
        total = ROWS_INDEX_EVERY + 1000
        assert f"rows.jsonl: {total} rows, {total} read from the file (no saved index)" in said[0]
        # The first supervisor saved the index at its end, after the rows its trainer appended.
        assert said[1].split("rows.jsonl: ")[1].endswith(", 0 read from the file (the rest from rows.index.json)")
        saved = json.loads((line / "rows.index.json").read_text())
        assert saved["rows"] == len((line / "rows.jsonl").read_text().splitlines())
    finally:
        left_running = end_line_processes(runners, tmp_path)
    assert left_running == []


def test_a_start_waits_for_its_supervisor_to_index_what_the_saved_index_lacks(tmp_path: Path) -> None:
    """The first start on a line of months reads gigabytes of rows.jsonl before it answers (43 s for
    3 GB here): it was reported silent after 60 s on a slower disk. The wait grows with what the
    saved index does not cover, and is the plain wait once it covers the file."""
    layout = LineLayout(tmp_path)
    assert answer_wait(layout, 60.0) == 60.0  # no rows yet
    layout.rows_jsonl.write_text(lines(range(1, 20_001)))
    size = layout.rows_jsonl.stat().st_size
    assert answer_wait(layout, 60.0) == pytest.approx(60.0 + size / INDEX_BYTES_PER_S)
    layout.rows_index.write_text("not an index")
    assert answer_wait(layout, 60.0) == pytest.approx(60.0 + size / INDEX_BYTES_PER_S)
    read_through(layout.rows_jsonl).save(layout.rows_index)
    with layout.rows_jsonl.open("a") as handle:
        handle.write(lines(range(20_001, 20_101)))
    appended = layout.rows_jsonl.stat().st_size - size
    assert answer_wait(layout, 60.0) == pytest.approx(60.0 + appended / INDEX_BYTES_PER_S)
    assert 3 * 10**9 / INDEX_BYTES_PER_S > 100  # a month of ns-2b rows: minutes more, not a false alarm
