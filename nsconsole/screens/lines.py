"""The lines screen: every line on this host, the GPUs under it; Enter opens a line."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import DataTable, Header, Input, Static

from nsconsole.state import LineBook, LineView
from nsconsole.widgets import format as fmt
from nsconsole.widgets.gpu_panel import GpuPanel
from nsconsole.widgets.keys_footer import KeysFooter
from nsconsole.widgets.lines_table import LinesTable
from nsconsole.widgets.request_progress import RequestProgress

NO_LINES = (
    "No line is running on this host. Start one with `nsconsole --run` (the demo line) or "
    "`nsconsole run LINE`; it appears here within seconds."
)


def matches(line: LineView, text: str) -> bool:
    """The filter: every word appears in the line's name, path, kind, state or stage."""
    haystack = " ".join((line.name, line.path, line.kind, line.display_state, line.plan_stage or "")).lower()
    return all(word in haystack for word in text.lower().split())


def selection_title(line: LineView | None) -> str:
    """The table's title: the line the keys act on, by its (short) path, and a branch's parent."""
    if line is None:
        return "lines"
    parent = "" if line.parent is None else f" · branch of {fmt.short_path(line.parent, 32)}"
    return f"lines · ▸ {fmt.short_path(line.path, 48)}{parent}"


class LinesScreen(Screen[None]):
    """See the module docstring."""

    BINDINGS = [
        # A priority binding, so the footer shows it over the table's own (hidden) enter.
        Binding("enter", "open_line", "Open", id="open", priority=True,
                tooltip="open the line: curves, probes, checkpoints, log, events"),
        Binding("slash", "filter", "Filter", key_display="/", id="filter",
                tooltip="show only lines whose name, path, state or stage has these words"),
        Binding("escape", "clear_filter", "Clear filter", show=False, id="clear_filter", tooltip="show every line"),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.filter_text = ""
        self._shared_names: set[str] = set()
        self._names_checked = 0
        """How many lines the book had when shared names were last looked for (it only grows)."""
        self._empty_message = NO_LINES
        self._title, self._subtitle = "lines", ""
        """The table's border title and subtitle as last set (see `refresh_view`)."""

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)
        yield Input(placeholder="filter lines: words in name, path, state or stage", id="filter")
        table = LinesTable(id="lines")
        table.border_title = self._title
        yield table
        yield Static(self._empty_message, id="empty")
        panel = GpuPanel(id="gpus")
        panel.border_title = "GPUs"
        yield panel
        yield RequestProgress(id="progress")
        yield KeysFooter()

    def on_mount(self) -> None:
        self.query_one(LinesTable).focus()

    @property
    def table(self) -> LinesTable:
        return self.query_one(LinesTable)

    def selected_line_key(self) -> str | None:
        return self.table.selected_key

    def refresh_view(self, now: float) -> None:
        app = self.app
        book = app.book  # type: ignore[attr-defined]
        shown = [line for line in book if matches(line, self.filter_text)] if self.filter_text else list(book)
        table = self.table
        table.show(shown, now)
        self._warn_of_shared_names(book)
        empty = self.query_one("#empty", Static)
        problem = app.live.problem if app.live is not None else None  # type: ignore[attr-defined]
        message = NO_LINES if problem is None else f"✗ cannot look for lines: {problem}"
        # Setting a text or a title repaints the widget (a text lays the screen out too), even
        # when it is the same: each is set only when it changes, so a quiet tick repaints nothing.
        if message != self._empty_message:
            self._empty_message = message
            empty.update(message)
        empty.set_class(not len(book) or problem is not None, "visible")
        subtitle = f"{len(shown)} of {len(book)}" if self.filter_text else f"{len(book)}"
        if subtitle != self._subtitle:
            self._subtitle = table.border_subtitle = subtitle
        key = table.selected_key
        selected = book.get(key) if key else None
        self._set_title(selection_title(selected))
        self.query_one(GpuPanel).show(app.gpu_reading, book, selected)  # type: ignore[attr-defined]

    def _set_title(self, title: str) -> None:
        if title != self._title:
            self._title = self.table.border_title = title

    def _warn_of_shared_names(self, book: LineBook) -> None:
        """A toast when two lines come to share a name (the table then shows each by its path)."""
        if len(book) == self._names_checked:
            return  # no line came: no name is newly shared
        self._names_checked = len(book)
        paths: dict[str, list[str]] = {}
        for line in book:
            paths.setdefault(line.name, []).append(line.path)
        shared = {name for name, named in paths.items() if len(named) > 1}
        for name in sorted(shared - self._shared_names):
            self.notify(f"⚠ {len(paths[name])} lines are named {name}: {', '.join(paths[name])}",
                        severity="warning", timeout=10)
        self._shared_names = shared

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self.app.open_line(event.row_key.value)  # type: ignore[attr-defined]

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        key = self.table.selected_key
        self._set_title(selection_title(self.app.book.get(key) if key else None))  # type: ignore[attr-defined]
        self.app.refresh_bindings()

    async def action_open_line(self) -> None:
        box = self.query_one("#filter", Input)
        if box.has_focus:
            await box.action_submit()
            return
        key = self.selected_line_key()
        if key is not None:
            self.app.open_line(key)  # type: ignore[attr-defined]

    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.add_class("visible")
        box.focus()

    def action_clear_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.value = ""
        box.remove_class("visible")
        self.table.focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        self.filter_text = event.value
        self.refresh_view(self.app.clock())  # type: ignore[attr-defined]

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        if not event.value:
            event.input.remove_class("visible")
        self.table.focus()
