"""`?`: every key of the screen below, with its binding id and what it does; a key that is off
there says why where the console knows (read-only, no supervisor attached, not a PSSA line...)."""

from __future__ import annotations

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

KeyHelp = tuple[str, str, str, bool]
"""(key, binding id, description, enabled now)."""


class HelpScreen(ModalScreen[None]):
    """Lists the keys it was given; any of Escape, `?` or `q` closes it."""

    BINDINGS = [
        Binding("escape", "close", "Close", id="help.close"),
        Binding("question_mark", "close", "Close", show=False, id="help.close_again"),
        Binding("q", "close", "Close", show=False, id="help.close_q"),
    ]

    def __init__(self, title: str, keys: list[KeyHelp], off_reasons: dict[str, str] | None = None) -> None:
        """`off_reasons`: why a key that is off is off, by binding id."""
        super().__init__()
        self.title_text = title
        self.keys = keys
        self.off_reasons = off_reasons or {}

    def compose(self) -> ComposeResult:
        table = Table(box=None, expand=True, show_edge=False)
        table.add_column("key", style="bold", no_wrap=True)
        table.add_column("id", style="dim", no_wrap=True)
        table.add_column("does")
        for key, binding_id, description, enabled in self.keys:
            reason = self.off_reasons.get(binding_id)
            off = "(off here)" if reason is None else f"(off here: {reason})"
            table.add_row(key, binding_id, description if enabled else f"{description} {off}")
        with Vertical():
            yield Static(self.title_text, classes="question")
            with VerticalScroll(id="keys"):
                yield Static(table)
            yield Static("The command palette (ctrl+p) runs the same actions by name.", classes="detail")

    def action_close(self) -> None:
        self.dismiss(None)
