"""The samples tab: what the model wrote at each validation, newest first.

Each validation row's `samples` (engine/training/samples.py: the trainer generates them at every
validation, run.json `validation.samples`): the update and its validation loss, then each sample's
source, its prompt dimmed and the generated text plain after it. The prompts are the same at every
validation, so reading down the tab shows the same prompts continued by an ever better model.

A young model writes any bytes at all: control characters are shown as their Unicode control
pictures (`␀`, `␍`, ...), so a sample can never move the terminal's cursor or clear the screen.
Line breaks stay line breaks (a model of code writes them).
"""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from engine.config.run import SAMPLES_KEY
from nsconsole.state import LineView, validation_loss
from nsconsole.widgets import format as fmt

SHOWN_VALIDATIONS = 32
"""The newest validations whose samples the tab shows (older ones stay in rows.jsonl)."""

_CONTROL_PICTURES = {code: chr(0x2400 + code) for code in range(0x20) if chr(code) not in "\n\t"}
_CONTROL_PICTURES[0x7F] = "\u2421"  # ␡
_CONTROL_PICTURES.update({code: "\ufffd" for code in range(0x80, 0xA0)})  # C1 controls: no pictures
_VISIBLE = str.maketrans(_CONTROL_PICTURES)


def visible(text: str) -> str:
    """`text` with its control characters (but line breaks and tabs) as visible symbols."""
    return text.translate(_VISIBLE)


def row_samples(row: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """A validation row's samples as (source, prompt, text, why it stopped early or '');
    malformed entries are left out."""
    samples = row.get(SAMPLES_KEY)
    if not isinstance(samples, list):
        return []
    return [
        (str(sample.get("source", "")), sample["prompt"], sample["text"], str(sample.get("stopped", "")))
        for sample in samples
        if isinstance(sample, dict) and isinstance(sample.get("prompt"), str) and isinstance(sample.get("text"), str)
    ]


def samples_text(line: LineView, shown: int = SHOWN_VALIDATIONS) -> Text:
    """The tab's content: the newest `shown` validations with samples, newest first."""
    with_samples = [(row, samples) for row in reversed(line.validations) if (samples := row_samples(row))]
    if not with_samples:
        return Text(
            "no samples yet: each validation writes some (run.json validation.samples; "
            "a model without a decoder writes none)",
            style="dim",
        )
    text = Text()
    for row, samples in with_samples[:shown]:
        text.append(f"update {row.get('update')}", style="bold")
        text.append(f"  val {fmt.number(validation_loss(row))}\n", style="dim")
        for source, prompt, generated, stopped in samples:
            text.append(f"{source} ▸ ", style="bold dim")
            text.append(visible(prompt), style="dim")
            text.append(visible(generated))
            if stopped:
                text.append(f" [stopped: {visible(stopped)}]", style="bold")
            text.append("\n")
        text.append("\n")
    left_out = len(with_samples) - shown
    if left_out > 0:
        text.append(f"{left_out} earlier validations with samples are in rows.jsonl\n", style="dim")
    return text


class SamplesTab(VerticalScroll):
    """`show(line)` redraws the samples when the line's validations changed."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._drawn: tuple[int, dict[str, Any] | None] | None = None
        """What was drawn from: the number of validations and the newest one (held, so that its
        identity cannot pass to a row that replaced it)."""

    def compose(self) -> ComposeResult:
        yield Static(id="samples-text")

    def show(self, line: LineView) -> None:
        validations = line.validations
        newest = validations[-1] if validations else None
        if self._drawn is not None and self._drawn[0] == len(validations) and self._drawn[1] is newest:
            return
        self._drawn = (len(validations), newest)
        self.query_one("#samples-text", Static).update(samples_text(line))
