"""A Static for text that a tick sets again and again: it repaints only when the text changed, and
lays the screen out only when its height did.

Textual repaints a Static on every `update`, even with the same text, and lays out the whole screen
(every widget placed and repainted) unless told the size stays: with a line's header set twice a
second that was most of the console's CPU on a line's screen (bench/console_cpu.py). A text whose
every line fits the width takes one screen row per line, so the same number of lines is the same
height; one that wraps is laid out as Static always does. Its text has no links, so Textual is
told not to look for them (it unpacks every segment's metadata at every repaint to find one).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from rich.cells import cell_len
from rich.console import RenderableType
from rich.text import Text
from textual.widgets import Static


def text_key(text: Text) -> tuple[Any, ...]:
    """What makes two Texts look the same (rich's `Text.__eq__` leaves out the base style)."""
    return text.plain, tuple(text.spans), str(text.style), text.justify, text.overflow, text.no_wrap, text.end


def text_height(text: Text, width: int) -> int | None:
    """The rows `text` takes `width` cells wide; None when a line is wider (it wraps: only a layout tells)."""
    lines = text.plain.split("\n")
    if any(cell_len(line) > width for line in lines):
        return None
    return len(lines)


class QuietStatic(Static):
    """See the module docstring: `show_text(text)`, or `show_content(content, key, height)` for other renderables."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.auto_links = False  # no links in it: Textual would look for some in every rendered segment
        self._shown_key: Hashable | None = None
        self._shown_shape: tuple[int, int] | None = None
        """(rows, width) of what shows: a text of as many rows at the same width keeps the layout."""

    def show_text(self, text: Text) -> None:
        self.show_content(text, text_key(text), text_height(text, self.content_size.width))

    def show_content(self, content: RenderableType, key: Hashable, height: int | None) -> None:
        """Show `content` unless what shows now has the same `key`; `height`: the rows it takes at the
        present width (None: unknown, the screen is laid out)."""
        if key == self._shown_key:
            return
        shape = None if height is None else (height, self.content_size.width)
        same_shape = shape is not None and shape == self._shown_shape
        self._shown_key, self._shown_shape = key, shape
        self.update(content, layout=not same_shape)
