"""The samples tab (issue 23 item 5) on frozen data: each validation's samples, newest first, the
prompt dimmed, and a new validation shown when it arrives."""

from __future__ import annotations

import asyncio

from helpers.console import NOW, console, frozen_book, settle
from rich.text import Text
from textual.widgets import Static

from nsconsole.screens.line import LineScreen
from nsconsole.state import LineView
from nsconsole.widgets.samples_tab import SHOWN_VALIDATIONS, samples_text, visible

PROMPT = "def train(model, rows):"


def validation_with_samples(update: int, texts: list[str]) -> dict:
    """A validation row as the trainer writes it: losses, then `samples`."""
    samples = [{"source": f"source{index}", "prompt": PROMPT, "text": text} for index, text in enumerate(texts)]
    return {"update": update, "tokens": update * 512, "seq_len": 64, "val_64/mix": 3.0 + 1 / update,
            "samples": samples}  # fmt: skip


def shown(app) -> Text:
    content = app.screen.query_one("#samples-text", Static).content
    assert isinstance(content, Text)
    return content


def dimmed(text: Text, part: str) -> bool:
    """Whether `part` of `text` lies inside a dim span."""
    start = text.plain.index(part)
    return any(span.start <= start and start + len(part) <= span.end and "dim" in str(span.style)
               for span in text.spans)  # fmt: skip


def test_the_samples_tab_shows_each_validations_samples_newest_first_and_follows_new_ones() -> None:
    book = frozen_book()
    line = next(line for line in book if line.name == "pssa-trunk")
    # Pushed as the supervisor pushes them, after the frozen rows (updates 1..500).
    line.apply_notification("validation", validation_with_samples(600, ["\n    return 1", " pass"]), NOW)
    line.apply_notification("validation", validation_with_samples(700, ["\n    return loss", " yield\x1b[2J"]), NOW)
    app = console(book=book)

    async def scenario() -> None:
        async with app.run_test(size=(150, 40)) as pilot:
            await settle(pilot)
            await pilot.press("down", "enter")  # the PSSA line
            assert isinstance(app.screen, LineScreen) and app.screen.line is line
            app.screen.query_one("TabbedContent").active = "tab-samples"
            await pilot.pause()
            text = shown(app)
            plain = text.plain
            assert plain.index("update 700") < plain.index("update 600")  # newest first
            assert f"source0 ▸ {PROMPT}\n    return loss" in plain
            assert f"source1 ▸ {PROMPT} yield␛[2J" in plain  # an escape sequence cannot reach the terminal
            assert "\x1b" not in plain
            assert dimmed(text, PROMPT) and not dimmed(text, "return loss")
            assert "update 500" not in plain  # the frozen validations carry no samples

            line.apply_notification("validation", validation_with_samples(800, ["\n    return best"]), NOW)
            app.refresh_views()
            await pilot.pause()
            plain = shown(app).plain
            assert plain.index("update 800") < plain.index("update 700")
            assert "return best" in plain

    asyncio.run(scenario())


def test_a_line_without_samples_says_where_they_come_from() -> None:
    line = LineView("id", "/srv/runs/ns-probe")
    line.apply_rows([{"update": 100, "seq_len": 64, "val_64/mix": 3.2}], 0)
    assert "no samples yet" in samples_text(line).plain


def test_the_tab_keeps_to_the_newest_validations_and_skips_malformed_samples() -> None:
    line = LineView("id", "/srv/runs/pssa-trunk")
    rows = [validation_with_samples(update, [f" text of {update}"]) for update in range(1, SHOWN_VALIDATIONS + 3)]
    rows.append({"update": 999, "val_64/mix": 3.0, "samples": [{"source": "text", "prompt": 3}, "junk"]})
    line.apply_rows(rows, 0)
    plain = samples_text(line).plain
    assert "text of 3" in plain and "text of 2\n" not in plain and "update 999" not in plain
    assert plain.rstrip().endswith("2 earlier validations with samples are in rows.jsonl")


def test_control_characters_become_visible_but_line_breaks_and_tabs_stay() -> None:
    assert visible("a\x00b\rc\x7f\x9b\n\td") == "a␀b␍c␡\ufffd\n\td"



def test_a_sample_the_models_logits_stopped_says_why_after_its_text() -> None:
    line = LineView("id", "/srv/runs/diverged")
    row = validation_with_samples(7, [" fine", " cut"])
    row["samples"][1]["stopped"] = "the model's next-token logits hold 3 NaN or infinite values of 300 after 2 tokens"
    line.apply_rows([row], 0)
    plain = samples_text(line).plain
    assert f"source0 ▸ {PROMPT} fine\n" in plain
    assert f"source1 ▸ {PROMPT} cut [stopped: the model's next-token logits hold 3 NaN" in plain
