"""The lines table: one row per line, redrawn cell by cell (only the cells whose text changed).

A line whose supervisor does not answer keeps its last values, dimmed, with `⚡` before its
state; every state and the heartbeat's age carry a glyph, so nothing is told by colour alone.
"""

from __future__ import annotations

from collections.abc import Iterable

from rich.text import Text
from textual.widgets import DataTable

from nsconsole import health
from nsconsole.state import LineView
from nsconsole.widgets import format as fmt

COLUMNS = (
    ("line", "line"),
    ("kind", "kind"),
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

RIGHT_ALIGNED = {"update", "tokens", "cycle", "loss", "val_loss", "tokens_per_s", "restarts"}


class LinesTable(DataTable):
    """Every line; `show(lines, now)` redraws what changed."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(cursor_type="row", zebra_stripes=False, **kwargs)  # type: ignore[arg-type]
        self._cells: dict[str, dict[str, Text]] = {}
        self.cells_written = 0
        """Cells written since mounting (the benchmark and the tests read it)."""

    def on_mount(self) -> None:
        for key, heading in COLUMNS:
            self.add_column(heading, key=key)

    @property
    def selected_key(self) -> str | None:
        """The line under the cursor."""
        if not self.row_count:
            return None
        return self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value

    def show(self, lines: Iterable[LineView], now: float) -> None:
        wanted = {line.key: line for line in lines}
        for key in [key for key in self._cells if key not in wanted]:
            self.remove_row(key)
            del self._cells[key]
        for key, line in wanted.items():
            cells = self.render_cells(line, now)
            previous = self._cells.get(key)
            if previous is None:
                self.add_row(*(cells[column] for column, _ in COLUMNS), key=key)
                self.cells_written += len(cells)
            else:
                for column, _ in COLUMNS:
                    if cells[column] != previous[column]:
                        self.update_cell(key, column, cells[column], update_width=True)
                        self.cells_written += 1
            self._cells[key] = cells

    def render_cells(self, line: LineView, now: float) -> dict[str, Text]:
        theme = self.app.current_theme
        dim = not line.connected
        state = line.display_state
        state_text = fmt.state_label(state)
        state_severity = fmt.state_severity(state)
        if dim and line.ever_connected and state not in fmt.FINAL_STATES:
            # The last known state, its supervisor gone (a line that ended has no supervisor by design).
            state_text, state_severity = f"⚡ {state}", "error"
        beat_age = line.heartbeat_age(now)
        beat_glyph, beat_severity = fmt.heartbeat_mark(beat_age, health.STALE_HEARTBEAT_S)
        flags = line.health
        worst = "error" if any(flag.severity == "error" for flag in flags) else "warning" if flags else "success"
        values = {
            "line": (line.name, ""),
            "kind": (line.kind, ""),
            "state": (state_text, state_severity),
            "stage": (line.plan_stage or "—", ""),
            "update": (fmt.count(line.update) if (line.update or 0) >= 1e5 else str(line.update or "—"), ""),
            "tokens": (fmt.count(line.tokens), ""),
            "cycle": ("—" if line.cycle is None else str(line.cycle), ""),
            "loss": (fmt.number(line.loss), ""),
            "val_loss": (fmt.number(line.val_loss), ""),
            "tokens_per_s": (fmt.count(line.tokens_per_s), ""),
            "beat": (f"{beat_glyph} {fmt.age(beat_age)}", beat_severity),
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


def gpu_cell(line: LineView) -> tuple[str, str]:
    """Where the line trains, and a warning while it shares its GPU (shared shapes, slower)."""
    if line.gpu_index is None:
        return "cpu", ""
    if line.sharing_gpu:
        return f"gpu{line.gpu_index} shared", "warning"
    return f"gpu{line.gpu_index}", ""
