"""The probes tab: every reading of the latest validation, with its change since the one before.

A reading is any number in a validation row other than the row's own bookkeeping (update,
tokens, time...): the validation losses (`val_<L>/...`, `ema/val_...`), the model's probes and
the optimizer summaries (`opt/...`). The change carries ▲/▼, not only a colour.
"""

from __future__ import annotations

import re
from typing import Any

from rich.text import Text
from textual.widgets import DataTable

from nsconsole.state import LineView
from nsconsole.widgets import format as fmt

BOOKKEEPING = frozenset({
    "update", "tokens", "data_tokens", "cycle", "stage", "seq_len", "time", "lr", "weight_decay",
    "tokens_per_update", "skipped", "loss", "grad_norm", "tokens_per_s",
})
"""Row keys that are not validation readings."""

_LOSS_READING = re.compile(r"^(ema/)?val_[^/]+/[^/]+$")
"""A validation loss (`val_<L>/<source>`, `/mix`, `/mean`, and their EMA twins): lower is better."""


def probe_readings(row: dict[str, Any]) -> dict[str, float]:
    """The readings of a validation row, by name (training-row keys and grad norms left out)."""
    return {
        key: float(value)
        for key, value in row.items()
        if key not in BOOKKEEPING
        and not key.startswith("train/")
        and isinstance(value, (int, float))
        and not isinstance(value, bool)
    }


def probe_changes(latest: dict[str, Any], before: dict[str, Any] | None) -> list[tuple[str, float, float | None]]:
    """(name, value, change since `before` or None) for every reading of `latest`, by name."""
    now = probe_readings(latest)
    then = probe_readings(before) if before is not None else {}
    return [(name, value, value - then[name] if name in then else None) for name, value in sorted(now.items())]


class ProbeTable(DataTable):
    """The latest validation's readings; `show(line)` redraws when a new validation arrives."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(cursor_type="row", **kwargs)  # type: ignore[arg-type]
        self._shown: tuple[int, int] | None = None

    def on_mount(self) -> None:
        self.add_column("reading", key="name")
        self.add_column("value", key="value")
        self.add_column("change", key="change")

    def show(self, line: LineView) -> None:
        validations = line.validations
        marker = (len(validations), validations[-1].get("update", -1) if validations else -1)
        if marker == self._shown:
            return
        self._shown = marker
        self.clear()
        if not validations:
            self.border_subtitle = "no validation yet"
            return
        latest = validations[-1]
        before = validations[-2] if len(validations) > 1 else None
        theme = self.app.current_theme
        self.border_subtitle = f"validation at update {latest.get('update')}" + (
            f", change since update {before.get('update')}" if before is not None else ""
        )
        for name, value, change in probe_changes(latest, before):
            if change is None:
                change_text = Text("new", style="dim")
            else:
                # A lower loss is better; for other readings a change is only a change.
                better = change < 0 if _LOSS_READING.match(name) else None
                style = "" if better is None or change == 0 else theme.success if better else theme.warning
                change_text = Text(fmt.signed(change), style=style or "", justify="right")
            self.add_row(name, Text(fmt.number(value, 5), justify="right"), change_text, key=name)
