"""Alerts a user can live with (issue 20 item 7): the slow flag skips each trainer's warm-up and
rings once per episode, heartbeat alarms spare lines that ended, the bell rings only for the
severities chosen (errors by default), the events tab filters by severity, restarts count crashes."""

from __future__ import annotations

import asyncio

import pytest
from helpers.console import NOW, console, frozen_book, settle

from engine.protocol.facts import SupervisorExitCode
from nsconsole import health
from nsconsole.cli import main
from nsconsole.commands.console import bell_severities
from nsconsole.screens.line import LineScreen
from nsconsole.state import LineView
from nsconsole.widgets.event_list import EventList


def row(update: int, time: float, tokens_per_s: float) -> dict:
    return {"update": update, "tokens": update * 512, "loss": 3.0, "lr": 1e-3, "grad_norm": 1.0,
            "tokens_per_s": tokens_per_s, "time": time, "tokens_per_update": 512}


def training_line() -> LineView:
    """A line whose first trainer (launched at t=0) has trained 40 updates at 1000 tokens/s."""
    line = LineView("k", "/runs/trunk")
    line.apply_hello({"epoch": "a", "pid": 1}, 0.0)
    line.apply_status({"state": "training", "trainer_launched": 0.0, "launches": 1, "crashes": 0})
    line.apply_rows([row(update, float(update), 1000.0) for update in range(1, 41)], 0)
    return line


def slow_events(line: LineView) -> list[str]:
    return [event.message for event in line.events if event.kind == "slow"]


def test_the_updates_after_a_relaunch_are_never_judged_slow() -> None:
    line = training_line()
    assert line.refresh_health(41.0) == []
    # The trainer crashes and is relaunched at t=100: it replays from update 36, warming up.
    line.apply_notification("event", {"event": "launched", "time": 100.0, "message": "trainer launched"}, 100.0)
    for update in range(36, 36 + health.SLOW_SKIP_AFTER_START):
        line.add_row(row(update, 100.0 + update, 200.0))
        line.refresh_health(100.0 + update)
    assert slow_events(line) == []
    # Past the warm-up, a rate that stays low is an episode.
    for update in range(56, 56 + health.SLOW_SUSTAIN):
        line.add_row(row(update, 100.0 + update, 200.0))
        line.refresh_health(100.0 + update)
    assert len(slow_events(line)) == 1
    # A supervisor attached later knows the launch from the status poll.
    later = training_line()
    later.apply_status({**later.status, "trainer_launched": 100.0})
    later.add_row(row(41, 101.0, 200.0))
    later.add_row(row(42, 102.0, 200.0))
    later.add_row(row(43, 103.0, 200.0))
    assert later.refresh_health(103.0) == []


def test_a_slow_episode_is_one_flag_until_the_rate_has_recovered() -> None:
    line = training_line()
    update, rings = 41, 0
    # A rate hovering about the threshold: slow, then a little over it, then slow again...
    for rate in [500.0, 500.0, 500.0, 650.0, 500.0, 650.0, 500.0, 500.0, 500.0, 700.0, 500.0]:
        line.add_row(row(update, float(update), rate))
        rings += len([flag for flag in line.refresh_health(float(update)) if flag.kind == "slow"])
        update += 1
    assert rings == 1 and len(slow_events(line)) == 1 and [flag.kind for flag in line.health] == ["slow"]
    # Recovered for three updates in a row: the flag clears; a new slowdown is a new episode.
    for rate in [1000.0, 1000.0, 1000.0]:
        line.add_row(row(update, float(update), rate))
        line.refresh_health(float(update))
        update += 1
    assert line.health == []
    for rate in [400.0, 400.0, 400.0]:
        line.add_row(row(update, float(update), rate))
        line.refresh_health(float(update))
        update += 1
    assert len(slow_events(line)) == 2


def test_heartbeat_alarms_spare_lines_that_ended() -> None:
    assert health.stale_heartbeat("training", 9999.0) is not None  # a live line gone quiet: an alarm
    assert health.stale_heartbeat("training", 9999.0, stage="stopped") is None  # its trainer ended
    for state in ("finished", "stopped", "failed"):
        assert health.stale_heartbeat(state, 9999.0) is None
    # The console never heard the end (it was away as the supervisor exited): the trainer's last
    # heartbeat says it stopped, and an hour later that is still no alarm.
    line = LineView("k", "/runs/trunk")
    line.apply_hello({"epoch": "a", "pid": 1}, 0.0)
    line.apply_status({"state": "training", "heartbeat": {"time": 10.0, "stage": "stopped", "pid": 7}})
    line.mark_disconnected("connection refused", 20.0)
    assert line.refresh_health(3600.0) == []
    # A line read from its files, whose supervisor died while it trained: nothing runs it any more.
    rested = LineView("r", "/runs/old")
    rested.apply_rest({"state": "training", "pid": 99}, {"time": 10.0, "stage": "training", "pid": 98}, [], 3600.0)
    assert rested.refresh_health(3600.0) == [] and rested.orphaned


def test_a_supervisor_that_exits_with_its_line_ended_is_no_warning() -> None:
    """A line stopped on request (or finished) loses its supervisor as it should: the disconnection
    is news, not a warning that `f` keeps and `--bell warning` rings for (it was one after every
    stop). A live line's supervisor lost mid-training still warns."""
    ended = training_line()
    ended.apply_notification("event", {"event": "stopped", "message": "the line stopped: stop requested",
                                       "time": 50.0}, 50.0)
    ended.mark_disconnected("the supervisor closed the connection", 51.0)
    last = ended.events[-1]
    assert (last.kind, last.glyph, last.severity) == ("exited", "○", "info")
    assert last.message == "the supervisor has exited (state stopped): the supervisor closed the connection"
    lost = training_line()
    lost.mark_disconnected("the supervisor closed the connection", 51.0)
    assert (lost.events[-1].severity, lost.events[-1].message) == (
        "warning", "supervisor unreachable: the supervisor closed the connection")


def test_restarts_count_the_crashes_of_every_supervisor_life_not_the_launches() -> None:
    line = LineView("k", "/runs/trunk")
    line.apply_status({"state": "training", "launches": 6, "crashes": 1})  # a rollback, a tune, a resume...
    assert line.restarts == 1


def test_the_bell_rings_for_errors_only_unless_asked_for_more() -> None:
    def scenario_with(bell: frozenset[str] | None) -> list[str]:
        app = console(book=frozen_book())
        if bell is not None:
            app.bell_severities = bell
        rings: list[str] = []

        async def main() -> None:
            async with app.run_test(size=(150, 40)) as pilot:
                await settle(pilot)
                app.bell = lambda: rings.append("ring")  # type: ignore[method-assign]
                line = app.book.get("pssa-trunk-id")
                line.add_row({**line.last_row, "update": 501, "loss": 50.0, "tokens": 501 * 512})  # a spike: warning
                app.refresh_views()
                rings.append("spike")
                failed = {"event": "failed", "time": NOW, "message": "5 failures in a row without progress"}
                line.apply_notification("event", failed, NOW)  # an error
                app.refresh_views()
                app.refresh_views()

        asyncio.run(main())
        return rings

    assert scenario_with(None) == ["spike", "ring"]  # the default: the error alone rings
    assert scenario_with(frozenset({"warning", "error"})) == ["ring", "spike", "ring"]
    assert scenario_with(frozenset()) == ["spike"]


def test_the_bell_option_names_severities_and_refuses_others(capsys: pytest.CaptureFixture[str]) -> None:
    assert bell_severities(None) == {"error"}
    assert bell_severities("error, warning") == {"error", "warning"} and bell_severities("none") == set()
    assert main(["--bell", "loud"]) == SupervisorExitCode.USER_ERROR
    assert capsys.readouterr().err.strip() == (
        "nsconsole: --bell: unknown severity loud; choose from error, warning, info (comma-separated), or none"
    )


def test_the_events_tab_filters_by_severity() -> None:
    app = console()

    async def scenario(pilot) -> None:
        line = app.book.get("tf-baseline-id")  # launched (info), a watchdog restart (warning), a spike (warning)
        line.add_event(NOW, "failed", "5 failures in a row without progress", "error")
        app.open_line("tf-baseline-id")
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, LineScreen)
        screen.query_one("TabbedContent").active = "tab-events"
        await pilot.pause()
        events = screen.query_one(EventList)
        events.focus()
        await pilot.pause()
        severities = [event.severity for event in line.events]
        assert events.row_count == len(severities)
        await pilot.press("f")
        assert events.row_count == severities.count("warning") + severities.count("error") < len(severities)
        assert events.border_subtitle == f"{events.row_count} of {len(severities)} events: warning+"
        await pilot.press("f")
        assert events.row_count == 1
        await pilot.press("f")
        assert events.row_count == len(severities)
        assert "events_severity" in {binding_id for _, binding_id, _, _ in app.key_help(screen)}

    async def main() -> None:
        async with app.run_test(size=(150, 40)) as pilot:
            await settle(pilot)
            await scenario(pilot)

    asyncio.run(main())
