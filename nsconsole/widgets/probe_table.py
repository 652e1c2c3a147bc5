"""The probes tab: every reading of the latest validation and of the newest training row, each
with its change since the one before; a search narrows the list and Enter pins a reading to the
curves tab (a plot of its own; Enter again unpins it).

The values and their changes always show whole: a name too long for what they leave of the
table's width is shortened in its middle, marked `…` (its row key, the search and the pin keep
the whole name).

A validation reading is any number in a validation row other than the row's own bookkeeping
(update, tokens, time...): the validation losses (`val_<L>/...`, `ema/val_...`), the model's
probes and the optimizer summaries (`opt/...`). A row metric is a training row's number that the
curves can follow: loss, lr, gradient norms (`train/grad_norm/...`), throughput and the like. The
change carries ▲/▼, not only a colour.
"""

from __future__ import annotations

import re
from typing import Any

from rich.cells import cell_len
from rich.text import Text
from textual.binding import Binding
from textual.message import Message
from textual.widgets import DataTable

from nsconsole.state import LineView
from nsconsole.widgets import format as fmt

BOOKKEEPING = frozenset({
    "update", "tokens", "data_tokens", "cycle", "stage", "seq_len", "time", "lr", "weight_decay",
    "tokens_per_update", "skipped", "loss", "grad_norm", "tokens_per_s",
})
"""Row keys that are not validation readings."""
ROW_METRICS = frozenset({"loss", "lr", "grad_norm", "tokens_per_s", "weight_decay", "data_tokens", "tokens_per_update"})
"""Training-row keys a curve can follow besides the `train/...` ones."""
PIN_GLYPH = "◉"
MIN_NAME_WIDTH = 16
"""A reading's name is never shortened below this (a narrower table scrolls sideways)."""
COLUMNS = (" ", "reading", "of", "value", "change")
"""The columns' headings."""
COLUMN_KEYS = ("pin", "name", "source", "value", "change")

_LOSS_READING = re.compile(r"^(ema/)?val_[^/]+/[^/]+$")
"""A validation loss (`val_<L>/<source>`, `/mix`, `/mean`, and their EMA twins): lower is better."""


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def probe_readings(row: dict[str, Any]) -> dict[str, float]:
    """The readings of a validation row, by name (training-row keys and grad norms left out)."""
    return {
        key: float(value)
        for key, value in row.items()
        if key not in BOOKKEEPING and not key.startswith("train/") and _is_number(value)
    }


def row_metrics(row: dict[str, Any]) -> dict[str, float]:
    """The numbers of a training row that a curve can follow, by name."""
    return {
        key: float(value)
        for key, value in row.items()
        if (key in ROW_METRICS or key.startswith("train/")) and _is_number(value)
    }


def probe_changes(latest: dict[str, Any], before: dict[str, Any] | None) -> list[tuple[str, float, float | None]]:
    """(name, value, change since `before` or None) for every reading of `latest`, by name."""
    now = probe_readings(latest)
    then = probe_readings(before) if before is not None else {}
    return [(name, value, value - then[name] if name in then else None) for name, value in sorted(now.items())]


def metric_changes(latest: dict[str, Any], before: dict[str, Any] | None) -> list[tuple[str, float, float | None]]:
    """(name, value, change since `before` or None) for every row metric of `latest`, by name."""
    now = row_metrics(latest)
    then = row_metrics(before) if before is not None else {}
    return [(name, value, value - then[name] if name in then else None) for name, value in sorted(now.items())]


def fit_name(name: str, width: int) -> str:
    """`name` in at most `width` cells: whole, or its start and its end (the part that tells
    `.../block03/confidence_mean` from its neighbours) around `…`."""
    if len(name) <= width:
        return name
    head = (width - 1) // 3
    return f"{name[:head]}…{name[len(name) - (width - 1 - head):]}"


def matches(name: str, query: str) -> bool:
    """The search: every word of `query` is in the reading's name."""
    lowered = name.lower()
    return all(word in lowered for word in query.lower().split())


class ProbeTable(DataTable):
    """The readings; `show(line, query, pinned)` redraws what changed."""

    BINDINGS = [
        Binding("enter", "toggle_pin", "Pin", id="pin",
                tooltip="pin the reading to the curves tab, in a plot of its own (again: unpin it)"),
    ]

    class PinToggled(Message):
        """Enter on a reading: pin it to the curves, or unpin it."""

        def __init__(self, name: str) -> None:
            super().__init__()
            self.name = name

    def __init__(self, **kwargs: object) -> None:
        super().__init__(cursor_type="row", **kwargs)  # type: ignore[arg-type]
        self._names: list[str] = []
        self._name_width = 0
        """The width the names were last fitted to (`fit_name`)."""
        self._shown_with: tuple[LineView, str, tuple[str, ...] | list[str]] | None = None
        """`show`'s arguments as last called (a resize shows the same again, fitted anew)."""

    def on_mount(self) -> None:
        self._add_columns()

    def _add_columns(self) -> None:
        for heading, key in zip(COLUMNS, COLUMN_KEYS):
            self.add_column(heading, key=key)

    def on_resize(self) -> None:
        if self._shown_with is not None:
            self.show(*self._shown_with)

    def _fitted_name_width(self, cells: dict[str, tuple[Any, ...]]) -> int:
        """Cells a name may take: what the other columns (at their widest cell) leave of the table,
        less a vertical scrollbar whether shown or not, each column with its padding on both sides."""
        others = sum(
            max([cell_len(heading)] + [cell_len(str(row[index])) for row in cells.values()])
            for index, heading in enumerate(COLUMNS) if index != 1
        )
        room = (self.content_region.width - self.styles.scrollbar_size_vertical - others
                - 2 * self.cell_padding * len(COLUMNS))
        return max(MIN_NAME_WIDTH, room)

    def show(self, line: LineView, query: str = "", pinned: tuple[str, ...] | list[str] = ()) -> None:
        self._shown_with = (line, query, pinned)
        validations = line.validations
        entries: list[tuple[str, str, float, float | None]] = []
        if validations:
            latest = validations[-1]
            before = validations[-2] if len(validations) > 1 else None
            entries += [("validation", *change) for change in probe_changes(latest, before)]
            self.border_subtitle = f"validation at update {latest.get('update')}" + (
                f", change since update {before.get('update')}" if before is not None else ""
            )
        else:
            self.border_subtitle = "no validation yet"
        rows = line.recent_rows
        if rows:
            entries += [("row", *change) for change in metric_changes(rows[-1], rows[-2] if len(rows) > 1 else None)]
        shown = [entry for entry in entries if matches(entry[1], query)]
        names = [name for _, name, _, _ in shown]
        cells = {name: self._cells(source, name, value, change, name in pinned) for source, name, value, change in shown}
        width = self._fitted_name_width(cells)
        cells = {name: (row[0], fit_name(name, width), *row[2:]) for name, row in cells.items()}
        if names != self._names or width != self._name_width:
            self._name_width = width
            cursor = self._names[self.cursor_row] if 0 <= self.cursor_row < len(self._names) else None
            # The columns too: DataTable's only ever widen, and a narrower fit must narrow the names'.
            self.clear(columns=True)
            self._add_columns()
            for name in names:
                self.add_row(*cells[name], key=name)
            self._names = names
            if cursor in names:
                self.move_cursor(row=names.index(cursor))
            return
        for name in names:
            for column, cell in zip(COLUMN_KEYS, cells[name]):
                if str(self.get_cell(name, column)) != str(cell):
                    self.update_cell(name, column, cell, update_width=True)

    def _cells(self, source: str, name: str, value: float, change: float | None, pinned: bool) -> tuple[Any, ...]:
        theme = self.app.current_theme
        if change is None:
            change_text = Text("new", style="dim")
        else:
            # A lower loss is better; for other readings a change is only a change.
            better = change < 0 if _LOSS_READING.match(name) else None
            style = "" if better is None or change == 0 else theme.success if better else theme.warning
            change_text = Text(fmt.signed(change), style=style or "", justify="right")
        return (
            PIN_GLYPH if pinned else " ", name, Text(source, style="dim"),
            Text(fmt.number(value, 5), justify="right"), change_text,
        )

    @property
    def selected_name(self) -> str | None:
        return self._names[self.cursor_row] if 0 <= self.cursor_row < len(self._names) else None

    def action_toggle_pin(self) -> None:
        name = self.selected_name
        if name is not None:
            self.post_message(self.PinToggled(name))
