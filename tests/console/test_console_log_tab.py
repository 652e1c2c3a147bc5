"""The log tab when the user leaves the line's screen while run.log is coming in (Pilot).

Seen once on a loaded machine: Escape while the log tab filled, and the console exited with
Textual's `NoActiveAppError` from `Log._update_size`. A read that answered after the log had left
the screen wrote its lines to the gone log; Textual measures written lines in a thread worker, which
looked the app up through the log's parents, gone by then; the worker's error exits the app
(`nsconsole/widgets/log_follower.py`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

import pytest
from helpers.console import book_of, console, frozen_book, settle, until

from nsconsole.app import ConsoleApp
from nsconsole.screens.line import LineScreen
from nsconsole.screens.lines import LinesScreen
from nsconsole.widgets.log_follower import LogFollower

LOG_TEXT = "update 41 loss 3.02 lr 3.0e-03\n" * 20


class LateLog:
    """The supervisor's `log` call, whose read of run.log answers only once the log tab has left the screen."""

    problem = None  # discovery works

    def __init__(self) -> None:
        self.follower: LogFollower | None = None
        self.asked = asyncio.Event()
        self.leaving = asyncio.Event()
        self.answered = False

    async def read_log(self, key: str, offset: int, length: int) -> dict:
        if length == 1:  # the tab's first probe of run.log's size: empty so far
            return {"text": "", "next": 0, "size": 0}
        self.asked.set()
        await self.leaving.wait()
        assert self.follower is not None
        # The answer comes the moment the log is detached, before the screen (and its reading worker) is.
        while self.follower.is_attached:
            await asyncio.sleep(0)
        self.answered = True
        return {"text": LOG_TEXT, "next": offset + len(LOG_TEXT), "size": offset + len(LOG_TEXT)}


def run(app: ConsoleApp, scenario: Callable[..., Awaitable[None]]) -> None:
    async def main() -> None:
        async with app.run_test(size=(150, 40)) as pilot:
            await settle(pilot)
            await scenario(pilot)

    asyncio.run(main())


async def open_line(pilot) -> LogFollower:
    """The line's screen, opened with Enter; its log tab."""
    await pilot.press("enter")
    screen = await until(
        pilot, lambda: isinstance(pilot.app.screen, LineScreen) and pilot.app.screen, "a line"
    )
    return screen.query_one(LogFollower)


async def leave(pilot, follower: LogFollower) -> None:
    """Escape, back on the lines screen with the log gone."""
    await pilot.press("escape")
    await until(
        pilot, lambda: isinstance(pilot.app.screen, LinesScreen) and not follower.is_attached, "the lines"
    )


def test_a_log_read_answered_after_escape_writes_nothing_and_the_console_stays() -> None:
    app = console(book=book_of(frozen_book().get("pssa-trunk-id")))
    live = LateLog()

    async def scenario(pilot) -> None:
        app.live = live  # type: ignore[assignment]
        live.follower = await open_line(pilot)
        await pilot.press("5")  # the log tab: its first read is on its way
        await until(pilot, live.asked.is_set, "the log tab's read")
        live.leaving.set()
        await leave(pilot, live.follower)
        await until(pilot, lambda: live.answered, "the read's answer")
        await pilot.pause(0.3)
        # Before: the answer's lines went to the gone log, measured in a thread that failed: exited.
        assert app.is_running and app._exception is None
        assert live.follower.line_count == 0  # nothing written to a log no one sees

    run(app, scenario)


def test_lines_written_to_a_log_gone_from_its_screen_do_not_exit_the_console(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = console()
    measured_off_loop = threading.Event()
    measuring = threading.Event()
    may_finish = threading.Event()
    may_finish.set()
    process_line = LogFollower._process_line

    def held_process_line(line: str) -> str:
        # Textual measures written lines in a thread; hold that thread while the test says so.
        if threading.current_thread() is not threading.main_thread():
            measured_off_loop.set()
            measuring.set()
            may_finish.wait(timeout=30)
        return process_line(line)

    monkeypatch.setattr(LogFollower, "_process_line", staticmethod(held_process_line))

    async def scenario(pilot) -> None:
        follower = await open_line(pilot)
        follower.write_lines(["x" * 300])
        await until(pilot, lambda: follower.virtual_size.width == 300, "the line's width")
        assert measured_off_loop.is_set()  # as Textual does: off the event loop
        # A measurement in flight when the user leaves: it ends after the log is gone.
        measuring.clear()
        may_finish.clear()
        follower.write_lines(["y" * 400])
        await until(pilot, measuring.is_set, "the measurement")
        await leave(pilot, follower)
        may_finish.set()
        await pilot.pause(0.3)
        assert app.is_running and app._exception is None
        # Lines written after the log is gone (as a read answered late did): before, their
        # measurement found no app through the log's parents (NoActiveAppError) and the console exited.
        follower.write_lines(["z" * 500])
        await pilot.pause(0.3)
        assert app.is_running and app._exception is None

    run(app, scenario)
