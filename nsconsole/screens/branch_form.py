"""`b`: the branch form. A branch forks a new line from this one at the end of a data cycle; a
fork asked for a cycle that has not ended yet waits and happens at that cycle's end.

On submit the form checks the request with the engine's own checks (`engine.ops.branch.
preview_branch`, reading the line's files as `nsconsole branch` does): what the supervisor would
refuse (a fork past the end of the trunk's data, a plan longer than the branch's data, ...) is
said in the form at once, and the confirmation names the tokens each stage will train.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static

from engine.layout import LineLayout


@dataclass(frozen=True)
class BranchRequest:
    """What the form asks the supervisor's `branch` for."""

    path: str
    """The new line's directory."""
    at_cycle: int
    """The data cycle at whose end the branch forks."""
    plan: str
    """The branch's plan, e.g. `decay:10e9,long:2e9` (what `nsconsole branch --plan` takes)."""
    data: str
    """The branch's own data line (the trunk's is consumed as it trains)."""
    stages: str = ""
    """The stages as the branch will train them (`engine.ops.branch.describe_stages`); empty where the
    console could not read the line (the supervisor checks the request all the same)."""

    def params(self) -> dict[str, object]:
        return {"path": self.path, "at_cycle": self.at_cycle, "plan": self.plan, "data": self.data}


def parse_branch(path: str, at_cycle: str, plan: str, data: str) -> BranchRequest:
    """The form's text as a request; `ValueError` with a message naming the field that is wrong."""
    path = path.strip()
    if not path:
        raise ValueError("new line: give the branch's directory")
    try:
        cycle = int(at_cycle.strip())
    except ValueError:
        raise ValueError(f"at the end of cycle: a whole number, got {at_cycle.strip()!r}") from None
    if cycle < 0:
        raise ValueError(f"at the end of cycle: must be >= 0, got {cycle}")
    if not plan.strip():
        raise ValueError("plan: give the branch's stages, e.g. decay:10e9,long:2e9")
    if not data.strip():
        raise ValueError("data line: give the branch's own data line directory")
    return BranchRequest(path=path, at_cycle=cycle, plan=plan.strip(), data=data.strip())


def preview_stages(line_path: str, request: BranchRequest) -> str:
    """The stages the branch will train, exact tokens (`decay at 16 for 112 tokens (100 asked, rounded
    up to 7 whole rows of 16)`); ValueError with the refusal the supervisor would give; empty when
    this console cannot read the line's run.json (the supervisor is the one that checks then).

    Paths are taken as the supervisor takes them (`sent_path`), so the data line checked here is the
    one it will fork on. Loads the data line readers (numpy, pyarrow) on the first use only."""
    trunk = Path(line_path)
    if not LineLayout(trunk).run_json.is_file():
        return ""
    from datalines.errors import DataLineError
    from engine.errors import LineError
    from engine.ops.branch import BranchRequest as Fork
    from engine.ops.branch import describe_stages, parse_plan, preview_branch, sent_path

    fork = Fork(new=sent_path(request.path, trunk), parent=trunk, at_cycle=request.at_cycle,
                plan=request.plan, data=sent_path(request.data, trunk))  # fmt: skip
    try:
        config = preview_branch(fork)
    except (LineError, DataLineError) as refusal:
        raise ValueError(str(refusal)) from None
    return "; ".join(describe_stages(parse_plan(request.plan), config.plan))


class BranchForm(ModalScreen[BranchRequest | None]):
    """Dismissed with the request, or None (Cancel, Escape)."""

    BINDINGS = [Binding("escape", "cancel", "Cancel", id="branch.cancel")]
    AUTO_FOCUS = "#path"
    """The first field has the focus from the start (its text selected: typing replaces it)."""

    def __init__(
        self, line_name: str, line_path: str, current_cycle: int | None, draft: BranchRequest | None = None
    ) -> None:
        """`draft`: the request last sent and not taken (refused, or No at its confirmation): the
        fields start as it was typed, so one mistake does not cost the whole form."""
        super().__init__()
        self.line_name = line_name
        self.line_path = line_path
        self.current_cycle = current_cycle or 0
        self.draft = draft
        self._offered_cycle = draft.at_cycle if draft is not None else self.current_cycle
        """The cycle whose `NAME-cN` the path field was last given (`on_input_changed`)."""
        self.typed: BranchRequest | None = None
        """After Cancel or Escape: the fields as typed, where they differ from what the form opened
        with (the next `b` reopens them: a refusal shown in the form, then Escape, lost them all)."""
        self._opened_with: dict[str, str] = {}

    def _suggested_path(self, cycle: int) -> str:
        """The new line's directory the form offers for a fork at `cycle`: beside the trunk, `NAME-cN`."""
        return str(Path(self.line_path).with_name(f"{self.line_name}-c{cycle}"))

    def compose(self) -> ComposeResult:
        draft = self.draft or BranchRequest(self._suggested_path(self.current_cycle), self.current_cycle, "", "")
        # A label beside each field: the form fits 80x24; a smaller terminal scrolls it.
        with Vertical():
            yield Static(f"Branch {self.line_path}", classes="question")
            with Horizontal(classes="field"):
                yield Label("new line (directory)")
                yield Input(draft.path, id="path")
            with Horizontal(classes="field"):
                yield Label(f"at the end of cycle (now {self.current_cycle})")
                yield Input(str(draft.at_cycle), id="at_cycle", type="integer")
            with Horizontal(classes="field"):
                yield Label("plan (e.g. decay:10e9,long:2e9)")
                yield Input(draft.plan, id="plan")
            with Horizontal(classes="field"):
                yield Label("data line (its own directory)")
                yield Input(draft.data, id="data")
            self._opened_with = {"path": draft.path, "at_cycle": str(draft.at_cycle), "plan": draft.plan,
                                 "data": draft.data}  # fmt: skip
            yield Static("", id="error", markup=False)  # a refusal names paths, which may hold brackets
            with Horizontal(classes="buttons"):
                yield Button("Branch", id="submit", variant="warning")
                yield Button("Cancel", id="cancel", variant="primary")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        if event.button.id == "submit":
            self._submit()
        else:
            self.action_cancel()

    def on_input_changed(self, event: Input.Changed) -> None:
        """The offered directory follows the cycle typed (a fork at cycle 5 is not `NAME-c1`), as long
        as the directory is the one offered for the cycle before: one typed by hand is left alone."""
        if event.input.id != "at_cycle":
            return
        path = self.query_one("#path", Input)
        try:
            cycle = int(event.value)
        except ValueError:
            return  # half typed: the offer waits for a number
        offered = {self._suggested_path(earlier) for earlier in (self.current_cycle, self._offered_cycle)}
        if path.value in offered:
            path.value = self._suggested_path(cycle)
        self._offered_cycle = cycle

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self._submit()

    def _values(self) -> dict[str, str]:
        return {name: self.query_one(f"#{name}", Input).value for name in ("path", "at_cycle", "plan", "data")}

    def _submit(self) -> None:
        values = self._values()
        try:
            request = parse_branch(**values)
            request = dataclasses.replace(request, stages=preview_stages(self.line_path, request))
        except ValueError as error:
            self.query_one("#error", Static).update(f"✗ {error}")
            return
        self.dismiss(request)

    def action_cancel(self) -> None:
        values = self._values()
        if values != self._opened_with:
            try:
                cycle = int(values["at_cycle"].strip())
            except ValueError:  # half typed: the cycle the path was offered for
                cycle = self._offered_cycle
            self.typed = BranchRequest(values["path"], cycle, values["plan"], values["data"])
        self.dismiss(None)
