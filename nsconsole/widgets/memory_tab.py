"""The memory tab of a PSSA line: its memory probes over the validations.

PSSA's probes (`pssa/memory_occupancy`, `pssa/read_entropy`, `pssa/ssm_tau_p50`,
`pssa/ssm_tau_max`, under each validation's prefix) are shown with their latest value, the
change since the validation before and their history as a sparkline.
"""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from nsconsole.state import LineState
from nsconsole.widgets import format as fmt
from nsconsole.widgets.plot import sparkline

HISTORY_WIDTH = 40

DESCRIPTIONS = {
    "memory_occupancy": "filled share of the memory slots (mean over the blocks)",
    "read_entropy": "entropy of the memory read weights (nats; low: reads one slot)",
    "ssm_tau_p50": "median SSM e-fold length (tokens)",
    "ssm_tau_max": "longest SSM e-fold length (tokens)",
}


def memory_history(line: LineState) -> dict[str, list[float | None]]:
    """Every `pssa/` reading's value at each validation (None where that validation lacks it)."""
    names = sorted({key for row in line.validations for key in row if "pssa/" in key})
    return {
        name: [row.get(name) if isinstance(row.get(name), (int, float)) else None for row in line.validations]
        for name in names
    }


class MemoryTab(Static):
    """`show(line)` redraws the table."""

    def show(self, line: LineState) -> None:
        self.update(self.render_text(line))

    def render_text(self, line: LineState) -> Text:
        history = memory_history(line)
        if not history:
            return Text("no memory probes yet: they come with the first validation", style="dim")
        text = Text()
        width = max(len(name) for name in history)
        text.append(f"{'probe':<{width}}  {'value':>10}  {'change':>12}  history\n", style="bold")
        for name, values in history.items():
            present = [value for value in values if value is not None]
            latest = present[-1] if present else None
            change = "" if len(present) < 2 else fmt.signed(present[-1] - present[-2])
            text.append(f"{name:<{width}}  {fmt.number(latest, 5):>10}  {change:>12}  ")
            text.append(sparkline(values, HISTORY_WIDTH), style=self.app.current_theme.primary or "")
            description = DESCRIPTIONS.get(name.rsplit("/", 1)[-1])
            if description:
                text.append(f"\n{'':<{width}}  {description}", style="dim")
            text.append("\n")
        return text
