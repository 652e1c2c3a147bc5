"""The state a line shows is true (issue 20 item 1): a stop asked for, what a pause is for (while
the supervisor still carries out the mutation), and a line left with neither supervisor nor trainer."""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import psutil
from helpers.console import until

from engine.supervisor.registry import SupervisorEntry
from engine.supervisor.server import SupervisorServer
from nsconsole.app import ConsoleApp
from nsconsole.state import LineView
from nsconsole.widgets.format import SUPERVISOR_LOST
from nsconsole.widgets.lines_table import LinesTable
from nsconsole.widgets.request_progress import RequestProgress


def attached_line(status: dict[str, Any]) -> LineView:
    line = LineView("k", "/srv/runs/trunk")
    line.apply_hello({"epoch": "e", "pid": 1}, 0.0)
    line.apply_status(status)
    return line


def test_the_state_says_what_the_supervisor_is_about_to_do() -> None:
    training = {"state": "training", "heartbeat": {"time": 1.0, "stage": "checkpointing"}}
    assert attached_line(training).display_state == "checkpointing"
    stop_now = {"requested": "2026-01-01T00:00:00+00:00", "at_cycle_end": None}
    assert attached_line({**training, "stop": stop_now}).display_state == "stopping"
    assert attached_line({**training, "stop": {**stop_now, "at_cycle_end": 3}}).display_state == "stopping after cycle 3"
    pausing = {"state": "pausing", "under_way": [{"method": "tune", "since": 1.0}]}
    assert attached_line(pausing).display_state == "pausing → tuning"
    rolling = {"state": "pausing", "under_way": [{"method": "rollback", "since": 1.0}, {"method": "tune", "since": 2.0}]}
    assert attached_line(rolling).display_state == "pausing → rolling-back"
    assert attached_line({"state": "pausing"}).display_state == "pausing"  # an older supervisor: no under_way
    # Nothing runs the line: said only while detached, and never over a final state.
    orphan = attached_line(training)
    orphan.orphaned = True
    assert orphan.display_state == "checkpointing"
    orphan.mark_disconnected("connection lost", 2.0)
    orphan.orphaned = True
    assert orphan.display_state == SUPERVISOR_LOST
    orphan.apply_status({"state": "finished"})
    assert orphan.display_state == "finished"


class HeldTuneLine:
    """A supervisor's handler whose tune pauses the line until the test lets it end."""

    def __init__(self, trainer_pid: int) -> None:
        self.trainer_pid = trainer_pid
        self.tuning = threading.Event()
        self.release = threading.Event()

    def status(self) -> dict[str, Any]:
        state = "pausing" if self.tuning.is_set() else "training"
        return {"state": state, "trainer_pid": self.trainer_pid, "launches": 1}

    def rows(self, since: int, limit: int) -> dict[str, Any]:
        return {"rows": [], "next": since, "total": 0}

    def tune(self, shared: bool) -> dict[str, Any]:
        self.tuning.set()
        assert self.release.wait(60), "the test never let the tune end"
        self.tuning.clear()
        return {"lengths": []}




def test_a_pause_shows_what_it_is_for_and_a_line_left_alone_says_so(tmp_path: Path) -> None:
    trainer = subprocess.Popen(["sleep", "120"])
    handler = HeldTuneLine(trainer.pid)
    socket = tmp_path / "supervisor.sock"
    server = SupervisorServer(socket, handler, identity={"line": str(tmp_path)})
    server.start()
    me = psutil.Process()
    entry = SupervisorEntry("line", str(tmp_path), str(socket), me.pid, me.create_time(), time.time())

    def state_cell(app: ConsoleApp) -> str:
        table = app.screen.query_one(LinesTable)
        return str(table.get_cell("line", "state")) if "line" in table.rows else ""

    async def scenario() -> None:
        app = ConsoleApp(discover=lambda: [entry], refresh_interval=0.1)
        async with app.run_test(size=(150, 40)) as pilot:
            line: LineView = await until(pilot, lambda: (found := app.book.get("line")) and found.connected and found,
                                         "the line")
            await until(pilot, lambda: state_cell(app) == "▶ training", "the row")
            await pilot.press("t", "enter", "y")
            # The status poll is answered while the tune (its reply minutes away) is under way.
            await until(pilot, lambda: state_cell(app) == "⏸ pausing → tuning", "the pause and what it is for")
            assert app.screen.query_one(RequestProgress).has_class("waiting")
            handler.release.set()
            await until(pilot, lambda: state_cell(app) == "▶ training", "the line back to training")
            await until(pilot, lambda: not app.screen.query_one(RequestProgress).has_class("waiting"), "the reply")

            # The supervisor goes (its socket with it); its trainer still runs: the last state, marked.
            await asyncio.to_thread(server.close)
            await until(pilot, lambda: state_cell(app) == "⚡ training", "the lost supervisor")
            assert not line.orphaned
            trainer.kill()
            await asyncio.to_thread(trainer.wait)
            await until(pilot, lambda: state_cell(app) == f"✗ {SUPERVISOR_LOST}", "nothing left running")

    try:
        asyncio.run(scenario())
    finally:
        handler.release.set()
        server.close()
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    assert not os.path.exists(socket)
