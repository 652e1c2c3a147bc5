"""A console left open for days: visiting a line's screen and redrawing the footers keeps no widgets.

Textual lists every watcher of a reactive on the watched object and forgets a closed widget's only
when that reactive changes: each line screen's header stayed on the app (its title never changes),
each footer redraw left its old keys on the footer (its `compact` never changes), about 0.6 MiB a
visit (`nsconsole/widgets/closed_watchers.py`). A real console (Pilot), its line screen opened and
closed again and again: what the app and the footers hold does not grow with the visits.
"""

from __future__ import annotations

import asyncio

from helpers.console import console, settle, until
from textual.widgets._footer import FooterKey

from nsconsole.screens.line import LineScreen
from nsconsole.screens.lines import LinesScreen
from nsconsole.widgets.closed_watchers import WATCHERS_ATTRIBUTE
from nsconsole.widgets.keys_footer import KeysFooter

VISITS = 3


def watchers(obj: object, reactive: str) -> int:
    """How many watchers of `obj`'s `reactive` Textual holds."""
    return len(getattr(obj, WATCHERS_ATTRIBUTE, {}).get(reactive, []))


def test_visits_of_a_line_screen_leave_no_headers_or_footer_keys_behind() -> None:
    app = console()
    seen: dict[str, int] = {}

    async def main() -> None:
        async with app.run_test(size=(150, 40)) as pilot:
            await settle(pilot)
            for _ in range(VISITS):
                await pilot.press("enter")
                line_screen = await until(pilot, lambda: isinstance(app.screen, LineScreen) and app.screen, "a line")
                for key in ("2", "5", "1"):  # tabs shown: the focus moves, its footer is redrawn
                    await pilot.press(key)
                await pilot.pause()
                seen["line footer"] = max(seen.get("line footer", 0), watchers(line_screen.query_one(KeysFooter),
                                                                                "compact"))
                await pilot.press("escape")
                await until(pilot, lambda: isinstance(app.screen, LinesScreen), "the lines screen")
                await pilot.pause()
            footer = app.screen.query_one(KeysFooter)
            seen["lines footer"] = watchers(footer, "compact")
            seen["lines footer keys"] = len(footer.query(FooterKey))
            seen["app title"] = watchers(app, "title")

    asyncio.run(main())
    # Before: the app held one more header after every visit, each footer about twenty more keys
    # at every redraw (each visit redraws the lines screen's footer when it shows again).
    assert seen["app title"] == 1  # the lines screen's own header
    assert seen["lines footer"] <= seen["lines footer keys"]
    assert seen["line footer"] <= 2 * seen["lines footer keys"]
