"""The curves tab: train and validation loss, lr, grad norm, tokens/s and every pinned reading.

Each curve is a braille plot (`widgets/plot.py`) sized to its box; every plot of the tab shares
one x range, so a cursor column means the same row on each. What the keys set (`CurveSettings`):

- smoothing: off, or a debiased EMA (weight 0.6, 0.9, 0.99) drawn over its raw readings, dimmed;
- the x axis: updates, tokens trained, or wall time since the first row shown;
- a log y axis (values that are not positive are left out there);
- a cursor, moved a cell at a time, whose row every curve reads out below the plots.

Under each plot a strip marks where things happened: ◇ validations, ┆ cycle ends (from the rows'
cycle numbers), ↻ trainer restarts and ↶ rollbacks (from the line's events, placed at the first
row written after them). A branch is drawn over its trunk's rows up to the fork, dimmed.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Self

from rich.segment import Segment
from rich.text import Text
from textual.strip import Strip
from textual.widget import Widget

from engine.protocol.facts import EventKind
from nsconsole.state import LineView, validation_loss
from nsconsole.widgets import format as fmt
from nsconsole.widgets.plot import NO_LAYER, Layer, PlotGrid, cell_column, column_x, draw_layers
from nsconsole.widgets.row_history import History

AXIS_WIDTH = 9
"""Cells left of a plot for its vertical axis labels."""
CHROME_ROWS = 3
"""Rows of a plot's box that are not the plot: its title, the marker strip and the x labels."""

CURVES = (
    ("loss", "loss (train ⠿, validation ◆)"),
    ("lr", "learning rate"),
    ("grad_norm", "gradient norm"),
    ("tokens_per_s", "tokens/s"),
)
"""(series column, title) of each plot."""
TRUNK_COLUMNS = tuple(column for column, _ in CURVES)
"""The trunk's readings drawn under a branch's curves."""

SMOOTHINGS = (0.0, 0.6, 0.9, 0.99)
"""The smoothing key's cycle: EMA weights (0: off)."""
X_AXES = ("tokens", "update", "time")
"""The x axis key's cycle."""

MARKER_GLYPHS = {"validation": "◇", "cycle": "┆", "restart": "↻", "rollback": "↶"}
"""The strip's glyph of each kind of marker; when two share a cell the later kind here wins."""
RESTART_EVENTS = frozenset({EventKind.WATCHDOG_RESTART, EventKind.SIGNAL_RESTART, EventKind.CRASHED, "restarted"})
"""Events after which the trainer started again from its newest checkpoint."""
ROLLBACK_EVENTS = frozenset({EventKind.ROLLED_BACK})


@dataclass
class CurveSettings:
    """What every plot of a line's curves tab shows; the line screen's keys change it."""

    smoothing: float = 0.0
    """The EMA weight (0: the raw readings only)."""
    x_axis: str = "tokens"
    """One of `X_AXES`."""
    log_y: bool = False
    """A log vertical axis on every plot."""
    cursor: int | None = None
    """The cursor's cell column on every plot (None: no cursor)."""
    pinned: list[str] = field(default_factory=list)
    """Readings pinned from the probes tab, each drawn in a plot of its own."""

    def next_smoothing(self) -> None:
        self.smoothing = SMOOTHINGS[(SMOOTHINGS.index(self.smoothing) + 1) % len(SMOOTHINGS)]

    def next_x_axis(self) -> None:
        self.x_axis = X_AXES[(X_AXES.index(self.x_axis) + 1) % len(X_AXES)]

    @property
    def key(self) -> tuple[Any, ...]:
        return self.smoothing, self.x_axis, self.log_y, self.cursor, tuple(self.pinned)


def smooth(values: Sequence[float], weight: float) -> list[float]:
    """The debiased exponential moving average (TensorBoard's and W&B's smoothing); a NaN reading
    stays NaN and leaves the average as it was."""
    if weight <= 0:
        return list(values)
    smoothed, average, seen = [], 0.0, 0
    for value in values:
        if not math.isfinite(value):
            smoothed.append(math.nan)
            continue
        average = average * weight + (1 - weight) * value
        seen += 1
        smoothed.append(average / (1 - weight**seen))
    return smoothed


def axis_values(axis: str, update: Sequence[float], tokens: Sequence[float], time: Sequence[float], origin: float) -> list[float]:
    """The x of each row on `axis` (time: seconds since `origin`)."""
    if axis == "update":
        return [float(value) for value in update]
    if axis == "tokens":
        return list(tokens)
    return [value - origin for value in time]


def x_label(axis: str, value: float) -> str:
    if axis == "time":
        return duration(value)
    return fmt.count(value) if axis == "tokens" else f"{value:.0f}"


def duration(seconds: float) -> str:
    """Seconds as h:mm (or m:ss under an hour): the time axis and the cursor's time."""
    if not math.isfinite(seconds):
        return "—"
    whole = int(max(0.0, seconds))
    hours, rest = divmod(whole, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


@dataclass(frozen=True)
class Trace:
    """One source of rows along the x axis: its xs and its readings by name."""

    xs: list[float]
    columns: dict[str, Sequence[float]]
    update: Sequence[float]
    tokens: Sequence[float]
    time: Sequence[float]

    def nearest(self, x: float) -> int | None:
        """The index of the row nearest `x` (rows in x order), None when there is none."""
        if not self.xs:
            return None
        index = bisect.bisect_left(self.xs, x)
        candidates = [i for i in (index - 1, index) if 0 <= i < len(self.xs) and math.isfinite(self.xs[i])]
        return min(candidates, key=lambda i: abs(self.xs[i] - x)) if candidates else None


@dataclass(frozen=True)
class CurveFrame:
    """What every plot of the tab draws for one state of the line and the settings."""

    line: Trace
    trunk: Trace | None
    """The trunk's rows up to the fork (a branch whose trunk history has arrived)."""
    x_range: tuple[float, float] | None
    markers: list[tuple[float, str]]
    """(x, kind) of every strip marker."""
    validations: list[tuple[float, float]]
    """(x, validation loss) of every validation."""
    pinned: dict[str, Trace]
    """Each pinned reading's points."""


def build_frame(
    line: LineView, settings: CurveSettings, trunk: History | None, pinned_rows: dict[str, History]
) -> CurveFrame:
    series = line.series
    times = [value for value in (*series.time[:1], *(trunk.time[:1] if trunk else ())) if math.isfinite(value)]
    origin = min(times) if times else 0.0
    axis = settings.x_axis

    def trace(update: Sequence[float], tokens: Sequence[float], time: Sequence[float], columns: dict[str, Sequence[float]]) -> Trace:
        return Trace(axis_values(axis, update, tokens, time, origin), columns, update, tokens, time)

    own = trace(series.update, series.tokens, series.time, {column: getattr(series, column) for column, _ in CURVES})
    trunk_trace = None if trunk is None else trace(trunk.update, trunk.tokens, trunk.time, trunk.values)

    def row_x(row: dict[str, Any]) -> float:
        value = row.get("time" if axis == "time" else axis)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return math.nan
        return float(value) - origin if axis == "time" else float(value)

    validations = [(row_x(row), validation_loss(row)) for row in line.validations]
    markers: list[tuple[float, str]] = [(x, "validation") for x, _ in validations]
    cycle = series.cycle
    markers += [(own.xs[i], "cycle") for i in range(len(cycle) - 1) if cycle[i + 1] > cycle[i]]
    timed = [(time, x) for time, x in zip(series.time, own.xs) if math.isfinite(time)]
    stamps = [time for time, _ in timed]
    for event in line.events:
        kind = "restart" if event.kind in RESTART_EVENTS else "rollback" if event.kind in ROLLBACK_EVENTS else None
        index = bisect.bisect_left(stamps, event.time)
        if kind is not None and stamps and stamps[0] <= event.time and index < len(timed):
            markers.append((timed[index][1], kind))
    pinned = {}
    for name in settings.pinned:
        history = pinned_rows.get(name)
        if history is not None:
            pinned[name] = trace(history.update, history.tokens, history.time, history.values)
        else:  # a validation reading: every validation row holds it
            rows = [row for row in line.validations if isinstance(row.get(name), (int, float))]
            values = {name: [float(row[name]) for row in rows]}
            pinned[name] = Trace([row_x(row) for row in rows], values, [], [], [])
    xs = [x for source in (own, trunk_trace) if source is not None for x in source.xs if math.isfinite(x)]
    x_range = (min(xs), max(xs)) if xs else None
    return CurveFrame(
        own, trunk_trace, x_range, markers, [(x, v) for x, v in validations if v is not None], pinned
    )


def frame_inputs(line: LineView) -> tuple[Any, ...]:
    """What `build_frame` reads of the line, as a value that changes when any of it does: its rows
    (a resume may rewrite the newest ones: the newest row is compared, not only the count), its
    validations and its events. Not its heartbeat or status, which change every second: the line's
    `version` would redraw every plot each time."""
    newest = line.recent_rows[-1] if line.recent_rows else None
    validation = line.validations[-1] if line.validations else None
    event = line.events[-1] if line.events else None
    return id(line.series), len(line.series), newest, len(line.validations), validation, len(line.events), event


class CurvePlot(Widget):
    """One curve of one line; `show(frame, settings)` redraws it when either changed."""

    def __init__(self, column: str, title: str, pinned: bool = False, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.auto_links = False  # a plot has no links: Textual would unpack every cell's metadata looking for them
        self.column = column
        self.title = title
        self.pinned = pinned
        self.frame: CurveFrame | None = None
        self.settings = CurveSettings()
        self.grid: PlotGrid | None = None
        self.render_cost_s = 0.0
        self._strips: list[Strip] | None = None
        """CPU seconds its last render took (the curves tab paces redraws by it)."""

    def show(self, frame: CurveFrame, settings: CurveSettings) -> None:
        self.frame, self.settings = frame, settings
        self.refresh()

    @property
    def plot_width(self) -> int:
        return max(1, self.size.width - AXIS_WIDTH - 1)

    def layers(self) -> list[Layer]:
        """Trunk (dimmed), raw readings under a smoothed curve (dimmed), the curve."""
        frame, weight = self.frame, self.settings.smoothing
        assert frame is not None
        source = frame.pinned.get(self.column) if self.pinned else frame.line
        layers = []
        if frame.trunk is not None and self.column in frame.trunk.columns:
            layers.append(Layer(frame.trunk.xs, smooth(frame.trunk.columns[self.column], weight)))
        else:
            layers.append(Layer((), ()))
        values = [] if source is None else source.columns.get(self.column, [])
        xs = [] if source is None else source.xs
        layers.append(Layer(xs, values if weight > 0 else ()))
        layers.append(Layer(xs, smooth(values, weight)))
        return layers

    def refresh(self, *regions: Any, **kwargs: Any) -> Self:
        self._strips = None  # new readings, settings, size or theme: draw again at the next paint
        return super().refresh(*regions, **kwargs)

    def render(self) -> Text:
        """The plot as text (what `render_line` paints; Textual's Widget API, and the tests' view)."""
        return self._draw()

    def render_line(self, y: int) -> Strip:
        """A line of the plot, from strips drawn once a refresh. Textual's own path would convert the
        plot's Text into its Content and render that line by line at every paint: five times the
        drawing's own cost (bench/console_cpu.py's curves tab, profiled)."""
        if self._strips is None:
            started = time.thread_time()
            text = self._draw()
            base = self.rich_style
            lines = text.render(self.app.console).__iter__()
            self._strips = [
                Strip(Segment.apply_style(line, base)).adjust_cell_length(self.size.width, base)
                for line in Segment.split_lines(lines)
            ]
            self.render_cost_s = time.thread_time() - started
        if y < len(self._strips):
            return self._strips[y]
        return Strip.blank(self.size.width, self.rich_style)

    def _draw(self) -> Text:
        """The plot as text: its title, the curve with its axis labels, the marker strip, the x labels."""
        theme = self.app.current_theme
        settings, frame = self.settings, self.frame
        width, height = self.plot_width, max(1, self.size.height - CHROME_ROWS)
        scale = "log" if settings.log_y else "linear"
        smoothing = f", EMA {settings.smoothing}" if settings.smoothing else ""
        text = Text(f"{self.title}  [{scale}{smoothing}]\n", style="bold")
        grid = None
        if frame is not None and frame.x_range is not None:
            validations = frame.validations if self.column == "loss" and not self.pinned else []
            grid = draw_layers(
                self.layers(), width, height, settings.log_y,
                [x for x, _ in validations], [y for _, y in validations], frame.x_range,
            )
        self.grid = grid
        if grid is None or frame is None:
            text.append("no readings yet" if not settings.log_y else "nothing positive to draw on a log axis", style="dim")
            return text
        labels = {0: fmt.number(grid.y_high), height - 1: fmt.number(grid.y_low)}
        if height > 4:
            middle = (grid.y_high * grid.y_low) ** 0.5 if settings.log_y else (grid.y_high + grid.y_low) / 2
            labels[(height - 1) // 2] = fmt.number(middle)
        primary = theme.primary or ""
        layer_styles = ("dim", f"dim {primary}".strip(), primary)
        cursor = settings.cursor if settings.cursor is not None and settings.cursor < width else None
        # One span per run of a style (a span per character costs the console most of its CPU on this tab).
        for index, row in enumerate(grid.rows):
            text.append(f"{labels.get(index, ''):>{AXIS_WIDTH}}│", style="dim")
            start = len(text)
            owners = grid.layers[index]
            column = 0
            while column < width:
                owner, end = owners[column], column + 1
                while end < width and owners[end] == owner:
                    end += 1
                style = "" if owner == NO_LAYER else layer_styles[owner]
                text.append(row[column:end], style=style)
                column = end
            for marker_row, marker_column in grid.marker_cells:
                if marker_row == index:
                    text.stylize(theme.accent or "bold", start + marker_column, start + marker_column + 1)
            if cursor is not None:
                text.stylize("reverse", start + cursor, start + cursor + 1)
            text.append("\n")
        text.append(f"{'':>{AXIS_WIDTH}}├", style="dim")
        start = len(text)
        text.append(marker_strip(frame.markers, grid.x_low, grid.x_high, width), style=theme.accent or "")
        if cursor is not None:
            text.stylize("reverse", start + cursor, start + cursor + 1)
        unit = {"tokens": " tokens", "update": " updates", "time": " wall time"}[settings.x_axis]
        left, right = x_label(settings.x_axis, grid.x_low), x_label(settings.x_axis, grid.x_high) + unit
        gap = max(1, width - len(left) - len(right))
        text.append(f"\n{'':>{AXIS_WIDTH}}└{left}{' ' * gap}{right}", style="dim")
        return text


def marker_strip(markers: Sequence[tuple[float, str]], x_low: float, x_high: float, width: int) -> str:
    """The row under a plot: each marker's glyph at its cell (the later kind of `MARKER_GLYPHS` wins)."""
    cells = [" "] * width
    ranks = [-1] * width
    order = list(MARKER_GLYPHS)
    for x, kind in markers:
        if not (math.isfinite(x) and x_low <= x <= x_high):
            continue
        column = cell_column(x, x_low, x_high, width)
        rank = order.index(kind)
        if rank > ranks[column]:
            cells[column], ranks[column] = MARKER_GLYPHS[kind], rank
    return "".join(cells)


def cursor_readout(frame: CurveFrame | None, settings: CurveSettings, width: int) -> Text:
    """Every curve's reading at the cursor's column (what the line below the plots says)."""
    legend = "◇ validation  ┆ cycle end  ↻ restart  ↶ rollback"
    text = Text()
    if frame is None or frame.x_range is None or settings.cursor is None:
        text.append("←/→ cursor  m smoothing  x x axis  l log y   " + legend, style="dim")
        return text
    x = column_x(settings.cursor, *frame.x_range, width)
    sources = [("", frame.line)] + ([("trunk ", frame.trunk)] if frame.trunk is not None else [])
    # The row nearest the cursor: the branch's own, or its trunk's before the fork.
    label, source, index = min(
        ((label, source, source.nearest(x)) for label, source in sources if source.nearest(x) is not None),
        key=lambda found: abs(found[1].xs[found[2]] - x),  # type: ignore[index]
        default=("", None, None),
    )
    if source is None or index is None:
        text.append("no row at the cursor", style="dim")
        return text
    text.append(f"▸ {label}update {source.update[index]:.0f}  tokens {fmt.count(source.tokens[index])}", style="bold")
    text.append(f"  time {duration(source.time[index] - _time_origin(frame))}  │", style="bold")
    for column, title in CURVES:
        values = source.columns.get(column)
        if values is None:
            continue
        text.append(f"  {title.split(' (')[0]} {fmt.number(values[index])}")
        if settings.smoothing:
            text.append(f" (EMA {fmt.number(smooth(values[: index + 1], settings.smoothing)[-1])})", style="dim")
    for name, trace in frame.pinned.items():
        near = trace.nearest(x)
        text.append(f"  {name} {'—' if near is None else fmt.number(trace.columns[name][near])}")
    return text


def _time_origin(frame: CurveFrame) -> float:
    """The wall time the time axis counts from (its first row's)."""
    times = [value for source in (frame.trunk, frame.line) if source is not None for value in source.time[:1]]
    finite = [value for value in times if math.isfinite(value)]
    return min(finite) if finite else math.nan
