"""The memory tab of a PSSA line: its memory banks per block, and its model-wide memory probes.

Per block, from the latest validation's `val_<L>/pssa/block<NN>/<reading>` probes: the bank's
occupancy as a bar, slot confidence (mean, min) and age in optimizer updates (mean, max) over the
occupied slots, and the cumulative writes, overwrites and defended writes, each with its change
since the validation before ("since the last look"). Below, the model-wide probes
(`pssa/memory_occupancy`, `pssa/read_entropy`, `pssa/ssm_tau_p50`, `pssa/ssm_tau_max`) with their
latest value, change and history as a sparkline.
"""

from __future__ import annotations

import re
from typing import Any

from rich.text import Text
from textual.widgets import Static

from nsconsole.state import LineView
from nsconsole.widgets import format as fmt
from nsconsole.widgets.plot import sparkline

HISTORY_WIDTH = 40
OCCUPANCY_BAR_WIDTH = 20

DESCRIPTIONS = {
    "memory_occupancy": "filled share of the memory slots (mean over the blocks)",
    "read_entropy": "entropy of the memory read weights (nats; low: reads one slot)",
    "ssm_tau_p50": "median SSM e-fold length (tokens)",
    "ssm_tau_max": "longest SSM e-fold length (tokens)",
}

_BLOCK_READING = re.compile(r"^val_(?P<length>[^/]+)/pssa/block(?P<block>\d+)/(?P<name>[a-z_]+)$")
"""A per-block bank probe. EMA twins (`ema/val_...`) are left out: they describe another model."""

COUNTERS = ("writes", "overwrites", "defended")
"""Cumulative per-block counts, shown with their change since the validation before."""


def block_readings(row: dict[str, Any]) -> dict[int, dict[str, float]]:
    """A validation row's per-block bank probes: block index -> reading name -> value.

    Probes never change the bank, so every validation length of one row reads the same bank;
    the row's training length is preferred and another length serves when it is missing.
    """
    by_length: dict[str, dict[int, dict[str, float]]] = {}
    for key, value in row.items():
        match = _BLOCK_READING.match(key)
        if match is None or not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        blocks = by_length.setdefault(match["length"], {})
        blocks.setdefault(int(match["block"]), {})[match["name"]] = float(value)
    if not by_length:
        return {}
    preferred = str(row.get("seq_len"))
    return by_length[preferred] if preferred in by_length else by_length[min(by_length)]


def memory_history(line: LineView) -> dict[str, list[float | None]]:
    """Every model-wide `pssa/` reading's value at each validation (None where that one lacks it)."""
    names = sorted({
        key for row in line.validations for key in row if "pssa/" in key and _BLOCK_READING.match(key) is None
    })  # fmt: skip
    return {
        name: [row.get(name) if isinstance(row.get(name), (int, float)) else None for row in line.validations]
        for name in names
    }


def latest_two_with_blocks(line: LineView) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The newest validation row with per-block probes and the one with them before it."""
    found = [row for row in reversed(line.validations) if block_readings(row)][:2]
    return (found[0] if found else None, found[1] if len(found) > 1 else None)


def occupancy_bar(share: float | None, width: int = OCCUPANCY_BAR_WIDTH) -> str:
    """`████░░░░  50.0%`: the filled share of a bank, readable without colour."""
    if share is None:
        return f"{'':<{width}} {'—':>6}"
    filled = round(max(0.0, min(1.0, share)) * width)
    return f"{'█' * filled}{'░' * (width - filled)} {share:>6.1%}"


def _change(now: float | None, before: float | None) -> str:
    if now is None or before is None:
        return ""
    return fmt.signed(now - before, digits=6)


class MemoryTab(Static):
    """`show(line)` redraws the tab."""

    def show(self, line: LineView) -> None:
        self.update(self.render_text(line))

    def render_text(self, line: LineView) -> Text:
        history = memory_history(line)
        latest, before = latest_two_with_blocks(line)
        if not history and latest is None:
            return Text("no memory probes yet: they come with the first validation", style="dim")
        text = Text()
        if latest is not None:
            self._append_blocks(text, latest, before)
        if history:
            self._append_model_wide(text, history)
        return text

    def _append_blocks(self, text: Text, latest: dict[str, Any], before: dict[str, Any] | None) -> None:
        now_blocks = block_readings(latest)
        then_blocks = block_readings(before) if before is not None else {}
        since = "no validation before"
        if before is not None:
            since = f"changes since update {before.get('update')}"
        text.append(f"memory banks at update {latest.get('update')} ({since})\n", style="bold")
        counter_heads = "".join(f"  {name:>10}  {'since':>10}" for name in COUNTERS)
        text.append(
            f"{'block':>5}  {'occupancy':<{OCCUPANCY_BAR_WIDTH + 7}}  {'conf mean':>9}  {'conf min':>8}"
            f"  {'age mean':>8}  {'age max':>8}{counter_heads}\n",
            style="bold",
        )
        for block, now in sorted(now_blocks.items()):
            then = then_blocks.get(block, {})
            label = f"{block:02d}"
            text.append(
                f"{label:>5}  {occupancy_bar(now.get('occupancy'))}"
                f"  {fmt.number(now.get('confidence_mean'), 3):>9}"
                f"  {fmt.number(now.get('confidence_min'), 3):>8}"
                f"  {fmt.number(now.get('age_mean'), 4):>8}"
                f"  {fmt.number(now.get('age_max'), 4):>8}"
            )
            for name in COUNTERS:
                text.append(f"  {fmt.count(now.get(name)):>10}  {_change(now.get(name), then.get(name)):>10}")
            text.append("\n")
        text.append(
            "confidence: a slot's resistance to being overwritten (1 when written); age: optimizer updates "
            "since a slot was written or defended\n\n",
            style="dim",
        )

    def _append_model_wide(self, text: Text, history: dict[str, list[float | None]]) -> None:
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
