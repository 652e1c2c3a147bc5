"""The console (Pilot) against a real supervisor training a tiny line on the CPU.

One scenario, because every trainer launch pays for importing torch: the line appears and its
update count advances; its screen follows run.log; `s` opens the dialogs and Escape sends
nothing; the supervisor killed with SIGKILL dims the row and turns the mutating keys off, and
once its trainer has stopped the line's files are shown; a new
supervisor is reconnected (a new epoch: rows refetched); `r` lists the line's checkpoints;
confirming a stop stops the line with a checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from helpers.console import until
from helpers.lines import copy_data_line, make_data_line, make_line
from helpers.supervise import end_line_processes, kill_line_processes, start_supervisor, stop_supervisor
from textual.widgets import Input

from datalines import open_data_line
from datalines.preparer import prepare_cycle
from engine.supervisor.registry import line_id
from nsconsole.app import ConsoleApp
from nsconsole.live import LiveLines
from nsconsole.screens.branch_form import BranchForm
from nsconsole.screens.confirm import ConfirmScreen
from nsconsole.screens.line import LineScreen
from nsconsole.screens.lines import LinesScreen
from nsconsole.screens.picker import PickerScreen
from nsconsole.state import LineBook, LineView
from nsconsole.widgets.checkpoint_list import read_checkpoints
from nsconsole.widgets.lines_table import LinesTable
from nsconsole.widgets.log_follower import LogFollower

pytestmark = pytest.mark.usefixtures("private_host")  # conftest: an empty host.json, a private runtime dir


def state_cell(app: ConsoleApp, key: str) -> str:
    table = app.screen.query_one(LinesTable)
    return str(table.get_cell(key, "state"))


def stopped_update(line_path: Path) -> int | None:
    """The update the line's trainer stopped at, once its heartbeat says it stopped."""
    try:
        heartbeat = json.loads((line_path / "heartbeat").read_text())
    except (OSError, ValueError):
        return None
    return heartbeat["update"] if heartbeat.get("stage") == "stopped" else None


@pytest.mark.slow
def test_the_console_follows_stops_and_reattaches_to_a_real_supervisor(tmp_path: Path) -> None:
    # Only cycle 0 is prepared: after it the trainer waits for data, alive, however fast it is.
    data = make_data_line(tmp_path / "data_root", prepare=1)
    line_path = make_line(tmp_path, data)
    key = line_id(line_path)
    supervisors: list[subprocess.Popen[bytes]] = []

    async def scenario() -> None:
        app = ConsoleApp(refresh_interval=0.2)
        async with app.run_test(size=(150, 40)) as pilot:
            # No preparer: the trainer waits after cycle 0, alive, and the line cannot finish before the stop.
            supervisors.append(start_supervisor(tmp_path, line_path, run_preparer=False))
            line: LineView = await until(pilot, lambda: app.book.get(key), "the line to appear")
            first = await until(pilot, lambda: line.update, "a first update")
            await until(pilot, lambda: (line.update or 0) > first, "the update count to advance")
            await until(pilot, lambda: state_cell(app, key).startswith(("▶", "…")), "the table to show it")

            # Its screen: the log tab follows run.log through the supervisor's `log` call.
            await pilot.press("enter")
            assert isinstance(app.screen, LineScreen)
            app.screen.query_one("TabbedContent").active = "tab-log"
            log = app.screen.query_one(LogFollower)
            await until(pilot, lambda: any("update" in text for text in log.lines), "run.log in the log tab")
            await pilot.press("escape")
            assert isinstance(app.screen, LinesScreen)

            # `s`, then Escape at the picker and at the confirmation: nothing is sent.
            await pilot.press("s")
            assert isinstance(app.screen, PickerScreen)
            await pilot.press("escape")
            await pilot.press("s")
            await pilot.press("enter")  # "at the next update"
            assert isinstance(app.screen, ConfirmScreen)
            assert app.screen.focused is not None and app.screen.focused.id == "no"
            await pilot.press("escape")
            await pilot.pause(0.3)
            assert isinstance(app.screen, LinesScreen)
            assert not (line_path / "STOP").exists()
            assert not any(event.kind == "request" for event in line.events)
            assert line.supervisor_state == "training"

            # The supervisor dies: the row stays, dimmed and marked, and the mutating keys go off.
            old_epoch = line.epoch
            os.kill(supervisors[-1].pid, signal.SIGKILL)
            supervisors[-1].wait()
            await until(pilot, lambda: not line.connected, "the console to notice")
            # `⚡` while its trainer checkpoints (SIGTERM from the kernel), `✗` once it has gone: a tiny
            # line's trainer may go before a refresh.
            await until(pilot, lambda: state_cell(app, key).startswith(("⚡", "✗")), "the row to be marked")
            assert app.check_action("stop", ()) is None
            await pilot.press("s")
            assert isinstance(app.screen, LinesScreen)  # the key does nothing
            # Its trainer checkpoints and stops on its own after the last reply: the console reads
            # the line's files then, and shows where the trainer stopped, not its last reply.
            stopped = await until(pilot, lambda: stopped_update(line_path), "the orphaned trainer to stop", 120)
            await until(pilot, lambda: line.at_rest and line.update == stopped and line.latest_checkpoint == stopped,
                        "the line's files on screen", 30)
            assert app.check_action("stop", ()) is None

            # A new supervisor: reattached, rows refetched, keys back on.
            supervisors.append(start_supervisor(tmp_path, line_path, run_preparer=False))
            await until(pilot, lambda: line.connected and line.epoch != old_epoch, "the reconnection")
            assert any(event.kind == "restarted" for event in line.events)
            await until(pilot, lambda: line.status.get("trainer_pid"), "the relaunched trainer")
            assert app.check_action("stop", ()) is True

            # `r` lists the line's real checkpoints before `latest`, newest first; Escape leaves it.
            # The relaunched trainer may write a checkpoint (and retention remove one) between the
            # picker's read and this test's: compared only when the line's checkpoints held still.
            await until(pilot, lambda: len(read_checkpoints(line_path)) >= 2, "a checkpoint before the latest", 60)
            for _ in range(5):
                before = [info.update for info in read_checkpoints(line_path)]
                await pilot.press("r")
                assert isinstance(app.screen, PickerScreen)
                listed = [update for update, _ in app.screen.options]
                checkpoints = read_checkpoints(line_path)
                if [info.update for info in checkpoints] == before:
                    break
                await pilot.press("escape")
            latest = next(info.update for info in checkpoints if info.latest)  # a rollback goes back from it
            assert listed and listed == [str(info.update) for info in checkpoints if info.update < latest]
            await pilot.press("escape")

            # Confirming a stop stops the line with a checkpoint.
            await pilot.press("s")
            await pilot.press("enter")
            await pilot.press("y")
            await until(pilot, lambda: supervisors[-1].poll() is not None, "the supervisor to stop")
            assert any(event.kind == "request" and "accepted" in event.message for event in line.events)

    try:
        asyncio.run(scenario())
    finally:
        for process in supervisors:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert supervisors[-1].returncode == 0
    assert json.loads((line_path / "supervisor.json").read_text())["state"] == "stopped"
    heartbeat = json.loads((line_path / "heartbeat").read_text())
    assert heartbeat["stage"] == "stopped"
    assert (line_path / "checkpoints" / "latest").read_text().strip() == f"u{heartbeat['update']:08d}"
    assert not psutil.pid_exists(heartbeat["pid"]) or psutil.Process(heartbeat["pid"]).status() == "zombie"


@pytest.mark.slow
def test_a_branch_requested_for_the_current_cycle_happens_at_its_end(tmp_path: Path) -> None:
    data = make_data_line(tmp_path / "data_root", prepare=1)
    line_path = make_line(tmp_path, data)
    branch_path = tmp_path / "branch"
    branch_data = copy_data_line(data, tmp_path / "branch_data")  # a branch trains on its own data line
    # No preparer: cycle 1 stays unprepared (so unfinished) until the test prepares it.
    supervisors = [start_supervisor(tmp_path, line_path, run_preparer=False)]
    left_running: list[str] = []

    async def scenario() -> None:
        app = ConsoleApp(refresh_interval=0.2)
        async with app.run_test(size=(150, 40)) as pilot:
            line: LineView = await until(pilot, lambda: app.book.get(line_id(line_path)), "the line")
            # Cycle 0 is done and cycle 1 not prepared: the trainer is in cycle 1, waiting for it.
            await until(pilot, lambda: (line.heartbeat or {}).get("stage") == "waiting-data", "the data wait")
            await until(pilot, lambda: state_cell(app, line.key), "the row")
            await pilot.press("b")
            # The form is pushed by the action's worker: on a loaded machine, a tick or two later.
            await until(pilot, lambda: isinstance(app.screen, BranchForm), "the branch form")
            app.screen.query_one("#path", Input).value = str(branch_path)
            app.screen.query_one("#at_cycle", Input).value = "1"
            # Nearly all the branch's data line (about 21,300 tokens): it trains until stopped.
            app.screen.query_one("#plan", Input).value = "decay:2e4"
            app.screen.query_one("#data", Input).value = str(branch_data)
            await pilot.click("#submit")
            assert isinstance(app.screen, ConfirmScreen)
            await pilot.press("y")
            outcome = await until(
                pilot, lambda: next((e for e in line.events if e.kind == "refused" or "accepted" in e.message), None),
                "the supervisor's answer",
            )
            assert outcome.kind != "refused", outcome.message
            assert not branch_path.exists()  # it waits for the end of cycle 1
            prepare_cycle(open_data_line(data), 1)
            # The fork is made, and the trunk's supervisor starts the branch's own.
            branched = await until(
                pilot, lambda: next((e for e in line.events if e.kind == "branched"), None), "the fork"
            )
            assert str(branch_path) in branched.message and "its supervisor started" in branched.message
            assert (branch_path / "run.json").is_file() and (branch_path / "checkpoints" / "latest").is_file()
            # The branch line appears in the lines table and trains.
            branch: LineView = await until(pilot, lambda: app.book.get(line_id(branch_path)), "the branch line")
            await until(pilot, lambda: branch.key in app.screen.query_one(LinesTable).rows, "the branch's row")
            first = await until(pilot, lambda: branch.update, "the branch's first update")
            await until(pilot, lambda: (branch.update or 0) > first, "the branch's update count to advance")
            # Stopped over their sockets (in a thread: the app goes on meanwhile): nothing outlives the test.
            await asyncio.to_thread(stop_supervisor, branch_path)
            await asyncio.to_thread(stop_supervisor, line_path)

    try:
        asyncio.run(scenario())
    finally:
        left_running = end_line_processes(supervisors, tmp_path)
    assert supervisors[0].returncode == 0 and left_running == []


@pytest.mark.slow
def test_a_rollback_takes_what_it_sets_aside_off_the_screen_when_it_is_done(tmp_path: Path) -> None:
    """The rows and validations after the rollback's checkpoint leave the console with the
    `rolled_back` event, before any row of the relaunched trainer could push them out (a stopped
    line's would never come): the rows are fetched again."""
    data = make_data_line(tmp_path / "data_root", prepare=1)  # the trainer waits after cycle 0, alive
    line_path = make_line(tmp_path, data, **{"validation.every_updates": 3})
    key = line_id(line_path)
    at_event: list[tuple[int, list[int]]] = []

    def on_change(line: LineView) -> None:
        if not at_event and any(event.kind == "rolled_back" for event in line.events):
            at_event.append((max(line.series.update, default=0), [row["update"] for row in line.validations]))
            at_event.append((line.update or 0, []))  # the header's update: not the stopped trainer's last beat

    live = LiveLines(LineBook(), on_change, discovery_interval=0.2, status_interval=0.5)
    supervisor = start_supervisor(tmp_path, line_path, run_preparer=False)

    async def scenario() -> int:
        watching = asyncio.create_task(live.run())
        try:
            deadline = time.monotonic() + 180
            target = 0  # the line's first checkpoint
            while not (line := live.book.get(key)) or not line.validations or (line.latest_checkpoint or 0) <= target \
                    or line.validations[-1]["update"] <= target:
                assert time.monotonic() < deadline, "no validation and checkpoint after the first checkpoint"
                await asyncio.sleep(0.2)
            await live.mutate(key, "rollback", to=target)
            while not at_event:
                assert time.monotonic() < deadline, "no rolled_back event"
                await asyncio.sleep(0.1)
            return target
        finally:
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watching

    try:
        target = asyncio.run(scenario())
    finally:
        supervisor.kill()
        supervisor.wait()
        kill_line_processes(tmp_path)
    (newest_row, validations), (shown_update, _) = at_event
    assert newest_row <= target and all(update <= target for update in validations), (target, at_event)
    assert shown_update <= target, (target, at_event)
