"""The events tab: a line's supervisor events, health flags and the console's own notes, newest first.

`f` (binding `events_severity`, while the list has the focus) cycles what it shows: every event,
warnings and errors, errors only; the list's subtitle says which and how many are left out.
"""

from __future__ import annotations

import time

from rich.text import Text
from textual.binding import Binding
from textual.widgets import DataTable

from nsconsole.state import ConsoleEvent, LineView
from nsconsole.widgets import format as fmt

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
        self._shown: tuple[int, list[ConsoleEvent]] | None = None
        self._line: LineView | None = None
        self.severity_filter = 0
        """The index in `SEVERITY_FILTERS` of what is shown."""

    def on_mount(self) -> None:
        self.add_column("time (UTC)", key="time")
        self.add_column("event", key="event")
        self.add_column("what happened", key="message")

    def action_cycle_severity(self) -> None:
        self.severity_filter = (self.severity_filter + 1) % len(SEVERITY_FILTERS)
        if self._line is not None:
            self.show(self._line)

    def show(self, line: LineView) -> None:
        self._line = line
        events = list(line.events)
        if self._shown == (self.severity_filter, events):
            return
        self._shown = (self.severity_filter, events)
        name, severities = SEVERITY_FILTERS[self.severity_filter]
        shown = [event for event in events if event.severity in severities]
        theme = self.app.current_theme
        self.clear()
        # Newest first by when they happened (a replayed backlog arrives after newer events).
        for event in sorted(shown, key=lambda event: event.time, reverse=True):
            style = fmt.severity_style(theme, event.severity)
            self.add_row(
                event_time(event.time), Text(f"{event.glyph} {event.word}", style=style), event.message
            )
        if not events:
            self.border_subtitle = "no events yet"
        elif self.severity_filter == 0:
            self.border_subtitle = f"{len(events)} events"
        else:
            self.border_subtitle = f"{len(shown)} of {len(events)} events: {name}"
