"""The progress line: every request the console sent a supervisor and is still waiting on.

A branch takes seconds to answer, a rollback waits for the trainer's checkpoint, a tune measures
for minutes: until the reply, the line under the screen says what waits and for how long (it
ticks on its own, paused views or not), and it goes when the reply comes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from textual.timer import Timer
from textual.widgets import Static

from nsconsole.widgets import format as fmt

TICK_S = 1.0
"""How often the waiting times are redrawn."""


@dataclass(frozen=True)
class PendingRequest:
    """One request sent and not yet answered."""

    key: str
    """The line's key in the book."""
    line: str
    """The line's name, as the progress line shows it."""
    method: str
    """The mutation (`stop`, `branch`, `rollback`, `tune`)."""
    since: float
    """When it was sent (the console's clock)."""


def progress_text(requests: Sequence[PendingRequest], now: float) -> str:
    """One line per request: `⏳ tune pssa-trunk: waiting for the supervisor… 4s`."""
    return "\n".join(
        f"⏳ {request.method} {request.line}: waiting for the supervisor… {fmt.age(max(0.0, now - request.since))}"
        for request in requests
    )


class RequestProgress(Static):
    """Shown while a request waits (see the module docstring); hidden otherwise."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self._text = ""
        """The text shown."""
        self._ticker: Timer | None = None
        """Redraws the waiting times; it runs only while a request waits (nothing ticks otherwise)."""

    def on_mount(self) -> None:
        self._ticker = self.set_interval(TICK_S, self._tick, pause=True)
        self._tick()

    def _tick(self) -> None:
        self.show(self.app.pending, self.app.clock())  # type: ignore[attr-defined]

    def show(self, requests: Sequence[PendingRequest], now: float) -> None:
        text = progress_text(requests, now)
        if text != self._text:  # an update lays the screen out: none while nothing waits
            self._text = text
            self.update(text)
        self.set_class(bool(requests), "waiting")
        if self._ticker is not None:
            if requests:
                self._ticker.resume()
            else:
                self._ticker.pause()
