"""The curves tab: train and validation loss, lr, grad norm and tokens/s over tokens trained.

Each curve is a braille plot (`widgets/plot.py`) sized to its box; validation losses are ◆
markers on the loss plot. `log_y` switches every plot's vertical axis to a log scale (values
that are not positive are left out there).
"""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from nsconsole.state import LineView, validation_loss
from nsconsole.widgets import format as fmt
from nsconsole.widgets.plot import draw

AXIS_WIDTH = 9
"""Cells left of a plot for its vertical axis labels."""

CURVES = (
    ("loss", "loss (train ⠿, validation ◆)"),
    ("lr", "learning rate"),
    ("grad_norm", "gradient norm"),
    ("tokens_per_s", "tokens/s"),
)
"""(series column, title) of each plot."""


class CurvePlot(Widget):
    """One curve of one line; redrawn when its line changes, its size changes or log_y flips."""

    log_y: reactive[bool] = reactive(False)

    def __init__(self, line: LineView, column: str, title: str, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.line = line
        self.column = column
        self.title = title
        self._drawn_version = -1

    def refresh_if_changed(self) -> None:
        if self.line.version != self._drawn_version:
            self.refresh()

    def render(self) -> Text:
        self._drawn_version = self.line.version
        theme = self.app.current_theme
        series = self.line.series
        width = max(1, self.size.width - AXIS_WIDTH - 1)
        height = max(1, self.size.height - 2)
        marker_xs: list[float] = []
        marker_ys: list[float] = []
        if self.column == "loss":
            for row in self.line.validations:
                value = validation_loss(row)
                if value is not None and isinstance(row.get("tokens"), (int, float)):
                    marker_xs.append(float(row["tokens"]))
                    marker_ys.append(value)
        values = getattr(series, self.column)
        scale = "log" if self.log_y else "linear"
        text = Text(f"{self.title}  [{scale}]\n", style="bold")
        grid = draw(series.tokens, values, width, height, self.log_y, marker_xs, marker_ys)
        if grid is None:
            text.append("no readings yet" if not self.log_y else "nothing positive to draw on a log axis", style="dim")
            return text
        labels = {0: fmt.number(grid.y_high), height - 1: fmt.number(grid.y_low)}
        if height > 4:
            middle = (grid.y_high * grid.y_low) ** 0.5 if self.log_y else (grid.y_high + grid.y_low) / 2
            labels[(height - 1) // 2] = fmt.number(middle)
        # One span per row (a span per character costs the console most of its CPU on this tab).
        for index, row in enumerate(grid.rows):
            text.append(f"{labels.get(index, ''):>{AXIS_WIDTH}}│", style="dim")
            start = len(text)
            text.append(row, style=theme.primary or "")
            for marker_row, marker_column in grid.marker_cells:
                if marker_row == index:
                    text.stylize(theme.accent or "bold", start + marker_column, start + marker_column + 1)
            text.append("\n")
        left, right = fmt.count(grid.x_low), fmt.count(grid.x_high) + " tokens"
        gap = max(1, width - len(left) - len(right))
        text.append(f"{'':>{AXIS_WIDTH}}└{left}{' ' * gap}{right}", style="dim")
        return text
