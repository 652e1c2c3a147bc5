"""`j` on a line's screen: the line's run.json, indented, scrollable; Escape or `j` closes it.

It shows the file as the line screen last read it (run.json is replaced atomically, so a read is
always a whole file); a tune or an edit shows at the next read, within seconds.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from nsconsole.widgets.line_header import pretty_run_json


class RunConfigScreen(ModalScreen[None]):
    """See the module docstring."""

    BINDINGS = [
        Binding("escape", "close", "Close", id="run_json.close"),
        Binding("j", "close", "Close", show=False, id="run_json.close_again"),
    ]

    def __init__(self, path: str, text: str) -> None:
        super().__init__()
        self.path = path
        self.text = pretty_run_json(text)

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(self.path, classes="question")
            with VerticalScroll(id="run-json"):
                yield Static(self.text, markup=False, id="run-json-text")

    def action_close(self) -> None:
        self.dismiss(None)
