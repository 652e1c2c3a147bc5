"""The events tab: a line's supervisor events, health flags and the console's own notes, newest first."""

from __future__ import annotations

import time

from rich.text import Text
from textual.widgets import DataTable

from nsconsole.state import ConsoleEvent, LineView
from nsconsole.widgets import format as fmt


def event_time(timestamp: float) -> str:
    """UTC, as run.log writes it."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(timestamp))


class EventList(DataTable):
    """`show(line)` adds the events that arrived since the last call."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(cursor_type="row", **kwargs)  # type: ignore[arg-type]
        self._shown: list[ConsoleEvent] = []

    def on_mount(self) -> None:
        self.add_column("time (UTC)", key="time")
        self.add_column("event", key="event")
        self.add_column("what happened", key="message")

    def show(self, line: LineView) -> None:
        events = list(line.events)
        if events == self._shown:
            return
        self._shown = events
        theme = self.app.current_theme
        self.clear()
        # Newest first by when they happened (a replayed backlog arrives after newer events).
        for event in sorted(events, key=lambda event: event.time, reverse=True):
            style = fmt.severity_style(theme, event.severity)
            self.add_row(
                event_time(event.time), Text(f"{event.glyph} {event.word}", style=style), event.message
            )
        self.border_subtitle = f"{len(events)} events" if events else "no events yet"
