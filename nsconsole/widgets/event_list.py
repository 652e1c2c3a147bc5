"""The events tab: a line's supervisor events, health flags and the console's own notes, newest first.

`f` (binding `events_severity`, while the list has the focus) cycles what it shows: every event,
warnings and errors, errors only; the list's subtitle says which and how many are left out.

A message longer than the list is wide wraps onto more lines of its row: a refusal's reason or a
rollback's outcome is read whole, not cut at the edge.
"""

from __future__ import annotations

import time

from rich.text import Text
from textual.binding import Binding
from textual.widgets import DataTable
from textual.widgets.data_table import ColumnKey

from nsconsole.state import ConsoleEvent, LineView
from nsconsole.widgets import format as fmt

TIME_WIDTH = 19
"""`event_time`'s text: 2026-01-15 09:51:07."""
EVENT_WIDTH = 14
"""The event column: a glyph and a word (`✗ branch start`, the longest); a longer word wraps."""
MIN_MESSAGE_WIDTH = 30
"""The message column is never narrower than this (a narrower list scrolls sideways)."""

SEVERITY_FILTERS: tuple[tuple[str, frozenset[str]], ...] = (
    ("all", frozenset({"info", "warning", "error"})),
    ("warning+", frozenset({"warning", "error"})),
    ("error", frozenset({"error"})),
)
"""What the severity filter cycles through: (its name, the severities shown)."""


def event_time(timestamp: float) -> str:
    """UTC, as run.log writes it."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(timestamp))


class EventList(DataTable):
    """`show(line)` adds the events that arrived since the last call."""

    BINDINGS = [
        Binding("f", "cycle_severity", "Severity", id="events_severity",
                tooltip="events: show all, warnings and errors, or errors only"),
    ]

    def __init__(self, **kwargs: object) -> None:
        super().__init__(cursor_type="row", **kwargs)  # type: ignore[arg-type]
        self._shown: tuple[int, int, list[ConsoleEvent]] | None = None
        """(severity filter, message width, events) as last shown."""
        self._line: LineView | None = None
        self.severity_filter = 0
        """The index in `SEVERITY_FILTERS` of what is shown."""

    def on_mount(self) -> None:
        self.add_column("time (UTC)", key="time", width=TIME_WIDTH)
        self.add_column("event", key="event", width=EVENT_WIDTH)
        self.add_column("what happened", key="message", width=self._message_width())

    def on_resize(self) -> None:
        # The messages wrap at the width they were added with: laid out again at the new one.
        if self._line is not None:
            self.show(self._line)

    def _message_width(self) -> int:
        """The message column's width: what the time and event columns leave of the list (each
        column has its padding on both sides), less a vertical scrollbar whether shown or not (tall
        rows bring one, and the width must not move with it)."""
        room = (self.content_region.width - self.styles.scrollbar_size_vertical - TIME_WIDTH - EVENT_WIDTH
                - 6 * self.cell_padding)
        return max(MIN_MESSAGE_WIDTH, room)

    def action_cycle_severity(self) -> None:
        self.severity_filter = (self.severity_filter + 1) % len(SEVERITY_FILTERS)
        if self._line is not None:
            self.show(self._line)

    def show(self, line: LineView) -> None:
        self._line = line
        events = list(line.events)
        width = self._message_width()
        if self._shown == (self.severity_filter, width, events):
            return
        self._shown = (self.severity_filter, width, events)
        name, severities = SEVERITY_FILTERS[self.severity_filter]
        shown = [event for event in events if event.severity in severities]
        theme = self.app.current_theme
        self.clear()
        self.columns[ColumnKey("message")].width = width
        # Newest first by when they happened (a replayed backlog arrives after newer events); a
        # row as tall as its message needs.
        for event in sorted(shown, key=lambda event: event.time, reverse=True):
            style = fmt.severity_style(theme, event.severity)
            self.add_row(
                # The message as Text: a plain string would be read as markup, and a reason may hold brackets.
                event_time(event.time), Text(f"{event.glyph} {event.word}", style=style), Text(event.message),
                height=None,
            )
        if not events:
            self.border_subtitle = "no events yet"
        elif self.severity_filter == 0:
            self.border_subtitle = f"{len(events)} events"
        else:
            self.border_subtitle = f"{len(shown)} of {len(events)} events: {name}"
