"""The curves tab's content: the grid of plots and the cursor's readout under it.

It owns the tab's `CurveSettings` and the rows the line's own `Series` lacks: a branch's trunk up to
the fork and the history of each pinned reading that is not a validation reading (a training
row's metric), both fetched in the background (`widgets/row_history.py`); a pinned metric's
history then grows from the line's newest rows. It redraws only when the line, the settings, its
size or the fetched rows changed; new rows redraw it about every 3 s (`ROWS_REDRAW_S`), and less
often still when a redraw is dear (`RedrawPacer`): a plot is repainted whole, and with a line
logging a row a second that was most of the console's CPU on this tab (bench/console_cpu.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from time import monotonic
from typing import Any

from textual.app import ComposeResult
from textual.containers import Container, Vertical

from engine.errors import LineError
from nsconsole.state import LineView
from nsconsole.widgets.curves import (
    CURVES,
    TRUNK_COLUMNS,
    CurvePlot,
    CurveSettings,
    build_frame,
    cursor_readout,
    frame_inputs,
)
from nsconsole.widgets.line_header import Fork
from nsconsole.widgets.probe_table import probe_readings
from nsconsole.widgets.quiet_static import QuietStatic
from nsconsole.widgets.row_history import History, HistoryUnavailable, fetch_history

FETCH_RETRY_TICKS = 5
"""Refreshes between attempts at rows that could not be had (a trunk being written, unattached): 5 s."""
ROWS_REDRAW_S = 2.9
"""The least time between two redraws for new rows: every third tick of a console ticking every second
(a little less than 3 s: ticks jitter); the header above the plots gives the newest numbers every
second. A key, a resize or fetched rows redraw at once."""
REDRAW_CPU_SHARE = 0.02
"""The share of a core the plots may take redrawing for new rows: a redraw that costs more (a line
of many thousand rows) waits longer before the next one."""


@dataclass
class RedrawPacer:
    """When new rows may redraw the plots: `ROWS_REDRAW_S` after the last redraw, or longer when
    the plots' last renders cost more than `REDRAW_CPU_SHARE` of that time."""

    every_s: float = ROWS_REDRAW_S
    cpu_share: float = REDRAW_CPU_SHARE
    next_s: float = -math.inf
    """The monotonic time from which new rows redraw."""

    def due(self, now: float) -> bool:
        return now >= self.next_s

    def drew(self, now: float, render_cost_s: float) -> None:
        """A redraw at `now`, whose plots took `render_cost_s` (CPU seconds) to render last time."""
        self.next_s = now + max(self.every_s, render_cost_s / self.cpu_share)


class CurvesTab(Vertical, can_focus=True):
    """See the module docstring. Focusable: the line screen's ←/→ move its cursor while it has the focus
    (on the focused tab bar they go to the tab before or after)."""

    def __init__(self, line: LineView, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.line = line
        self.settings = CurveSettings()
        self.fork: Fork | None = None
        """Where the line left its trunk (set by the line screen once run.json is read)."""
        self.trunk: History | None = None
        self.pinned_rows: dict[str, History] = {}
        """The fetched history of each pinned training-row metric."""
        self._busy: set[str] = set()
        """What is being fetched now (`trunk` or a pinned name)."""
        self._retry_in: dict[str, int] = {}
        """Refreshes left before a fetch that could not be had is tried again, by what it fetches."""
        self._drawn_view: tuple[Any, ...] | None = None
        """What the plots show as last drawn, but the rows (see `refresh_if_changed`)."""
        self._drawn_rows: tuple[Any, ...] | None = None
        """The rows the plots show as last drawn."""
        self.pacer = RedrawPacer()

    def compose(self) -> ComposeResult:
        with Container(id="curves"):
            for column, title in CURVES:
                yield CurvePlot(column, title, id=f"curve-{column}")
        yield QuietStatic(id="curve-readout")

    # ---- what the keys do ----------------------------------------------------------------------

    def changed(self) -> None:
        """The settings changed: redraw now."""
        self.refresh_if_changed()

    def move_cursor(self, step: int) -> None:
        width = self.plot_width
        current = self.settings.cursor
        self.settings.cursor = width - 1 if current is None else min(max(current + step, 0), width - 1)
        self.changed()

    def toggle_pin(self, name: str) -> None:
        """Pin `name` to the curves (a plot of its own), or unpin it."""
        pinned = self.settings.pinned
        if name in pinned:
            pinned.remove(name)
            self.pinned_rows.pop(name, None)
            self._retry_in.pop(name, None)
            for plot in self.query(CurvePlot):
                if plot.pinned and plot.column == name:
                    plot.remove()
        else:
            pinned.append(name)
            grid = self.query_one("#curves", Container)
            grid.mount(CurvePlot(name, name, pinned=True, classes="pinned"))
            validations = self.line.validations
            if not (validations and name in probe_readings(validations[-1])):
                self.pinned_rows[name] = History((name,))
                self.pinned_rows[name].extend(self.line.recent_rows)
                self._fetch(name)
        self._drawn_view = None
        self.call_after_refresh(self.changed)

    @property
    def plot_width(self) -> int:
        return self.query_one(CurvePlot).plot_width

    # ---- drawing -------------------------------------------------------------------------------

    def on_resize(self) -> None:
        self.refresh_if_changed()

    def refresh_if_changed(self) -> None:
        self._fetch_missing()
        if not self.size:
            # Not laid out yet, or hidden behind another tab: the plots would measure 0 columns (and
            # the cursor be pulled to the left end). Drawn once they have a size (`on_resize`).
            return
        for history in self.pinned_rows.values():
            history.extend(self.line.recent_rows)
        plots = list(self.query(CurvePlot))
        width = self.plot_width
        if self.settings.cursor is not None and self.settings.cursor >= width:
            self.settings.cursor = width - 1
        # The settings, the sizes, a fetched trunk or pinned history (a new object) redraw at once; rows
        # that arrived (the line's, a pinned history grown from them) redraw when the pacer says.
        view = (
            self.settings.key, tuple(plot.size for plot in plots), id(self.trunk),
            tuple((name, id(history)) for name, history in self.pinned_rows.items()),
        )
        rows = frame_inputs(self.line), tuple(len(history.update) for history in self.pinned_rows.values())
        now = monotonic()
        if view == self._drawn_view and (rows == self._drawn_rows or not self.pacer.due(now)):
            return
        self._drawn_view, self._drawn_rows = view, rows
        self.pacer.drew(now, sum(plot.render_cost_s for plot in plots))
        frame = build_frame(self.line, self.settings, self.trunk, self.pinned_rows)
        for plot in plots:
            plot.show(frame, self.settings)
        self.query_one("#curve-readout", QuietStatic).show_text(cursor_readout(frame, self.settings, width))

    # ---- rows fetched in the background --------------------------------------------------------

    def _fetch_missing(self) -> None:
        wanted = (["trunk"] if self.fork is not None and self.trunk is None else []) + list(self._retry_in)
        for what in wanted:
            left = self._retry_in.get(what, 0)
            if what in self._busy:
                continue
            if left > 0:
                self._retry_in[what] = left - 1
                continue
            self._fetch(what)

    def _fetch(self, what: str) -> None:
        """Fetch the trunk (`trunk`) or a pinned metric's history in the background."""
        self._retry_in.pop(what, None)
        self._busy.add(what)
        app = self.app
        live, book = app.live, app.book  # type: ignore[attr-defined]

        async def fetch() -> None:
            try:
                if what == "trunk":
                    assert self.fork is not None
                    history = await fetch_history(live, book, self.fork.trunk, TRUNK_COLUMNS, self.fork.update)
                else:
                    history = await fetch_history(live, book, self.line.path, (what,))
            except (HistoryUnavailable, LineError, OSError):
                self._retry_in[what] = FETCH_RETRY_TICKS
                return
            finally:
                self._busy.discard(what)
            if what == "trunk":
                self.trunk = history
            elif what in self.settings.pinned:
                history.extend(self.line.recent_rows)  # rows that arrived while it was fetched
                self.pinned_rows[what] = history
            if self.is_mounted:
                self.refresh_if_changed()

        self.run_worker(fetch(), group=f"history-{what}", exclusive=True)
