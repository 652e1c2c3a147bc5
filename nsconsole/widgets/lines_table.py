"""The lines table: one row per line; a tick re-renders only the rows whose cells changed.

Textual's `DataTable.update_cell` re-renders every visible row for one changed cell (it bumps a
counter that keys every render cache, and repaints the whole widget): with eight lines logging, that
was most of the console's CPU (bench/console_cpu.py). `LinesTable.show` writes a changed cell, drops
the cached renders of that cell's row alone and repaints that row's lines; a change that moves a
column's width (or lands while widths are still being measured) takes DataTable's own path, which
lays every row out anew. A line that did not change since the last tick is not even rendered to
cells, and one whose progress alone moved (update, tokens, loss, tok/s) is repainted about every
2 s at most (`PROGRESS_REPAINT_S`).

A line whose supervisor does not answer keeps its last values, dimmed, with `⚡` before its
state; every state and the heartbeat's age carry a glyph, so nothing is told by colour alone. A
line that nothing runs (it ended, or its supervisor and trainer are gone) has no live readings: its
beat reads `— ended` and its tok/s `—`.

The cursor stays on its line (by key) whatever rows come, go or are filtered away around it:
the keys act on the line under the cursor. Rows keep the order they are given in. A table too
narrow for every column shows the most important ones (`PRIORITY`) and drops the rest. Two lines
of one name are each shown by a short path, marked `⚠`; a branch's kind names its parent; `forks`
lists the branches its supervisor holds for a cycle end (queued `⑂`, failed `✗`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from time import monotonic

from rich.cells import cell_len
from rich.text import Text
from textual.widgets import DataTable
from textual.widgets.data_table import ColumnKey, RowKey

from nsconsole import health
from nsconsole.state import LineView
from nsconsole.widgets import format as fmt

COLUMNS = (
    ("line", "line"),
    ("kind", "kind"),
    ("forks", "forks"),
    ("state", "state"),
    ("stage", "stage"),
    ("update", "update"),
    ("tokens", "tokens"),
    ("cycle", "cycle"),
    ("loss", "loss"),
    ("val_loss", "val loss"),
    ("tokens_per_s", "tok/s"),
    ("beat", "beat"),
    ("restarts", "restarts"),
    ("gpu", "GPU"),
    ("health", "health"),
)
"""(column key, heading) in display order."""

PRIORITY = ("line", "state", "health", "beat", "loss", "update", "forks", "tokens", "cycle", "val_loss",
            "tokens_per_s", "kind", "stage", "gpu", "restarts")
"""The columns in the order they are kept when the table is too narrow for all of them."""

RIGHT_ALIGNED = {"update", "tokens", "cycle", "loss", "val_loss", "tokens_per_s", "restarts"}

PROGRESS_COLUMNS = frozenset({"update", "tokens", "loss", "tokens_per_s"})
"""The columns every training row moves."""
PROGRESS_REPAINT_S = 1.9
"""A row whose progress columns alone changed is repainted about every 2 s at most (a little less: ticks
jitter), however often the console ticks (`refresh_interval`) or rows come: a repainted row is most
of what the lines screen costs (bench/console_cpu.py), and a line's own screen gives its numbers
every second. Any other change (state, health, beat...) is painted at once."""


class LinesTable(DataTable):
    """Every line; `show(lines, now)` redraws what changed."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(cursor_type="row", zebra_stripes=False, **kwargs)  # type: ignore[arg-type]
        self._cells: dict[str, dict[str, Text]] = {}
        self._drawn_from: dict[str, tuple[object, ...]] = {}
        """What each row's cells were made from (`_cell_inputs`): a line whose inputs are the same is not redrawn."""
        self._painted_at: dict[str, float] = {}
        """When each row's changed cells were last painted (time.monotonic())."""
        self._shown_columns: tuple[str, ...] = ()
        self.cells_written = 0
        """Cells written since mounting (the benchmark and the tests read it)."""
        self._renders_counted = -1
        """DataTable's `_update_count` when its render caches were last pruned (`_forget_renders`)."""

    def on_mount(self) -> None:
        self._lay_out([column for column, _ in COLUMNS])

    def on_resize(self) -> None:
        self._fit_columns()

    @property
    def shown_columns(self) -> tuple[str, ...]:
        """The keys of the columns on screen now, in display order."""
        return self._shown_columns

    @property
    def selected_key(self) -> str | None:
        """The line under the cursor."""
        if not self.row_count:
            return None
        return self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value

    def show(self, lines: Iterable[LineView], now: float) -> None:
        selected = self.selected_key
        shown = list(lines)
        wanted = {line.key: line for line in shown}
        names = Counter(line.name for line in shown)
        gone = [key for key in self._cells if key not in wanted]
        for key in gone:
            self.remove_row(key)
            del self._cells[key]
            self._drawn_from.pop(key, None)
            self._painted_at.pop(key, None)
        changed: dict[str, dict[str, Text]] = {}
        moved = bool(gone)  # any row or cell (shown or not) changed: only then may the fitting columns change
        painted_at = monotonic()
        for key, line in wanted.items():
            shared_name = names[line.name] > 1
            inputs = self._cell_inputs(line, now, shared_name)
            previous = self._cells.get(key)
            if previous is not None and self._drawn_from.get(key) == inputs:
                continue  # nothing its cells show can have changed
            cells = self.render_cells(line, now, shared_name)
            if previous is None:
                self.add_row(*(cells[column] for column in self._shown_columns), key=key)
                self.cells_written += len(self._shown_columns)
                moved = True
            elif cells != previous:
                differing = {column for column in cells if cells[column] != previous[column]}
                if differing <= PROGRESS_COLUMNS and painted_at - self._painted_at.get(key, -math.inf) < PROGRESS_REPAINT_S:
                    continue  # only its progress moved, and its row was just painted: a later tick paints it
                moved = True
                row = {column: cells[column] for column in self._shown_columns if column in differing}
                if row:
                    changed[key] = row
                    self.cells_written += len(row)
                    self._painted_at[key] = painted_at
            self._cells[key] = cells
            self._drawn_from[key] = inputs
        self._write_cells(changed)
        if [row.key.value for row in self.ordered_rows] != list(wanted):
            # A line came back (the filter cleared, a supervisor restarted): in its place again.
            self._cells = {key: self._cells[key] for key in wanted}
            self._lay_out(self._shown_columns)
        if moved:
            self._fit_columns()
        self._keep_cursor_on(selected)

    def _cell_inputs(self, line: LineView, now: float, shared_name: bool) -> tuple[object, ...]:
        """What a row's cells are made from: the line's `version` (bumped by every change of it), its
        heartbeat's mark, whether its name is shared and the theme. The same inputs, the same cells."""
        return line.version, beat_cell(line, now), shared_name, self.app.theme

    def _write_cells(self, changed: dict[str, dict[str, Text]]) -> None:
        """Put the changed cells in (`_cells` holds them already), re-rendering only their rows
        where no column's width moves."""
        if not changed:
            return
        if self._widths_pending() or self._moves_width(changed):
            for key, row in changed.items():
                for column, cell in row.items():
                    self.update_cell(key, column, cell, update_width=True)
            return
        for key, row in changed.items():
            data = self._data[RowKey(key)]
            for column, cell in row.items():
                data[ColumnKey(column)] = cell
        self._forget_renders(changed)
        for key in changed:
            self.refresh_row(self.get_row_index(key))

    def _widths_pending(self) -> bool:
        """Whether DataTable still has rows or cells to measure (it measures them when idle)."""
        return bool(self._new_rows or self._updated_cells or self._require_update_dimensions)

    def _moves_width(self, changed: dict[str, dict[str, Text]]) -> bool:
        """Whether a changed column's width is no longer its widest cell's (or heading's)."""
        headings = dict(COLUMNS)
        for column in {column for row in changed.values() for column in row}:
            needed = max([cell_len(headings[column])] + [cells[column].cell_len for cells in self._cells.values()])
            if needed != self.columns[ColumnKey(column)].content_width:
                return True
        return False

    def _forget_renders(self, changed: dict[str, dict[str, Text]]) -> None:
        """Drop DataTable's cached renders of the changed cells, of their rows and of the rows'
        screen lines; every other row's renders stay (their cache keys are unchanged)."""
        caches = (self._cell_render_cache, self._row_render_cache, self._line_cache, self._row_renderable_cache)
        if self._update_count != self._renders_counted:
            # DataTable's counter moved (a row added, a resize, a width): every render cached before
            # is keyed by the old count and dead; dropping them all keeps the scans below short.
            for cache in caches:
                cache.clear()
            self._renders_counted = self._update_count
            return
        rows = {RowKey(key) for key in changed}
        cells = {(RowKey(key), ColumnKey(column)) for key, row in changed.items() for column in row}
        lines: set[int] = set()
        for key in changed:
            index = self.get_row_index(key)
            lines.update(self._get_row_region(index).line_range)
            self._row_renderable_cache.discard((self._update_count, index))
        # The keys are (row, column, ...), (row, line in row, ...) and (y, ...): see DataTable's
        # _render_cell, _render_line_in_row and _render_line.
        for cache, stale in ((self._cell_render_cache, lambda k: (k[0], k[1]) in cells),
                             (self._row_render_cache, lambda k: k[0] in rows),
                             (self._line_cache, lambda k: k[0] in lines)):
            for cache_key in list(filter(stale, cache.keys())):  # an LRUCache: no iteration of its own
                cache.discard(cache_key)

    def _keep_cursor_on(self, key: str | None) -> None:
        if key is not None and key in self._cells and self.selected_key != key:
            self.move_cursor(row=self.get_row_index(key), animate=False)

    def _fit_columns(self) -> None:
        """Show the columns that fit the width, most important first (see `PRIORITY`)."""
        width = self.scrollable_content_region.width
        if width <= 0:
            return
        headings = dict(COLUMNS)
        room, fitting = width, set()
        for column in PRIORITY:
            needed = 2 * self.cell_padding + max(
                [cell_len(headings[column])] + [cells[column].cell_len for cells in self._cells.values()]
            )
            if needed > room and fitting:
                break
            fitting.add(column)
            room -= needed
        shown = [column for column, _ in COLUMNS if column in fitting]
        if tuple(shown) != self._shown_columns:
            selected = self.selected_key
            self._lay_out(shown)
            self._keep_cursor_on(selected)

    def _lay_out(self, columns: Iterable[str]) -> None:
        """Every column and row anew (rows in the order `_cells` has them)."""
        headings = dict(COLUMNS)
        self.clear(columns=True)
        self._shown_columns = tuple(columns)
        for column in self._shown_columns:
            self.add_column(headings[column], key=column)
        for key, cells in self._cells.items():
            self.add_row(*(cells[column] for column in self._shown_columns), key=key)

    def render_cells(self, line: LineView, now: float, shared_name: bool = False) -> dict[str, Text]:
        """Every column's cell; `shared_name`: another line shown has this line's name."""
        theme = self.app.current_theme
        dim = not line.connected
        state = line.display_state
        state_text = fmt.state_label(state)
        state_severity = fmt.state_severity(state)
        if dim and line.ever_connected and not line.ended:
            # The last known state, its supervisor gone (a line that ended has no supervisor by design).
            state_text, state_severity = f"⚡ {state}", "error"
        flags = line.health
        worst = "error" if any(flag.severity == "error" for flag in flags) else "warning" if flags else "success"
        values = {
            "line": (fmt.line_label(line.name, line.path, shared_name), "warning" if shared_name else ""),
            "kind": (line.kind if line.parent is None else f"branch of {Path(line.parent).name}", ""),
            "forks": forks_cell(line),
            "state": (state_text, state_severity),
            "stage": (line.plan_stage or "—", ""),
            "update": (fmt.count(line.update) if (line.update or 0) >= 1e5 else str(line.update or "—"), ""),
            "tokens": (fmt.count(line.tokens), ""),
            "cycle": ("—" if line.cycle is None else str(line.cycle), ""),
            "loss": (fmt.number(line.loss), ""),
            "val_loss": (fmt.number(line.val_loss), ""),
            # A line that nothing runs has no pace: its last row's rate is history.
            "tokens_per_s": ("—" if line.ended else fmt.count(line.tokens_per_s), ""),
            "beat": beat_cell(line, now),
            "restarts": (str(line.restarts), "warning" if line.restarts else ""),
            "gpu": gpu_cell(line),
            "health": (" ".join(flag.label for flag in flags) or "✓ ok", worst),
        }
        cells = {}
        for column, (text, severity) in values.items():
            style = fmt.severity_style(theme, severity)
            if dim:
                style = f"{style} dim".strip()
            justify = "right" if column in RIGHT_ALIGNED else "left"
            cells[column] = Text(text, style=style, justify=justify)
        return cells


ENDED_BEAT = "— ended"
"""The beat of a line that nothing runs: no trainer beats, so its last heartbeat's age is no reading."""


def beat_cell(line: LineView, now: float) -> tuple[str, str]:
    """(text, severity) of the line's beat: its heartbeat's mark and age (`beat_text`), or `ENDED_BEAT`
    once the line has ended (an age that grows on a finished line would read as an alarm)."""
    if line.ended:
        return ENDED_BEAT, "muted"
    age = line.heartbeat_age(now)
    glyph, severity = fmt.heartbeat_mark(age, health.STALE_HEARTBEAT_S)
    return beat_text(glyph, age), severity


def beat_text(glyph: str, age: float | None) -> str:
    """`● fresh` while the heartbeat is fresh, else its age (`◐ 2m`, `○ 3h`).

    Not the fresh beat's seconds: they change every second on every row, and redrawing eight rows a
    second was most of the console's CPU (bench/console_cpu.py); the line screen's header gives
    the exact age.
    """
    return f"{glyph} fresh" if glyph == "●" else f"{glyph} {fmt.age(age)}"


def forks_cell(line: LineView) -> tuple[str, str]:
    """Branches held for a cycle end: `⑂ b1@2` queued, `✗ b2@1` failed (an error: the event says why)."""
    failed = [f"✗ {Path(fork.path).name}@{fork.at_cycle}" for fork in line.failed_forks]
    queued = [f"⑂ {Path(fork.path).name}@{fork.at_cycle}" for fork in line.queued_forks]
    return " ".join(failed + queued) or "—", "error" if failed else ""


def gpu_cell(line: LineView) -> tuple[str, str]:
    """Where the line trains, and a warning while it shares its GPU (shared shapes, slower)."""
    if line.gpu_index is None:
        return "cpu", ""
    gpus = "gpu" + ",".join(str(index) for index in line.gpu_indices)
    if line.sharing_gpu:
        return f"{gpus} shared", "warning"
    return gpus, ""
