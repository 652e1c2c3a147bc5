"""The screen under a dialog keeps watching: a question (help, a confirmation, the command palette)
lies over the lines table or a line's screen, which stays in sight, and its numbers go on moving
while the question waits (found in the degree-2 walkthrough: the screen seemed frozen)."""

from __future__ import annotations

import asyncio

from helpers.console import console, settle

from nsconsole.screens.help import HelpScreen
from nsconsole.screens.line import LineScreen
from nsconsole.widgets.lines_table import LinesTable


def test_the_lines_table_and_a_line_screen_update_under_a_dialog() -> None:
    app = console()

    async def main() -> None:
        async with app.run_test(size=(150, 40)) as pilot:
            await settle(pilot)
            table = app.screen.query_one(LinesTable)
            line = app.book.get("pssa-trunk-id")
            assert line is not None

            def push() -> int:
                update = int(line.last_row["update"]) + 1
                line.add_row({**line.last_row, "update": update, "tokens": update * 512})
                return update

            await pilot.press("question_mark")
            assert isinstance(app.screen, HelpScreen)
            update = push()
            app.refresh_views()
            await pilot.pause()
            assert table.get_cell(line.key, "update").plain == str(update)
            await pilot.press("escape")

            app.open_line(line.key)
            await pilot.pause()
            line_screen = app.screen
            assert isinstance(line_screen, LineScreen)
            seen: list[float] = []
            original = line_screen.refresh_view
            line_screen.refresh_view = lambda now: (seen.append(now), original(now))  # type: ignore[method-assign]
            await pilot.press("question_mark")
            assert isinstance(app.screen, HelpScreen)
            app.refresh_views()
            await pilot.pause()
            assert seen, "the line's screen under the help was not refreshed"

    asyncio.run(main())
