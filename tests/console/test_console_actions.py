"""The console's actions as a user meets them (issue 20 items 4-6), on frozen data with Pilot: the
cursor keeps its line through the filter, the command palette offers what the keys do, a key that
is off says why, progress shows until the supervisor's reply, narrow terminals keep the important
columns and reach every field of the dialogs."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from helpers.console import NOW, book_of, console, frozen_book, rows_of, settle
from textual.command import CommandList, CommandPalette
from textual.widgets import Button, Input

from nsconsole.app import ConsoleApp
from nsconsole.screens.branch_form import BranchForm
from nsconsole.screens.confirm import ConfirmScreen
from nsconsole.screens.line import LineScreen
from nsconsole.screens.picker import PickerScreen
from nsconsole.state import LineFacts, LineView
from nsconsole.widgets.lines_table import COLUMNS, LinesTable
from nsconsole.widgets.request_progress import RequestProgress


def run(app: ConsoleApp, scenario: Callable[..., Awaitable[None]], size: tuple[int, int] = (150, 40)) -> None:
    async def main() -> None:
        async with app.run_test(size=size) as pilot:
            await settle(pilot)
            await scenario(pilot)

    asyncio.run(main())


def training_line(path: str, parent: str | None = None) -> LineView:
    line = LineView(f"{path}-id", path, LineFacts(preset="ns-tiny"))
    line.apply_hello({"epoch": "e", "pid": 1}, NOW - 60)
    line.apply_status({"state": "training", "trainer_pid": 2, "launches": 1, "parent": parent,
                       "heartbeat": {"time": NOW - 1, "update": 40, "stage": "training"}})
    line.apply_rows(rows_of(40, 3.0, 1.0), 0)
    return line


class HeldLive:
    """The console's link to the supervisors, answering every mutation only when the test says so."""

    problem = None  # discovery works

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, dict]] = []
        self.answer = asyncio.Event()

    async def mutate(self, key: str, method: str, **params: object) -> dict:
        self.sent.append((key, method, params))
        await self.answer.wait()
        return {"done": method}


def noted(app: ConsoleApp) -> list[str]:
    """Every toast the app shows from now on."""
    messages: list[str] = []
    app.notify = lambda message, **_: messages.append(str(message))  # type: ignore[method-assign]
    return messages


def test_the_cursor_keeps_its_line_through_the_filter_and_the_keys_act_on_it() -> None:
    book = book_of(*(training_line(f"/srv/lines/{name}") for name in ("run-1", "exp-2", "run-3")))
    app = console(book=book)
    live = HeldLive()

    async def scenario(pilot) -> None:
        app.live = live
        table = app.screen.query_one(LinesTable)
        await pilot.press("down")
        assert table.selected_key == "/srv/lines/run-1-id"  # rows by path: exp-2, run-1, run-3
        # exp-2, above the cursor, is filtered away: the cursor stays on run-1 (by row index it was run-3).
        await pilot.press("slash", *"run-", "enter")
        assert table.row_count == 2 and table.selected_key == "/srv/lines/run-1-id"
        assert table.border_title == "lines · ▸ /srv/lines/run-1"  # what the keys act on
        await pilot.press("escape")  # the filter cleared: every line back, in its place, the cursor on run-1
        assert [row.key.value for row in table.ordered_rows] == [f"/srv/lines/{n}-id" for n in ("exp-2", "run-1", "run-3")]
        assert table.selected_key == "/srv/lines/run-1-id"
        await pilot.press("s", "enter")
        confirm = app.screen
        assert isinstance(confirm, ConfirmScreen)
        assert confirm.question == "Stop /srv/lines/run-1 at the next update?"  # the full path
        await pilot.press("y")
        await pilot.pause()
        assert live.sent == [("/srv/lines/run-1-id", "stop", {"at_cycle_end": None})]

    run(app, scenario)


def test_lines_that_share_a_name_are_told_apart_and_a_branch_names_its_parent() -> None:
    book = book_of(training_line("/srv/a/trunk"), training_line("/srv/b/trunk"),
                   training_line("/srv/b/trunk-c1", parent="/srv/b/trunk"))
    app = console(book=book)
    toasts = noted(app)

    async def scenario(pilot) -> None:
        table = app.screen.query_one(LinesTable)
        app.refresh_views()
        assert str(table.get_cell("/srv/a/trunk-id", "line")) == "⚠ /srv/a/trunk"
        assert str(table.get_cell("/srv/b/trunk-id", "line")) == "⚠ /srv/b/trunk"
        assert str(table.get_cell("/srv/b/trunk-c1-id", "line")) == "trunk-c1"
        assert str(table.get_cell("/srv/b/trunk-c1-id", "kind")) == "branch of trunk"
        await pilot.press("down", "down")
        assert table.border_title == "lines · ▸ /srv/b/trunk-c1 · branch of /srv/b/trunk"
        assert toasts == ["⚠ 2 lines are named trunk: /srv/a/trunk, /srv/b/trunk"]
        app.refresh_views()
        assert len(toasts) == 1  # said once

    run(app, scenario)


def test_the_command_palette_offers_the_mutating_actions_of_the_line_under_it() -> None:
    app = console(book=book_of(training_line("/srv/runs/trunk")))

    async def scenario(pilot) -> None:
        app.live = HeldLive()
        app.refresh_bindings()
        await pilot.press("ctrl+p")
        assert isinstance(app.screen, CommandPalette)
        offered: set[str] = set()
        for query in ("Stop", "Branch", "Rollback", "Tune"):
            app.screen.query_one(Input).value = query
            await pilot.pause(0.5)
            commands = app.screen.query_one(CommandList)
            offered |= {str(commands.get_option_at_index(i).prompt).split("\n")[0] for i in range(commands.option_count)}
        assert {"Stop (s)", "Branch (b)", "Rollback (r)", "Tune (t)"} <= offered
        app.screen.query_one(Input).value = "Tune"
        await pilot.pause(0.5)
        await pilot.press("enter")
        await pilot.pause(0.3)
        assert isinstance(app.screen, PickerScreen) and app.screen.question.startswith("Tune trunk")

    run(app, scenario)


def test_a_key_that_is_off_says_why() -> None:
    ended = training_line("/srv/runs/ended")
    ended.apply_notification("event", {"event": "finished", "message": "done", "time": NOW}, NOW)
    ended.mark_disconnected("the supervisor closed the connection", NOW)
    app = console(book=book_of(ended, training_line("/srv/runs/lost")))
    toasts = noted(app)

    async def scenario(pilot) -> None:
        await pilot.press("s")
        assert toasts == ["Stop: this console is not attached to any supervisor"]
        app.live = HeldLive()
        await pilot.press("b")
        assert toasts[-1] == "Branch: /srv/runs/ended has ended (finished); its supervisor has exited"
        app.book.get("/srv/runs/lost-id").mark_disconnected("no supervisor answers (Connection refused)", NOW)
        await pilot.press("down", "t")
        assert toasts[-1] == ("Tune: /srv/runs/lost: its supervisor is not attached "
                              "(no supervisor answers (Connection refused))")
        assert isinstance(app.screen.query_one(LinesTable), LinesTable)  # no dialog opened

    run(app, scenario)
    readonly = ConsoleApp(readonly=True, book=book_of(training_line("/srv/runs/x")), attach=False, clock=lambda: NOW)
    readonly_toasts = noted(readonly)

    async def readonly_scenario(pilot) -> None:
        await pilot.press("r")
        assert readonly_toasts == ["Rollback: the console is read-only (--readonly)"]

    run(readonly, readonly_scenario)


def test_a_request_shows_progress_until_its_reply_and_is_not_sent_twice() -> None:
    app = console(book=book_of(training_line("/srv/runs/trunk")))
    live = HeldLive()
    toasts = noted(app)

    async def scenario(pilot) -> None:
        app.live = live
        progress = app.screen.query_one(RequestProgress)
        assert not progress.display or not progress.has_class("waiting")
        await pilot.press("t", "enter", "y")
        await pilot.pause(0.2)
        assert live.sent == [("/srv/runs/trunk-id", "tune", {"shared": False})]
        assert progress.has_class("waiting") and progress.region.height == 1
        assert "⏳ tune trunk: waiting for the supervisor…" in str(progress.render())
        # The line's own screen shows it too; pressed again meanwhile, `t` says why it is off.
        await pilot.press("enter")
        assert isinstance(app.screen, LineScreen)
        assert app.screen.query_one(RequestProgress).has_class("waiting")
        await pilot.press("t")
        assert toasts[-1] == "Tune: a tune of /srv/runs/trunk is still waiting for the supervisor's reply"
        live.answer.set()
        await pilot.pause(0.2)
        assert not app.screen.query_one(RequestProgress).has_class("waiting")
        assert toasts[-1].startswith("✓ trunk: tune accepted: ")  # and what the reply says

    run(app, scenario)


def test_pause_shows_on_the_line_screen_too() -> None:
    app = console()

    async def scenario(pilot) -> None:
        await pilot.press("enter")
        screen = app.screen
        assert isinstance(screen, LineScreen) and screen.sub_title == "ns-probe"
        await pilot.press("p")
        assert screen.sub_title == "ns-probe · ⏸ refresh paused"
        await pilot.press("p")
        assert screen.sub_title == "ns-probe"

    run(app, scenario)


@pytest.mark.parametrize("size", [(80, 24), (100, 30)])
def test_a_narrow_terminal_keeps_the_important_columns(size: tuple[int, int]) -> None:
    app = console(book=frozen_book())

    async def scenario(pilot) -> None:
        table = app.screen.query_one(LinesTable)
        shown = table.shown_columns
        assert {"line", "state", "health", "beat", "loss", "update"} <= set(shown), shown
        assert len(shown) < len(COLUMNS)
        width = sum(column.get_render_width(table) for column in table.columns.values())
        assert width <= table.scrollable_content_region.width  # nothing past the right edge

    run(app, scenario, size)


def test_a_wide_terminal_shows_every_column() -> None:
    app = console(book=frozen_book())

    async def scenario(pilot) -> None:
        assert len(app.screen.query_one(LinesTable).shown_columns) == len(COLUMNS)

    run(app, scenario, (150, 40))


@pytest.mark.parametrize("size", [(80, 24), (100, 30)])
def test_the_branch_form_fits_a_small_terminal(size: tuple[int, int]) -> None:
    app = console(book=book_of(training_line("/srv/runs/trunk")))

    async def scenario(pilot) -> None:
        app.live = HeldLive()
        await pilot.press("b")
        form = app.screen
        assert isinstance(form, BranchForm)
        for widget in [*form.query(Input), *form.query(Button)]:
            assert form.region.contains_region(widget.region), (widget.id, widget.region)
            assert widget.region.height > 0

    run(app, scenario, size)


def test_queued_and_failed_forks_show_on_the_trunk_s_row() -> None:
    trunk = training_line("/lines/trunk")
    trunk.apply_status({**trunk.status, "queued_forks": [{"path": "/lines/b1", "at_cycle": 2}],
                        "failed_forks": [{"path": "/lines/b2", "at_cycle": 1, "reason": "no held-out rows"}]})
    app = console(book=book_of(trunk, training_line("/lines/other")))

    async def scenario(pilot) -> None:
        table = app.screen.query_one(LinesTable)
        assert "forks" in table.shown_columns
        cell = table.get_cell(trunk.key, "forks")
        assert cell.plain == "✗ b2@1 ⑂ b1@2"
        assert table.get_cell("/lines/other-id", "forks").plain == "—"

    run(app, scenario)


def test_a_fresh_heartbeat_does_not_redraw_its_row_every_second() -> None:
    line = training_line("/lines/trunk")
    app = console(book=book_of(line))

    async def scenario(pilot) -> None:
        table = app.screen.query_one(LinesTable)
        assert table.get_cell(line.key, "beat").plain == "● fresh"
        written = table.cells_written
        for second in (1, 2, 3):  # the heartbeat ages, still fresh: nothing to redraw
            table.show([line], NOW + second)
        assert table.cells_written == written
        table.show([line], NOW + 120)  # late: its age shows
        assert table.get_cell(line.key, "beat").plain == "◐ 2m"

    run(app, scenario)
