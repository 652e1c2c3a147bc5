"""The host column names each trainer's line as the lines table does: two lines of one name by
their short paths, marked `⚠`, so that each trainer's CPU and memory can be told to its line.

Walked in tmux with ~/c/line and ~/d/line training: the table read `⚠ ~/c/line` and `⚠ ~/d/line`,
the host column `line  trainer 5195 ...` and `line  trainer 5599 ...`.
"""

from __future__ import annotations

from pathlib import Path

from engine.units import GIB
from nsconsole.state import LineBook, LineFacts, LineView
from nsconsole.widgets.host_panel import HostReading, ProcessReading, host_text


def training_line(book: LineBook, path: str, trainer_pid: int) -> None:
    line = LineView(f"{path}-id", Path(path), LineFacts(preset="transformer-tiny"))
    line.apply_status({"state": "training", "launches": 1, "crashes": 0, "trainer_pid": trainer_pid})
    book.add(line)


def test_two_trainers_of_lines_of_one_name_are_told_apart_by_path() -> None:
    book = LineBook()
    training_line(book, "/runs/c/line", 5195)
    training_line(book, "/runs/d/line", 5599)
    training_line(book, "/runs/trunk", 6000)
    processes = {pid: ProcessReading(60.0, GIB) for pid in (5195, 5599, 6000)}
    reading = HostReading(cpu_percent=100.0, cores=2, memory_used=3 * GIB, memory_total=24 * GIB, processes=processes)
    rows = host_text(reading, book).plain.splitlines()[1:]
    assert [row.split("trainer")[0].rstrip() for row in rows] == ["⚠ /runs/c/line", "⚠ /runs/d/line", "trunk"]
