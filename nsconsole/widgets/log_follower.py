"""The log tab: the end of a line's run.log, followed through the supervisor's `log` call.

The first read starts `START_BACK_BYTES` before the end; each `poll` then asks for what was
appended since. A file shorter than the offset read so far was rotated: follow the new one from
its start. The supervisor returns whole UTF-8 characters only, so nothing is cut mid-glyph.

A read can answer after the user has left the line's screen (Escape): the log is gone then, and
nothing is written to it; lines written to a gone log are not measured (`_update_size`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from rich.cells import cell_len
from textual import work
from textual.app import App
from textual.widgets import Log

from engine.protocol.wire import MAX_LOG_CHUNK

START_BACK_BYTES = 64 * 1024
"""How much of the end of run.log the tab shows when it opens."""
MAX_CHUNKS_PER_POLL = 8
"""Chunks read in one poll (a burst of output is caught up over a few polls, not at once)."""

LogFetcher = Callable[[int, int], Awaitable[dict[str, Any]]]
"""`log {offset, length}` of the line's supervisor: {text, next, size}."""


class LogFollower(Log):
    """Follows run.log; `poll(fetch)` appends what is new."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(max_lines=5000, auto_scroll=True, **kwargs)  # type: ignore[arg-type]
        self.read_offset: int | None = None
        """The byte offset in run.log read up to (None: not read yet)."""
        self._partial = ""
        self._skip_to_line_start = False

    async def poll(self, fetch: LogFetcher) -> None:
        if self.read_offset is None:
            probe = await fetch(0, 1)
            if not self.is_attached:
                return  # the user left the screen while the read was on its way: nothing shows it now
            self.read_offset = max(0, int(probe.get("size", 0)) - START_BACK_BYTES)
            self._skip_to_line_start = self.read_offset > 0
        for _ in range(MAX_CHUNKS_PER_POLL):
            reply = await fetch(self.read_offset, MAX_LOG_CHUNK)
            if not self.is_attached:
                return
            size = int(reply.get("size", 0))
            if size < self.read_offset:
                self.write_line("--- run.log was rotated; following the new file ---")
                self.read_offset, self._partial = 0, ""
                continue
            text = str(reply.get("text", ""))
            self.read_offset = int(reply.get("next", self.read_offset))
            if not text:
                return
            self._append(text)
            if self.read_offset >= size:
                return

    def _append(self, text: str) -> None:
        text = self._partial + text
        if self._skip_to_line_start:
            # Started mid-file: the first line is a tail of one, leave it out.
            newline = text.find("\n")
            if newline < 0:
                self._partial = ""
                return
            text = text[newline + 1 :]
            self._skip_to_line_start = False
        lines = text.split("\n")
        self._partial = lines.pop()  # an unfinished last line waits for its end
        if lines:
            self.write_lines(lines)

    def _update_size(self, updates: int, lines: list[str]) -> None:
        """Textual's `Log._update_size` (Textual 8.2.x, textual/widgets/_log.py), which `write_lines`
        calls, with the app taken here, on the event loop.

        Textual's is a thread worker that looks `self.app` up in its thread, where (a thread worker
        runs through `run_in_executor`, which carries no context variables) it is found only through
        the widget's parents: for a log removed by then that fails (`NoActiveAppError`), and a
        worker's error exits the console. pyproject.toml pins Textual to 8.2.x;
        tests/console/test_console_log_tab.py fails if this override stops being called.
        """
        if not self.is_attached:
            # Never drawn again, and its unmount, which cancels its workers, is past: measure nothing.
            return
        self._measure_widths(self.app, updates, lines)

    @work(thread=True)
    def _measure_widths(self, app: App[object], updates: int, lines: list[str]) -> None:
        # Off the loop, as Textual does: a big batch of long lines does not stall the console.
        if lines:
            width = max(cell_len(self._process_line(line)) for line in lines)
            app.call_from_thread(self._update_maximum_width, updates, width)
