"""A yes/no question before any change to a line; No has the focus, Escape answers No. ← and →
move the focus between Yes (left) and No (right), as the buttons lie: Enter answers the focused one."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Static


class ConfirmScreen(ModalScreen[bool]):
    """Dismissed with True only by Yes (the button or `y`)."""

    BINDINGS = [
        Binding("escape", "answer(False)", "No", id="confirm.no"),
        Binding("n", "answer(False)", "No", show=False, id="confirm.n"),
        Binding("y", "answer(True)", "Yes", id="confirm.yes"),
        Binding("left", "focus_answer('yes')", "Yes", show=False, id="confirm.left"),
        Binding("right", "focus_answer('no')", "No", show=False, id="confirm.right"),
    ]

    def __init__(self, question: str, detail: str = "") -> None:
        super().__init__()
        self.question = question
        self.detail = detail

    def compose(self) -> ComposeResult:
        with Vertical():
            # Not markup: a path may hold brackets.
            yield Static(self.question, classes="question", markup=False)
            if self.detail:
                yield Static(self.detail, classes="detail", markup=False)
            with Horizontal():
                yield Button("Yes", id="yes", variant="warning")
                yield Button("No", id="no", variant="primary")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss(event.button.id == "yes")

    def action_focus_answer(self, button: str) -> None:
        # At once, not as `Widget.focus` does (after the keys already read): an Enter in the same
        # terminal read as this ← or → must press the button it moved to, not the one before.
        self.set_focus(self.query_one(f"#{button}", Button))

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)
