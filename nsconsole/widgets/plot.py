"""Curves drawn in the terminal with braille dots: 2 x 4 dots a cell, so a 60 x 10 cell plot is
120 x 40 points. Pure functions of the numbers; `widgets/curves.py` puts them on screen.

Many rows per dot column are drawn as their envelope (the column's lowest to highest value,
joined to the previous column), so a spike between two dots is never lost to downsampling.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

BRAILLE_BASE = 0x2800
# Bit of the dot at (dx, dy) in a braille cell, dy counted from the cell's top.
DOT_BITS = ((0x01, 0x02, 0x04, 0x40), (0x08, 0x10, 0x20, 0x80))
MARKER = "◆"


@dataclass(frozen=True)
class PlotGrid:
    """A drawn plot: its character rows and the range it shows."""

    rows: list[str]
    """`height` strings of `width` characters (braille dots, markers, blanks)."""
    marker_cells: set[tuple[int, int]]
    """(row, column) of the cells holding a marker (styled apart from the curve)."""
    y_low: float
    """The value at the bottom edge (in linear units, also when the axis is logarithmic)."""
    y_high: float
    """The value at the top edge."""
    x_low: float
    x_high: float


def _finite_points(xs: Sequence[float], ys: Sequence[float], log_y: bool) -> list[tuple[float, float]]:
    points = []
    for x, y in zip(xs, ys):
        if not (math.isfinite(x) and math.isfinite(y)) or (log_y and y <= 0):
            continue
        points.append((x, math.log10(y) if log_y else y))
    return points


def draw(
    xs: Sequence[float],
    ys: Sequence[float],
    width: int,
    height: int,
    log_y: bool = False,
    marker_xs: Sequence[float] = (),
    marker_ys: Sequence[float] = (),
) -> PlotGrid | None:
    """The curve ys over xs (and markers at marker points) in `width` x `height` cells.

    None when there is nothing finite to draw (or, with `log_y`, nothing positive).
    """
    curve = _finite_points(xs, ys, log_y)
    markers = _finite_points(marker_xs, marker_ys, log_y)
    everything = curve + markers
    if not everything or width < 1 or height < 1:
        return None
    x_low, x_high = min(p[0] for p in everything), max(p[0] for p in everything)
    y_low, y_high = min(p[1] for p in everything), max(p[1] for p in everything)
    if y_high == y_low:  # a flat curve sits mid-height
        pad = abs(y_low) * 0.05 or 1.0
        y_low, y_high = y_low - pad, y_high + pad
    dots_x, dots_y = 2 * width, 4 * height

    def column(x: float) -> int:
        return 0 if x_high == x_low else round((x - x_low) / (x_high - x_low) * (dots_x - 1))

    def line(y: float) -> int:  # dot row, 0 at the top
        return dots_y - 1 - round((y - y_low) / (y_high - y_low) * (dots_y - 1))

    spans: dict[int, list[int]] = {}  # dot column -> [top dot row, bottom dot row]
    previous: tuple[int, int] | None = None  # the last (dot column, dot row) marked

    def mark(dot_column: int, dot_row: int) -> None:
        span = spans.get(dot_column)
        if span is None:
            span = spans[dot_column] = [dot_row, dot_row]
            if previous is not None and previous[0] < dot_column:
                # Join to the previous column so a steep step stays one connected stroke.
                span[0], span[1] = min(dot_row, previous[1]), max(dot_row, previous[1])
        else:
            span[0], span[1] = min(span[0], dot_row), max(span[1], dot_row)

    for x, y in curve:
        dot_column, dot_row = column(x), line(y)
        if previous is not None and dot_column > previous[0] + 1:
            # Fewer rows than dot columns: fill the columns between two rows along the straight line.
            first_column, first_row = previous
            for between in range(first_column + 1, dot_column):
                fraction = (between - first_column) / (dot_column - first_column)
                between_row = round(first_row + (dot_row - first_row) * fraction)
                mark(between, between_row)
                previous = (between, between_row)
        mark(dot_column, dot_row)
        previous = (dot_column, dot_row)

    cells = [[0] * width for _ in range(height)]
    for dot_column, (top, bottom) in spans.items():
        for dot_row in range(top, bottom + 1):
            cells[dot_row // 4][dot_column // 2] |= DOT_BITS[dot_column % 2][dot_row % 4]
    rows = [[chr(BRAILLE_BASE + bits) if bits else " " for bits in row] for row in cells]
    marker_cells = set()
    for x, y in markers:
        row, col = line(y) // 4, column(x) // 2
        rows[row][col] = MARKER
        marker_cells.add((row, col))
    linear = (lambda value: 10**value) if log_y else (lambda value: value)
    return PlotGrid(
        rows=["".join(row) for row in rows],
        marker_cells=marker_cells,
        y_low=linear(y_low),
        y_high=linear(y_high),
        x_low=x_low,
        x_high=x_high,
    )


SPARK_LEVELS = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float | None], width: int, low: float | None = None, high: float | None = None) -> str:
    """The newest `width` values as block characters (a blank for a missing one)."""
    shown = list(values)[-width:]
    finite = [value for value in shown if value is not None and math.isfinite(value)]
    if not finite:
        return " " * len(shown)
    bottom = min(finite) if low is None else low
    top = max(finite) if high is None else high
    span = top - bottom
    text = []
    for value in shown:
        if value is None or not math.isfinite(value):
            text.append(" ")
            continue
        level = 0 if span <= 0 else round((min(max(value, bottom), top) - bottom) / span * (len(SPARK_LEVELS) - 1))
        text.append(SPARK_LEVELS[level])
    return "".join(text)
