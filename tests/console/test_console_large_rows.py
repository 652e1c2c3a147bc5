"""A row too large for one protocol message (an ns-2b validation with its probes and samples is
about 350 KB, the line cap 64 KiB) reaches the console whole: pushed as an `omitted` marker naming
its index, then read in pieces with `row`, in order, before the next notification; and fetched the
same way when a console attaches after it was written. Before, the console never saw such a row:
an ns-2b line's probes and samples tabs stayed empty."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.console import until
from helpers.lines import make_data_line, make_line
from helpers.supervise import ROWS_TRAINER, RUNNER, end_line_processes

from engine.protocol import wire
from engine.supervisor.registry import line_id
from engine.supervisor.rows_tail import RowsTail
from nsconsole.app import ConsoleApp
from nsconsole.state import LineView

pytestmark = pytest.mark.usefixtures("private_host")  # conftest: an empty host.json, a private runtime dir

PROBE = "val_32/hippocampal/layer47/clock_tau_head19"



def validation_of(view: LineView) -> dict | None:
    return next((row for row in view.validations if PROBE in row), None)


@pytest.mark.slow
def test_a_row_too_large_for_a_message_reaches_the_console_whole(tmp_path: Path) -> None:
    line_path = make_line(tmp_path, make_data_line(tmp_path / "data_root", prepare=1))
    (tmp_path / "trainer.py").write_text(ROWS_TRAINER)
    go = tmp_path / "go"
    (tmp_path / "runner.py").write_text(RUNNER)
    settings = {"poll_seconds": 0.1, "run_preparer": False,
                "trainer_command": [sys.executable, str(tmp_path / "trainer.py"), str(line_path), str(go)]}
    supervisor = subprocess.Popen([sys.executable, str(tmp_path / "runner.py"), str(line_path), json.dumps(settings)])
    key = line_id(line_path)

    async def pushed() -> None:
        app = ConsoleApp(refresh_interval=0.2)
        async with app.run_test(size=(150, 40)) as pilot:
            view: LineView = await until(pilot, lambda: app.book.get(key), "the line", 120)
            await until(pilot, lambda: (view.update or 0) >= 5, "its first rows", 120)
            go.write_text("")
            found = await until(pilot, lambda: validation_of(view), "the large validation, pushed", 60)
            assert found[PROBE] == 47.19 and found["samples"][0]["text"].startswith('a "quoted" word')
            updates_after = await until(pilot, lambda: view.update if view.update > found["update"] else None,
                                        "rows after it", 60)
            assert view.series.update == sorted(set(view.series.update)) and updates_after > found["update"]

    async def fetched() -> None:
        app = ConsoleApp(refresh_interval=0.2)
        async with app.run_test(size=(150, 40)) as pilot:
            view: LineView = await until(pilot, lambda: app.book.get(key), "the line", 120)
            found = await until(pilot, lambda: validation_of(view), "the large validation, fetched", 60)
            assert found[PROBE] == 47.19 and view.val_loss == 3.25

    try:
        asyncio.run(pushed())
        line = (line_path / "rows.jsonl").read_bytes().splitlines()
        assert max(len(text) for text in line) > 4 * wire.MAX_LINE_BYTES  # really past the cap
        asyncio.run(fetched())
        supervisor.terminate()  # SIGTERM: it stops its trainer (which ends on SIGTERM) and exits
        assert supervisor.wait(timeout=60) == 0
    finally:
        left_running = end_line_processes([supervisor], tmp_path)
    assert left_running == []


def test_row_reads_a_row_in_pieces_that_fit_a_message(tmp_path: Path) -> None:
    large = {"update": 2, "val_32/mix": 3.0, "samples": [{"text": 'a "quoted" \\ word ' * 20_000}]}
    (tmp_path / "rows.jsonl").write_text(json.dumps({"update": 1}) + "\n" + json.dumps(large) + "\n")
    tail = RowsTail(tmp_path / "rows.jsonl")
    assert [index for index, _ in tail.poll_indexed()] == [0, 1]
    pieces, offset = [], 0
    while True:
        reply = tail.row_text(1, offset, wire.MAX_ROW_CHUNK)
        assert len(wire.encode(wire.make_result(1, reply))) <= wire.MAX_LINE_BYTES
        pieces.append(reply["text"])
        offset = reply["next"]
        if offset >= reply["size"]:
            break
    assert json.loads("".join(pieces)) == large and len(pieces) > 10
    with pytest.raises(Exception, match="row 2: rows.jsonl has 2 rows"):
        tail.row_text(2, 0, 100)
