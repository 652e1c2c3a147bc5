"""The lines table repaints only the rows whose cells changed (frozen data, Pilot).

DataTable's own `update_cell` repaints every row for one changed cell; eight lines logging made
that most of the console's CPU. These tests count the screen lines the table renders after a change.
"""

from __future__ import annotations

import asyncio

from helpers.console import console, settle
from rich.cells import cell_len

from nsconsole.app import ConsoleApp
from nsconsole.widgets.lines_table import LinesTable


def run(app: ConsoleApp, scenario) -> None:
    async def main() -> None:
        async with app.run_test(size=(150, 40)) as pilot:
            await settle(pilot)
            await pilot.pause()
            await scenario(pilot)

    asyncio.run(main())


def count_rendered_lines(table: LinesTable) -> list[int]:
    """The table's content lines (y, on screen) rendered from now on, in order."""
    rendered: list[int] = []
    render_line = table.render_line

    def counting(y: int):
        rendered.append(y)
        return render_line(y)

    table.render_line = counting  # type: ignore[method-assign]
    return rendered


def cells_under(table: LinesTable, heading: str, y: int) -> str:
    """What line `y` shows under the header's `heading` (cells, not characters: `⚡` takes two)."""
    header = table.render_line(0).text
    x = cell_len(header[: header.index(heading)])
    return table.render_line(y).crop(x, x + len(heading)).text


def screen_line_of(table: LinesTable, key: str) -> int:
    """The content line (y) a row is drawn on: under the header."""
    return table.header_height + table.get_row_index(key) - table.scroll_offset.y


def test_one_changed_cell_repaints_its_row_alone() -> None:
    app = console()

    async def scenario(pilot) -> None:
        table = app.screen.query_one(LinesTable)
        rendered = count_rendered_lines(table)
        line = app.book.get("tf-baseline-id")
        line.apply_status({**line.status, "crashes": 7})  # same width as the 2 it had
        app.refresh_views()
        await pilot.pause()
        row_y = screen_line_of(table, line.key)
        assert set(rendered) == {row_y}, rendered
        assert cells_under(table, "restarts", row_y).strip() == "7"
        rendered.clear()
        app.refresh_views()  # nothing changed: nothing repainted
        await pilot.pause()
        assert rendered == []

    run(app, scenario)


def test_a_cell_that_widens_its_column_lays_every_row_out_anew() -> None:
    app = console()

    async def scenario(pilot) -> None:
        table = app.screen.query_one(LinesTable)
        line = app.book.get("tf-baseline-id")
        before = table.columns["restarts"].content_width
        rendered = count_rendered_lines(table)
        line.apply_status({**line.status, "crashes": 123456789012})
        app.refresh_views()
        await pilot.pause()
        assert table.columns["restarts"].content_width == len("123456789012") > before
        rows = {screen_line_of(table, key) for key in table.rows}
        assert rows <= set(rendered)  # every row, in the wider column
        for key in table.rows:  # the columns right of it moved right on every row, under their headings
            assert cells_under(table, "GPU", screen_line_of(table, key)).startswith(table.get_cell(key, "gpu").plain[:3])

    run(app, scenario)
