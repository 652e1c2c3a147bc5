"""The console stays quiet while it watches (issue 20 item 9, bench/console_cpu.py): work is done
once per change, not once per tick, and a repaint is asked for only when something shows differently.

The health checks of the rows run once per new rows and find what a full check finds; a text set
again repaints nothing and lays nothing out unless its height moved; the lines table repaints a
row's progress at most every PROGRESS_REPAINT_S; the curves redraw for new rows at most every ROWS_REDRAW_S;
a pushed row turns no key on or off; the progress line ticks only while a request waits.
"""

from __future__ import annotations

import asyncio

import pytest
from helpers.console import NOW, console, settle, until
from rich.text import Text
from textual.app import App, ComposeResult

from nsconsole import health
from nsconsole.state import LineFacts, LineView
from nsconsole.widgets import curves_tab, lines_table, request_progress
from nsconsole.widgets.curves import CurvePlot
from nsconsole.widgets.curves_tab import CurvesTab, RedrawPacer
from nsconsole.widgets.lines_table import PROGRESS_REPAINT_S, LinesTable
from nsconsole.widgets.quiet_static import QuietStatic, text_height, text_key
from nsconsole.widgets.request_progress import PendingRequest

# ---- the row checks run once per new rows, and find what a full check finds ---------------------


def recorded_history() -> list[tuple[str, object]]:
    """A line's life as (what, payload) steps, a tick after each: steady rows, a loss spike, a
    slowdown long enough to flag, a recovery, a skipped update, a relaunch (the slow check skips its
    warm-up), an lr off its schedule once run.json's facts come; and ticks with nothing new."""
    steps: list[tuple[str, object]] = []
    tokens_per_s = [1000.0] * 30 + [400.0] * 6 + [1000.0] * 6 + [300.0] * 30
    for update, rate in enumerate(tokens_per_s, start=1):
        row = {"update": update, "tokens": update * 512, "tokens_per_update": 512, "lr": 1e-3, "grad_norm": 1.0,
               "loss": 9.0 if update == 20 else 3.0, "tokens_per_s": rate, "time": float(update),
               "skipped": update == 45}
        steps.append(("row", row))
        if update % 3 == 0:
            steps.append(("tick", None))  # a tick with no new row
        if update == 50:
            steps.append(("launched", 50.5))
        if update == 60:
            steps.append(("facts", LineFacts(schedule=lambda tokens: 2e-3)))
    return steps


def replay(steps: list[tuple[str, object]], full_check_every_tick: bool) -> list[list[str]]:
    """The labels of the line's flags after each step's tick, and (last) its events' messages."""
    line = LineView("k", "/runs/trunk")
    line.apply_hello({"epoch": "a", "pid": 1}, 0.0)
    line.apply_status({"state": "training", "trainer_launched": 0.0})
    seen = []
    for what, payload in steps:
        if what == "row":
            line.add_row(payload)  # type: ignore[arg-type]
        elif what == "launched":
            line.apply_notification("event", {"event": "launched", "time": payload, "message": "launched"}, 50.5)
        elif what == "facts":
            line.facts = payload  # type: ignore[assignment]
        if full_check_every_tick:
            line._row_checks = None  # what refresh_health did before it kept the row checks' result
        line.refresh_health(100.0)
        seen.append([flag.label for flag in line.health])
    return [*seen, [event.message for event in line.events]]


def test_the_row_checks_kept_between_new_rows_raise_what_a_full_check_of_each_tick_raises() -> None:
    steps = recorded_history()
    kept, full = replay(steps, full_check_every_tick=False), replay(steps, full_check_every_tick=True)
    assert kept == full
    raised = {label for labels in kept[:-1] for label in labels}
    assert raised == {"▲ spike", "▼ slow", "✗ skipped", "≠ lr"}  # the history exercises every row check


def test_rows_pushed_between_two_ticks_are_judged_once(monkeypatch: pytest.MonkeyPatch) -> None:
    judged = []
    original = health.loss_spike
    monkeypatch.setattr(health, "loss_spike", lambda losses: judged.append(len(losses)) or original(losses))
    line = LineView("k", "/runs/trunk")
    for update in range(1, 6):
        line.add_row({"update": update, "loss": 3.0, "tokens_per_s": 1000.0, "time": float(update)})
    line.refresh_health(10.0)
    line.refresh_health(10.5)  # nothing new
    line.refresh_health(11.0)
    assert len(judged) == 1
    line.add_row({"update": 6, "loss": 3.0, "tokens_per_s": 1000.0, "time": 6.0})
    line.refresh_health(11.5)
    assert len(judged) == 2


# ---- a text set again repaints nothing; a text of the same height lays nothing out -----------------


class OneText(App[None]):
    def compose(self) -> ComposeResult:
        yield QuietStatic(id="text")


def test_a_quiet_static_repaints_only_new_text_and_lays_out_only_a_new_height(monkeypatch: pytest.MonkeyPatch) -> None:
    updates: list[bool] = []
    original = QuietStatic.update

    def recording(self: QuietStatic, content: object = "", *, layout: bool = True) -> None:
        updates.append(layout)
        original(self, content, layout=layout)  # type: ignore[arg-type]

    monkeypatch.setattr(QuietStatic, "update", recording)

    async def main() -> None:
        app = OneText()
        async with app.run_test(size=(60, 10)) as pilot:
            box = app.query_one(QuietStatic)
            await pilot.pause()
            box.show_text(Text("update 1\nloss 3.0"))
            box.show_text(Text("update 1\nloss 3.0"))  # the same: nothing
            box.show_text(Text("update 2\nloss 2.9"))  # two lines again: repainted in place
            box.show_text(Text("update 2\nloss 2.9", style="dim"))  # the same words, another look
            box.show_text(Text("update 3\nloss 2.8\n▲ spike"))  # a line more: laid out
            box.show_text(Text("x" * 80))  # wider than the box: it wraps, laid out
            await pilot.pause()
            assert str(box.render()) == "x" * 80

    asyncio.run(main())
    assert updates == [True, False, False, True, True]


def test_text_keys_and_heights() -> None:
    assert text_key(Text("a", style="bold")) != text_key(Text("a", style="dim"))  # rich's == says equal
    assert text_key(Text("a")) == text_key(Text("a"))
    assert text_height(Text("ab\ncd"), 2) == 2
    assert text_height(Text("abc"), 2) is None


# ---- the lines table: progress at most every PROGRESS_REPAINT_S, anything else at once -------------


def test_a_rows_progress_is_repainted_every_other_second_at_most_and_its_state_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(lines_table, "monotonic", lambda: clock[0])
    app = console()

    async def scenario(pilot) -> None:
        table = app.screen.query_one(LinesTable)
        line = app.book.get("pssa-trunk-id")
        assert line is not None

        def push(update: int) -> None:
            line.add_row({**line.last_row, "update": update, "tokens": update * 512, "loss": 2.0 + update / 1000})

        def shown_update() -> str:
            return table.get_cell(line.key, "update").plain

        push(501)
        app.refresh_views()
        await pilot.pause()
        assert shown_update() == "501"  # the first change since it was drawn: at once
        clock[0] += PROGRESS_REPAINT_S / 2
        push(502)
        app.refresh_views()
        await pilot.pause()
        assert shown_update() == "501"  # progress alone, just painted: later
        line.apply_status({**line.status, "crashes": 9})
        app.refresh_views()
        await pilot.pause()
        assert shown_update() == "502" and table.get_cell(line.key, "restarts").plain == "9"  # not progress: at once
        clock[0] += PROGRESS_REPAINT_S / 2
        push(503)
        app.refresh_views()
        await pilot.pause()
        assert shown_update() == "502"
        clock[0] += PROGRESS_REPAINT_S
        app.refresh_views()  # no new row, but the one held back is due
        await pilot.pause()
        assert shown_update() == "503"

    async def main() -> None:
        async with app.run_test(size=(150, 40)) as pilot:
            await settle(pilot)
            await scenario(pilot)

    asyncio.run(main())


# ---- the curves: new rows redraw at most every ROWS_REDRAW_S, keys at once --------------------------


def test_the_pacer_waits_longer_after_a_dear_redraw() -> None:
    pacer = RedrawPacer(every_s=2.0, cpu_share=0.02)
    assert pacer.due(0.0)
    pacer.drew(10.0, render_cost_s=0.01)  # 0.01 / 0.02 = 0.5 s: the floor of 2 s holds
    assert not pacer.due(11.9) and pacer.due(12.0)
    pacer.drew(20.0, render_cost_s=0.2)  # 10 s of a core's 2 %
    assert not pacer.due(29.9) and pacer.due(30.0)


def test_new_rows_redraw_the_curves_when_the_pacer_says_and_a_key_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(curves_tab, "monotonic", lambda: clock[0])
    app = console()

    async def main() -> None:
        async with app.run_test(size=(150, 40)) as pilot:
            await settle(pilot)
            await pilot.press("enter")
            await pilot.pause()
            tab = app.screen.query_one(CurvesTab)
            line = tab.line
            loss = next(plot for plot in app.screen.query(CurvePlot) if plot.column == "loss")

            def drawn_rows() -> int:
                assert loss.frame is not None
                return len(loss.frame.line.xs)

            first = drawn_rows()
            line.add_row({**line.last_row, "update": line.last_row["update"] + 1})
            clock[0] += tab.pacer.every_s / 2
            app.refresh_views()
            assert drawn_rows() == first  # too soon after the last redraw
            await pilot.press("l")  # a key: redrawn at once, new row and all
            assert drawn_rows() == first + 1 and tab.settings.log_y
            line.add_row({**line.last_row, "update": line.last_row["update"] + 1})
            clock[0] += tab.pacer.every_s
            app.refresh_views()
            assert drawn_rows() == first + 2

    asyncio.run(main())


# ---- a pushed row turns no key on or off; the progress line ticks only while a request waits -------


def test_a_pushed_row_refreshes_no_bindings(monkeypatch: pytest.MonkeyPatch) -> None:
    app = console()
    refreshes = []
    monkeypatch.setattr(app, "refresh_bindings", lambda: refreshes.append(1))
    line = app.book.get("pssa-trunk-id")
    assert line is not None
    app._line_changed(line)  # the first word of a line that answers: its keys come on
    refreshes.clear()
    line.add_row({**line.last_row, "update": 501})
    app._line_changed(line)
    assert refreshes == []
    line.mark_disconnected("gone", NOW)
    app._line_changed(line)  # it can no longer be changed: the keys are
    assert refreshes == [1]


def test_the_progress_line_ticks_only_while_a_request_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(request_progress, "TICK_S", 0.05)
    drawn = []
    original = request_progress.progress_text
    monkeypatch.setattr(request_progress, "progress_text", lambda *args: drawn.append(1) or original(*args))
    app = console()

    async def main() -> None:
        async with app.run_test(size=(150, 40)) as pilot:
            await settle(pilot)
            drawn.clear()
            await pilot.pause(0.3)
            assert drawn == []  # nothing waits: no tick
            app.pending.append(PendingRequest("pssa-trunk-id", "pssa-trunk", "tune", NOW))
            app.refresh_progress()
            # The waiting time is redrawn while it waits (ticks of 0.05 s; a loaded machine gives fewer a second).
            await until(pilot, lambda: len(drawn) > 2, "the progress line's ticks", 30)
            app.pending.clear()
            app.refresh_progress()
            await pilot.pause(0.1)
            drawn.clear()
            await pilot.pause(0.3)
            assert drawn == []

    asyncio.run(main())
