"""The console keeps refreshing a line while its supervisor carries out a long mutation."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from typing import Any

from engine.supervisor.registry import SupervisorEntry
from engine.supervisor.server import SupervisorServer
from nsconsole.live import LiveLines
from nsconsole.state import LineBook


class SlowTuneLine:
    """A line whose tune takes longer than a status call may wait (a real tune takes minutes)."""

    def __init__(self) -> None:
        self.tuning = threading.Event()
        self.tuned = False

    def status(self) -> dict[str, Any]:
        return {"state": "tuning" if self.tuning.is_set() else "training", "tuned": self.tuned}

    def tune(self, shared: bool) -> dict[str, Any]:
        self.tuning.set()
        time.sleep(1.5)  # three status timeouts of 0.5 s
        # Done tuning before it says tuned: a status reply between the two must not read tuned and
        # still tuning (the test ends at the first reply that says tuned).
        self.tuning.clear()
        self.tuned = True
        return {"lengths": []}


def test_status_polls_go_on_after_one_waited_past_its_timeout_behind_a_tune(tmp_path: Path) -> None:
    handler = SlowTuneLine()
    socket = tmp_path / "supervisor.sock"
    server = SupervisorServer(socket, handler, identity={"line": str(tmp_path)})
    server.start()
    entry = SupervisorEntry("line", str(tmp_path), str(socket), os.getpid(), 0.0, time.time())
    book = LineBook()
    seen: list[Any] = []

    async def scenario() -> None:
        live = LiveLines(book, lambda line: seen.append(line.status.get("state")), discover=lambda: [entry],
                         status_interval=0.1, call_timeout=0.5)
        runner = asyncio.create_task(live.run())
        try:
            while book.get("line") is None or not book.get("line").connected:
                await asyncio.sleep(0.05)
            assert await live.mutate("line", "tune", shared=False) == {"lengths": []}
            deadline = time.monotonic() + 10
            while not book.get("line").status.get("tuned"):
                assert time.monotonic() < deadline, "the status poll stopped after a timed-out reply"
                await asyncio.sleep(0.05)
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)

    try:
        asyncio.run(scenario())
    finally:
        server.close()
    assert book.get("line").status["state"] == "training"
