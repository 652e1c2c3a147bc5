"""A request to a line whose supervisor has exited is answered at once; one to a supervisor that is
only reconnecting still waits for it.

The console keeps a mutation over a reconnect (one request_id, applied once), waiting for the link
to come back. A supervisor that exited (its line finished or stopped) comes back never: the request
used to wait out every retry (about 40 s of `⏳ rollback ...: waiting for the supervisor…`) before
saying "not attached". The console now asks discovery whether a supervisor still serves the line.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.console import until
from helpers.lines import make_data_line, make_line
from helpers.supervise import end_line_processes, start_supervisor, stop_supervisor

from engine.supervisor import registry
from engine.supervisor.registry import line_id
from engine.supervisor.server import SupervisorServer
from nsconsole.app import ConsoleApp
from nsconsole.client import SupervisorUnavailable
from nsconsole.live import LiveLines
from nsconsole.screens.confirm import ConfirmScreen
from nsconsole.screens.picker import PickerScreen
from nsconsole.state import LineBook, LineView

pytestmark = pytest.mark.usefixtures("private_host")  # conftest: an empty host.json, a private runtime dir


@pytest.mark.slow
def test_a_rollback_confirmed_after_the_supervisor_exited_is_refused_at_once(tmp_path: Path) -> None:
    # Only cycle 0 is prepared: after it the trainer waits for data, alive, however fast it is.
    line_path = make_line(tmp_path, make_data_line(tmp_path / "data_root", prepare=1))
    key = line_id(line_path)
    supervisor = start_supervisor(tmp_path, line_path)

    async def scenario() -> None:
        app = ConsoleApp(refresh_interval=0.2)
        async with app.run_test(size=(150, 40)) as pilot:
            line: LineView = await until(pilot, lambda: app.book.get(key), "the line to appear")
            await until(pilot, lambda: line.connected and (line.latest_checkpoint or 0) > 0, "a second checkpoint")
            await pilot.press("r")
            assert isinstance(app.screen, PickerScreen)
            await pilot.press("enter")  # the newest checkpoint before `latest`
            assert isinstance(app.screen, ConfirmScreen)

            # While the question is open the supervisor exits (stopped here; a finished line's does the same).
            await asyncio.to_thread(stop_supervisor, line_path)
            await until(pilot, lambda: not line.connected, "the console to see the connection closed", 30)
            await pilot.press("y")
            refused = await until(pilot, lambda: [event for event in line.events if event.kind == "refused"],
                                  "the request's answer", 5)  # it used to come after about 40 s
            assert not app.pending  # no `⏳ rollback ...: waiting for the supervisor…` under the screen
            message = refused[-1].message
            assert message.startswith(f"rollback: {line_path}: its supervisor (pid {supervisor.pid}) has exited"), message
            assert "(state stopped); the rollback was not sent" in message, message

    try:
        asyncio.run(scenario())
    finally:
        left_running = end_line_processes([supervisor], tmp_path)
    assert left_running == []
    assert not list(line_path.glob("rows.rolledback-*.jsonl"))  # nothing was rolled back


class StopOnlyLine:
    """A supervisor's handler that serves `status` and `stop` (counted)."""

    def __init__(self) -> None:
        self.stops: list[Any] = []

    def status(self) -> dict[str, Any]:
        return {"state": "training"}

    def stop(self, at_cycle_end: int | None = None) -> dict[str, Any]:
        self.stops.append(at_cycle_end)
        return {"stopping": True, "at_cycle_end": at_cycle_end}


async def attached(live: LiveLines, key: str) -> LineView:
    """The line once its link is up."""
    deadline = time.monotonic() + 10
    while (line := live.book.get(key)) is None or not line.connected:
        assert time.monotonic() < deadline, "the console did not attach"
        await asyncio.sleep(0.05)
    return line


async def detached(line: LineView) -> None:
    deadline = time.monotonic() + 10
    while line.connected:
        assert time.monotonic() < deadline, "the console did not see the connection close"
        await asyncio.sleep(0.05)


def test_a_request_waits_for_a_supervisor_that_is_reconnecting_and_not_for_one_that_exited(tmp_path: Path) -> None:
    """The connection drops while the supervisor is still registered and running (a restart of its
    socket, a dropped connection): the request is sent once the link is back. Once no supervisor is
    registered for the line any more (it unregisters before it closes its socket), it fails at once."""
    socket = tmp_path / "supervisor.sock"
    handler = StopOnlyLine()
    server = SupervisorServer(socket, handler, identity={"line": str(tmp_path)})
    server.start()
    entry = registry.register(tmp_path, socket)  # this process plays the supervisor
    key = entry.id

    async def scenario() -> None:
        nonlocal server
        live = LiveLines(LineBook(), lambda line: None, discovery_interval=0.1, initial_backoff=0.05)
        watching = asyncio.create_task(live.run())
        try:
            line = await attached(live, key)
            server.close()  # the connection closes; the supervisor is still registered and alive
            await detached(line)
            request = asyncio.create_task(live.mutate(key, "stop", at_cycle_end=None))
            await asyncio.sleep(1.0)
            assert not request.done() and handler.stops == []  # it waits for the link
            server = SupervisorServer(socket, handler, identity={"line": str(tmp_path)})
            server.start()
            assert await asyncio.wait_for(request, 15) == {"stopping": True, "at_cycle_end": None}
            assert handler.stops == [None]

            registry.unregister(entry)  # the supervisor ends: its entry goes, then its socket
            server.close()
            await detached(line)
            began = time.monotonic()
            with pytest.raises(SupervisorUnavailable, match=rf"its supervisor \(pid {os.getpid()}\) has exited "
                                                            r"\(state training\); the stop was not sent"):
                await asyncio.wait_for(live.mutate(key, "stop", at_cycle_end=None), 5)
            assert time.monotonic() - began < 2  # it used to wait 4 × 10 s for a reconnection
            assert handler.stops == [None]
        finally:
            watching.cancel()
            await asyncio.gather(watching, return_exceptions=True)

    try:
        asyncio.run(scenario())
    finally:
        server.close()
        registry.unregister(entry)
