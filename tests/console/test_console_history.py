"""Lines that ended stay listed (issue 20 item 8): found in the work roots and the history of
registered lines, read from their files at rest, opened, and resumed with `R`."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
from helpers.console import book_of, until
from helpers.lines import make_data_line, make_line
from helpers.supervise import RUNNER, end_line_processes, kill_line_processes, stop_supervisor

from engine.config.host import HostSettings
from engine.layout import LineLayout
from engine.ops.rollback_records import rollback_times
from engine.process_start import started_since_boot
from engine.supervisor import registry
from engine.supervisor.registry import line_id
from nsconsole.app import ConsoleApp
from nsconsole.history import line_candidates, read_at_rest
from nsconsole.live import LiveLines
from nsconsole.screens.confirm import ConfirmScreen
from nsconsole.screens.line import LineScreen
from nsconsole.state import LineBook, LineView
from nsconsole.widgets.curves import CurveSettings, build_frame
from nsconsole.widgets.lines_table import LinesTable
from nsconsole.widgets.log_follower import LogFollower


@pytest.fixture(autouse=True)
def private_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "run").mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("NSCONSOLE_HOST", str(tmp_path / "host.json"))
    monkeypatch.setenv(registry.HISTORY_ENV_VARIABLE, str(tmp_path / "history"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the demo's root, ~/.nsconsole/lines, is empty
    (tmp_path / "host.json").write_text("{}")


def dead_pid() -> int:
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(finished.stdout)


def ended_line(path: Path, state: str, pid: int, **supervisor: object) -> Path:
    """A line directory as a supervisor that ended in `state` leaves it."""
    path.mkdir(parents=True)
    document = {"pid": pid, "started": 1000.0, "state": state, "launches": 3, "crashes": 2, **supervisor}
    (path / "supervisor.json").write_text(json.dumps(document))
    beat = {"time": 1500.0, "update": 12, "stage": "stopped", "pid": dead_pid(), "reason": "stop requested"}
    (path / "heartbeat").write_text(json.dumps(beat))
    rows = [{"update": update, "tokens": 512 * update, "loss": 5.0 - update / 10, "time": 1000.0 + update}
            for update in range(1, 13)]
    (path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (path / "checkpoints" / "u00000010").mkdir(parents=True)
    (path / "checkpoints" / "latest").write_text("u00000010\n")
    (path / "run.log").write_text("2026-01-01 00:00:00 update 12 loss 3.8\n2026-01-01 00:00:01 supervisor: stopped\n")
    return path


def test_lines_are_found_in_the_work_roots_and_the_history(tmp_path: Path) -> None:
    work = tmp_path / "work"
    trunk = ended_line(work / "trunk", "finished", dead_pid())
    (work / "never-ran").mkdir(parents=True)  # no supervisor.json: never ran under a supervisor
    elsewhere = ended_line(tmp_path / "elsewhere" / "probe", "failed", dead_pid())
    registry.remember_line(elsewhere)
    # The demo's root: the work root when there is one, else ~/.nsconsole/lines.
    demo = ended_line(tmp_path / "home" / ".nsconsole" / "lines" / "demo", "stopped", dead_pid())
    assert line_candidates(HostSettings(work_root=str(work))) == sorted(map(os.path.realpath, (trunk, elsewhere)))
    assert line_candidates(HostSettings()) == sorted(map(os.path.realpath, (elsewhere, demo)))


def test_only_lines_at_rest_are_read_and_shown_with_the_state_they_ended_in(tmp_path: Path) -> None:
    stopped = ended_line(tmp_path / "stopped", "stopped", dead_pid(),
                         last_event={"event": "failed", "time": 1400.0, "message": "an earlier failure"})
    # A supervisor that has not registered yet (ours: alive, started before its supervisor.json).
    starting = ended_line(tmp_path / "starting", "training", os.getpid(), started=time.time())
    killed = ended_line(tmp_path / "killed", "training", dead_pid())  # died with the line training
    assert read_at_rest(starting) is None
    book = LineBook()
    live = LiveLines(book, lambda line: None, clock=lambda: 2000.0, discover=lambda: [],
                     find_lines=lambda: [str(stopped), str(starting), str(killed)], history_interval=0.0)

    async def scenario() -> None:
        await live.discover_once()
        line = book.get(line_id(stopped))
        assert line is not None and line.at_rest and line.display_state == "stopped" and line.restarts == 2
        assert line.series.update == list(range(1, 13)) and line.resumable
        assert line.latest_checkpoint == 10 and line.kind == "trunk"
        assert [(event.kind, event.severity) for event in line.events] == [("failed", "error")]
        assert line.take_alerts() == []  # history, not news: no bell
        log = await live.read_log(line.key, 0, 4096)
        assert "update 12 loss 3.8" in log["text"] and log["next"] == log["size"]
        orphan = book.get(line_id(killed))
        assert orphan is not None and orphan.display_state != "training" and orphan.orphaned
        assert "ended while the line was training" in orphan.events[-1].message
        assert book.get(line_id(starting)) is None
        version = line.version
        await live.discover_once()  # unchanged files are not read again
        assert line.version == version

    asyncio.run(scenario())




@pytest.mark.parametrize(("text", "words"), [("{garbage\n", "not JSON ("), ("[1]\n", "not a JSON object")])
def test_a_line_whose_supervisor_json_is_damaged_is_listed_with_its_state_unknown(
    tmp_path: Path, text: str, words: str
) -> None:
    # Before, its line was read as no line at all: the console said "No line is running".
    path = ended_line(tmp_path / "work" / "line", "stopped", dead_pid())
    (path / "supervisor.json").write_text(text)  # damaged by hand (a supervisor writes it whole)
    assert line_candidates(HostSettings(work_root=str(tmp_path / "work"))) == [os.path.realpath(path)]
    book = LineBook()
    live = LiveLines(book, lambda line: None, clock=lambda: 2000.0, discover=lambda: [],
                     find_lines=lambda: [str(path)], history_interval=0.0)

    async def scenario() -> None:
        await live.discover_once()
        line = book.get(line_id(path))
        assert line is not None and line.at_rest and line.display_state == "unknown"
        assert line.ended and not line.orphaned and line.resumable
        assert line.series.update == list(range(1, 13)) and line.latest_checkpoint == 10
        assert [(event.kind, event.severity) for event in line.events] == [("damaged", "error")]
        assert line.events[0].message.startswith(f"{path / 'supervisor.json'}: {words}")
        with open(path / "rows.jsonl", "a") as rows:  # its files change: read again, the damage told once
            rows.write(json.dumps({"update": 13, "tokens": 512 * 13, "loss": 3.7, "time": 1013.0}) + "\n")
        await live.discover_once()
        assert line.update == 13 and [event.kind for event in line.events] == ["damaged"]

    asyncio.run(scenario())


def test_a_line_at_rest_whose_rows_jsonl_is_a_directory_is_shown_without_rows(tmp_path: Path) -> None:
    # Before, the console's read of it raised IsADirectoryError and the console exited.
    line = ended_line(tmp_path / "line", "stopped", dead_pid())
    (line / "rows.jsonl").unlink()
    (line / "rows.jsonl").mkdir()
    resting = read_at_rest(line)
    assert resting is not None and resting.rows == [] and resting.supervisor["state"] == "stopped"


def test_a_live_supervisor_or_trainer_is_not_taken_for_a_reused_pid_after_a_clock_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ours = started_since_boot(psutil.Process())  # this process plays the supervisor, then the trainer
    supervised = ended_line(tmp_path / "supervised", "training", os.getpid(), started=time.time(), boot_start=ours)
    orphan = ended_line(tmp_path / "orphan", "training", dead_pid())
    beat = {"time": time.time(), "update": 12, "stage": "training", "pid": os.getpid(), "pid_boot_start": ours}
    (orphan / "heartbeat").write_text(json.dumps(beat))  # its trainer still runs, checkpointing
    # The wall clock steps an hour forward: psutil's wall-clock start of this process moves with it,
    # past the times recorded, as a younger process's would.
    booted = psutil.boot_time()
    monkeypatch.setattr(psutil._psplatform, "boot_time", lambda: booted + 3600.0)
    assert psutil.Process().create_time() > time.time() + 3000
    assert read_at_rest(supervised) is None and read_at_rest(orphan) is None  # neither is at rest


@pytest.mark.slow
def test_a_line_that_stopped_is_listed_by_a_fresh_console_and_resumed_with_a_key(tmp_path: Path) -> None:
    # No preparer: only cycle 0 is prepared, so after it the trainer waits for data, alive.
    data = make_data_line(tmp_path / "data_root", prepare=1)
    line_path = make_line(tmp_path, data)
    runner = tmp_path / "runner.py"
    runner.write_text(RUNNER)
    settings = {"poll_seconds": 0.1, "relaunch_delay_seconds": 0.05, "run_preparer": False}
    first = subprocess.Popen([sys.executable, str(runner), str(line_path), json.dumps(settings)])
    try:
        deadline = time.monotonic() + 180
        while not (line_path / "checkpoints" / "latest").exists() or registry.find_supervisor(line_path) is None:
            assert time.monotonic() < deadline and first.poll() is None, "the line never checkpointed"
            time.sleep(0.2)
        stop_supervisor(line_path)
        first.wait(timeout=60)
        stopped_at = json.loads((line_path / "heartbeat").read_text())["update"]
        key = line_id(line_path)

        async def scenario() -> None:
            app = ConsoleApp(refresh_interval=0.2)
            async with app.run_test(size=(150, 40)) as pilot:
                line: LineView = await until(pilot, lambda: app.book.get(key), "the stopped line to be listed")
                table = app.screen.query_one(LinesTable)
                await until(pilot, lambda: key in table.rows, "its row")
                assert str(table.get_cell(key, "state")) == "■ stopped" and line.update == stopped_at
                # Opened: the curves have its rows, the log tab reads its run.log.
                await pilot.press("enter")
                assert isinstance(app.screen, LineScreen) and len(line.series) >= stopped_at
                app.screen.query_one("TabbedContent").active = "tab-log"
                log = app.screen.query_one(LogFollower)
                await until(pilot, lambda: any("stop" in text for text in log.lines), "run.log in the log tab")
                await pilot.press("escape")
                # `R`: a confirmation with No focused; Escape starts nothing.
                assert app.check_action("resume", ()) is True and app.check_action("stop", ()) is None
                await pilot.press("R")
                assert isinstance(app.screen, ConfirmScreen) and str(line_path) in app.screen.question
                assert app.screen.focused is not None and app.screen.focused.id == "no"
                await pilot.press("escape")
                await pilot.pause(0.5)
                assert registry.find_supervisor(line_path) is None
                await pilot.press("R")
                await pilot.press("y")
                # Its supervisor starts detached; the console attaches and shows it training on.
                await until(pilot, lambda: line.connected, "the console to attach to the new supervisor", 180)
                await until(pilot, lambda: (line.update or 0) > stopped_at, "updates past the stop", 180)
                await until(pilot, lambda: str(table.get_cell(key, "state")).startswith(("▶", "…", "⤓", "◇")),
                            "the row to show it training")
                assert not line.at_rest and app.check_action("resume", ()) is None
                # It trains to the end of its data line (the preparer runs now); once its supervisor
                # has exited, `R` is on again.
                await until(pilot, lambda: line.display_state == "finished", "the line's end", 300)
                await until(pilot, lambda: app.check_action("resume", ()) is True, "resume to be on again")

        asyncio.run(scenario())
    finally:
        left_running = end_line_processes([first], tmp_path)
    assert left_running == []
    assert json.loads((line_path / "supervisor.json").read_text())["state"] == "finished"


def resume_with_r(
    tmp_path: Path, after_yes: Callable[[Any, LineView, Path], Awaitable[None]], line_path: Path | None = None,
    confirmed: bool = True,
) -> None:
    """A console with one line no supervisor runs (a new one unless given): `R`, `y` (unless not
    `confirmed`: no confirmation expected), then `after_yes(pilot, line, line_path)`; every process
    of the line is gone at the end."""
    line_path = line_path or make_line(tmp_path, make_data_line(tmp_path / "data_root", prepare=1))
    line = LineView(line_id(line_path), line_path)  # no supervisor runs it: `R` is on
    app = ConsoleApp(book=book_of(line), attach=False)

    class Live:  # the keys' gate: a console attached to supervisors (this one looks for none)
        problem = None

    async def scenario() -> None:
        async with app.run_test(size=(150, 40)) as pilot:
            app.live = Live()  # type: ignore[assignment]
            await until(pilot, lambda: app.selected_line() is line, "the line's row")
            await pilot.press("R")
            if confirmed:
                await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the confirmation")
                await pilot.press("y")
            await after_yes(pilot, line, line_path)

    try:
        asyncio.run(scenario())
    finally:
        left_running = kill_line_processes(tmp_path)
    assert left_running == []


@pytest.mark.slow
def test_a_supervisor_started_with_r_is_reaped_when_it_exits(tmp_path: Path) -> None:
    """`R` starts the supervisor as the console's own child: once it exits, the console collects it
    (no `<defunct>` left under the console while it runs)."""

    async def after_yes(pilot: Any, line: LineView, line_path: Path) -> None:
        started = await until(pilot, lambda: next(
            (event for event in line.events if "its supervisor runs" in event.message), None
        ), "the supervisor to start", 180)
        pid = int(started.message.rsplit("pid ", 1)[1].rstrip(")"))
        assert psutil.Process(pid).ppid() == os.getpid()  # the console's child
        await asyncio.to_thread(stop_supervisor, line_path)  # it exits (or is a zombie: gone)
        await until(pilot, lambda: not psutil.pid_exists(pid), "the console to reap its supervisor", 10)

    resume_with_r(tmp_path, after_yes)


@pytest.mark.slow
def test_a_supervisor_that_has_not_answered_in_time_is_still_reaped(tmp_path: Path, monkeypatch) -> None:
    """`R` whose supervisor has not answered within the wait: the console says resume failed, and
    still collects that child when it exits (it came up later here, and was stopped)."""
    from engine.supervisor import start

    monkeypatch.setattr(start, "start_detached", functools.partial(start.start_detached, answer_timeout=0.0))

    async def after_yes(pilot: Any, line: LineView, line_path: Path) -> None:
        refused = await until(pilot, lambda: next(
            (event for event in line.events if "has not answered within 0 s" in event.message), None
        ), "the resume to be reported failed", 60)
        pid = int(refused.message.split("(pid ", 1)[1].split(")", 1)[0])
        assert psutil.Process(pid).ppid() == os.getpid()
        await until(pilot, lambda: registry.find_supervisor(line_path), "the late supervisor to register", 180)
        await asyncio.to_thread(stop_supervisor, line_path)
        await until(pilot, lambda: not psutil.pid_exists(pid), "the console to reap its supervisor", 10)

    resume_with_r(tmp_path, after_yes)


def test_rollbacks_recorded_in_the_files_become_events_once(tmp_path: Path) -> None:
    """Each rows.rolledback-<time>.jsonl is a `rolled_back` event (history, no alert), unless the
    supervisor's own event of that rollback, which comes after the file's second, tells it already."""
    line_path = ended_line(tmp_path / "line", "stopped", dead_pid())
    for name in ("rows.rolledback-19700101T001645Z.jsonl", "rows.rolledback-19700101T001645Z-2.jsonl",
                 "rows.rolledback-19700101T002000Z.jsonl", "rows.rolledback-notatime.jsonl"):
        (line_path / name).write_text("")
    assert rollback_times(LineLayout(line_path)) == [1005.0, 1005.0, 1200.0]  # 00:16:45 and 00:20:00
    resting = read_at_rest(line_path)
    assert resting is not None
    view = LineView(line_id(line_path), line_path)
    view.add_event(1203.5, "rolled_back", "rollback done", alert=False)  # a supervisor told of the third
    view.apply_rest(resting.supervisor, resting.heartbeat, resting.rows, 2000.0)
    assert sorted(event.time for event in view.events if event.kind == "rolled_back") == [1005.0, 1005.0, 1203.5]
    assert view.take_alerts() == []
    view.apply_rest(resting.supervisor, resting.heartbeat, resting.rows, 2001.0)  # read again: nothing new
    assert len([event for event in view.events if event.kind == "rolled_back"]) == 3
    frame = build_frame(view, CurveSettings(x_axis="update"), None, {})
    assert sorted(x for x, kind in frame.markers if kind == "rollback") == [5, 5]  # row u is written at 1000 + u


@pytest.mark.slow
def test_r_on_a_finished_line_says_so_and_starts_nothing(tmp_path: Path) -> None:
    """As `nsconsole run` refuses it: a finished line has nothing to train, so `R` says how to train
    on from it instead of starting a supervisor that ends at once (found in a walkthrough)."""
    from engine.training.trainer import Trainer

    line_path = make_line(tmp_path, make_data_line(tmp_path / "data_root", files=2))
    assert Trainer(line_path, echo=None).run() == 0  # to the end of its data line

    async def refused(pilot: Any, line: LineView, line_path: Path) -> None:
        event = await until(pilot, lambda: next((event for event in line.events if event.kind == "refused"), None),
                            "the refusal", 60)
        assert "has finished (it trained every cycle of its data line" in event.message
        assert not isinstance(pilot.app.screen, ConfirmScreen)

    resume_with_r(tmp_path, refused, line_path, confirmed=False)
    assert not (line_path / "supervisor.json").exists()


def test_r_on_a_line_whose_data_line_is_gone_is_refused_in_words(tmp_path: Path) -> None:
    """A data line removed from under a stopped line: `R` reads it to know whether the line has
    finished, and the DataLineError escaped the key's worker (found in a review: it ended the console)."""
    data = make_data_line(tmp_path / "data_root", prepare=1)
    line_path = make_line(tmp_path, data)
    shutil.rmtree(data)

    async def refused(pilot: Any, line: LineView, line_path: Path) -> None:
        event = await until(pilot, lambda: next((event for event in line.events if event.kind == "refused"), None),
                            "the refusal", 60)
        assert str(data) in event.message and event.message.startswith("resume: ")
        assert not isinstance(pilot.app.screen, ConfirmScreen)

    resume_with_r(tmp_path, refused, line_path, confirmed=False)
    assert not (line_path / "supervisor.json").exists()
