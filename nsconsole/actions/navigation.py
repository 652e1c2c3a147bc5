"""The screens the keys act on: a line's screen opened, the line under the cursor.

A mixin of `nsconsole.app.ConsoleApp`, sharing its state: it uses `book` (every line shown) and
Textual's `screen`, `screen_stack` and `push_screen`.
"""

from __future__ import annotations

from textual.command import CommandPalette

from nsconsole.screens.line import LineScreen
from nsconsole.screens.lines import LinesScreen
from nsconsole.state import LineView


class Navigation:
    """Which screen and line the keys act on (mixed into `ConsoleApp`, whose screens it reads)."""

    def open_line(self, key: str) -> None:
        line = self.book.get(key)
        if line is not None:
            self.push_screen(LineScreen(line))

    def line_screen(self) -> LinesScreen | LineScreen | None:
        """The screen whose line the keys act on: the one shown, or the one the command palette is over."""
        screen = self.screen
        if isinstance(screen, CommandPalette) and len(self.screen_stack) > 1:
            screen = self.screen_stack[-2]
        return screen if isinstance(screen, (LinesScreen, LineScreen)) else None

    def selected_line(self) -> LineView | None:
        screen = self.line_screen()
        key = None if screen is None else screen.selected_line_key()
        return None if key is None else self.book.get(key)
