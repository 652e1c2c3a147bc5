"""Pick one of a few options (when to stop, which checkpoint to roll back to, how to tune)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import OptionList, Static
from textual.widgets.option_list import Option


class PickerScreen(ModalScreen[str | None]):
    """Dismissed with the chosen option's id, or None (Escape)."""

    BINDINGS = [Binding("escape", "cancel", "Cancel", id="picker.cancel")]

    def __init__(
        self,
        question: str,
        options: list[tuple[str, str]],
        empty: str = "nothing to choose",
        unavailable: frozenset[str] = frozenset(),
    ) -> None:
        """`options` are (id, label) pairs, shown in order; those in `unavailable` are shown (their
        labels say why) but cannot be chosen."""
        super().__init__()
        self.question = question
        self.options = options
        self.empty = empty
        self.unavailable = unavailable  # (not `disabled`: a screen's own reactive, which would disable it)

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(self.question, classes="question")
            if self.options:
                yield OptionList(
                    *(Option(label, id=option_id, disabled=option_id in self.unavailable) for option_id, label in self.options)
                )
            else:
                yield Static(self.empty)

    def on_mount(self) -> None:
        for option_list in self.query(OptionList):
            option_list.focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        self.dismiss(event.option.id)

    def action_cancel(self) -> None:
        self.dismiss(None)
