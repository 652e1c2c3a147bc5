"""The log tab: the end of a line's run.log, followed through the supervisor's `log` call.

The first read starts `START_BACK_BYTES` before the end; each `poll` then asks for what was
appended since. A file shorter than the offset read so far was rotated: follow the new one from
its start. The supervisor returns whole UTF-8 characters only, so nothing is cut mid-glyph.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

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
            self.read_offset = max(0, int(probe.get("size", 0)) - START_BACK_BYTES)
            self._skip_to_line_start = self.read_offset > 0
        for _ in range(MAX_CHUNKS_PER_POLL):
            reply = await fetch(self.read_offset, MAX_LOG_CHUNK)
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
