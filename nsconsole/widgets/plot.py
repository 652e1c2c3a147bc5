"""Curves drawn in the terminal with braille dots: 2 x 4 dots a cell, so a 60 x 10 cell plot is
120 x 40 points. Pure functions of the numbers; `widgets/curves.py` puts them on screen.

Many rows per dot column are drawn as their envelope (the column's lowest to highest value,
joined to the previous column), so a spike between two dots is never lost to downsampling.
A plot holds layers (a smoothed curve over its raw readings, a branch over its trunk's history):
their dots share cells, and each cell remembers the topmost layer that drew in it, for its style.

Hand-written rather than plotext (textual-plotext's renderer): 50,000 rows into 120 x 30 cells
take 82 ms here and 902 ms in plotext 5.3.2 (`bench/console_plot.py`, `bench/RESULTS.md`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

BRAILLE_BASE = 0x2800
# Bit of the dot at (dx, dy) in a braille cell, dy counted from the cell's top.
DOT_BITS = ((0x01, 0x02, 0x04, 0x40), (0x08, 0x10, 0x20, 0x80))
MARKER = "◆"
NO_LAYER = -1
FLAT = 1e-9
"""A vertical range this small relative to its values is drawn as a flat curve."""


@dataclass(frozen=True)
class Layer:
    """One curve of a plot: its points, drawn over the layers before it."""

    xs: Sequence[float]
    ys: Sequence[float]


@dataclass(frozen=True)
class PlotGrid:
    """A drawn plot: its character rows, which layer owns each cell, and the range it shows."""

    rows: list[str]
    """`height` strings of `width` characters (braille dots, markers, blanks)."""
    layers: list[list[int]]
    """Per row and column, the index of the topmost layer drawn in that cell (`NO_LAYER`: none)."""
    marker_cells: set[tuple[int, int]]
    """(row, column) of the cells holding a marker (styled apart from the curve)."""
    y_low: float
    """The value at the bottom edge (in linear units, also when the axis is logarithmic)."""
    y_high: float
    """The value at the top edge."""
    x_low: float
    x_high: float


def cell_column(x: float, x_low: float, x_high: float, width: int) -> int:
    """The cell column that `x` falls in, on a plot `width` cells wide showing x_low..x_high."""
    if x_high == x_low:
        return 0
    dot = round((x - x_low) / (x_high - x_low) * (2 * width - 1))
    return min(max(dot, 0), 2 * width - 1) // 2


def column_x(column: int, x_low: float, x_high: float, width: int) -> float:
    """The x a cursor on a cell column reads: x_low on the first, x_high on the last, and in
    between an x that `cell_column` puts in that column (so the newest row is reachable)."""
    if width < 2 or x_high == x_low:
        return x_low
    return x_low + column / (width - 1) * (x_high - x_low)


def _finite_points(
    xs: Sequence[float], ys: Sequence[float], log_y: bool, x_range: tuple[float, float] | None
) -> list[tuple[float, float]]:
    points = []
    low, high = x_range if x_range is not None else (-math.inf, math.inf)
    for x, y in zip(xs, ys):
        if not (math.isfinite(x) and math.isfinite(y)) or (log_y and y <= 0) or not low <= x <= high:
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
    """The curve ys over xs (and markers at marker points) in `width` x `height` cells."""
    return draw_layers([Layer(xs, ys)], width, height, log_y, marker_xs, marker_ys)


def draw_layers(
    layers: Sequence[Layer],
    width: int,
    height: int,
    log_y: bool = False,
    marker_xs: Sequence[float] = (),
    marker_ys: Sequence[float] = (),
    x_range: tuple[float, float] | None = None,
) -> PlotGrid | None:
    """Every layer (later ones on top) and the markers in `width` x `height` cells.

    `x_range` fixes the horizontal range (plots that share a cursor share it); points outside it
    are left out, and the vertical range fits what is left. None when nothing finite is left
    (or, with `log_y`, nothing positive).
    """
    curves = [_finite_points(layer.xs, layer.ys, log_y, x_range) for layer in layers]
    markers = _finite_points(marker_xs, marker_ys, log_y, x_range)
    everything = [point for curve in curves for point in curve] + markers
    if not everything or width < 1 or height < 1:
        return None
    if x_range is not None:
        x_low, x_high = x_range
    else:
        x_low, x_high = min(p[0] for p in everything), max(p[0] for p in everything)
    y_low, y_high = min(p[1] for p in everything), max(p[1] for p in everything)
    # A flat curve sits mid-height (also one that only rounding moves, such as an average of a constant).
    flat = y_high - y_low <= FLAT * max(abs(y_low), abs(y_high))
    if flat:
        pad = abs(y_low) * 0.05 or 1.0
        y_low, y_high = y_low - pad, y_high + pad
    dots_x, dots_y = 2 * width, 4 * height
    x_scale = 0.0 if x_high == x_low else (dots_x - 1) / (x_high - x_low)
    y_scale = (dots_y - 1) / (y_high - y_low)

    def line(y: float) -> int:  # dot row, 0 at the top
        return dots_y // 2 if flat else dots_y - 1 - round((y - y_low) * y_scale)

    cells = [[0] * width for _ in range(height)]
    owners = [[NO_LAYER] * width for _ in range(height)]
    for index, curve in enumerate(curves):
        for dot_column, (top, bottom) in _spans(curve, x_low, x_scale, line).items():
            cell_x = dot_column // 2
            bits = DOT_BITS[dot_column % 2]
            for dot_row in range(top, bottom + 1):
                cells[dot_row // 4][cell_x] |= bits[dot_row % 4]
                owners[dot_row // 4][cell_x] = index
    rows = [[chr(BRAILLE_BASE + bits) if bits else " " for bits in row] for row in cells]
    marker_cells = set()
    for x, y in markers:
        row, col = line(y) // 4, round((x - x_low) * x_scale) // 2
        rows[row][col] = MARKER
        marker_cells.add((row, col))
    linear = (lambda value: 10**value) if log_y else (lambda value: value)
    return PlotGrid(
        rows=["".join(row) for row in rows],
        layers=owners,
        marker_cells=marker_cells,
        y_low=linear(y_low),
        y_high=linear(y_high),
        x_low=x_low,
        x_high=x_high,
    )


def _spans(curve: list[tuple[float, float]], x_low: float, x_scale: float, line) -> dict[int, list[int]]:
    """Dot column -> [top dot row, bottom dot row] of one curve, joined column to column."""
    spans: dict[int, list[int]] = {}
    previous: tuple[int, int] | None = None  # the last (dot column, dot row) marked

    def mark(dot_column: int, dot_row: int) -> None:
        span = spans.get(dot_column)
        if span is None:
            span = spans[dot_column] = [dot_row, dot_row]
            if previous is not None and previous[0] < dot_column:
                # Join to the previous column so a steep step stays one connected stroke.
                span[0], span[1] = min(dot_row, previous[1]), max(dot_row, previous[1])
        elif dot_row < span[0]:
            span[0] = dot_row
        elif dot_row > span[1]:
            span[1] = dot_row

    for x, y in curve:
        dot_column, dot_row = round((x - x_low) * x_scale), line(y)
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
    return spans


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
