"""Samples end to end (issue 23 item 5): a real supervisor trains a tiny CPU line whose
validations write samples to rows.jsonl; the console receives them and its samples tab shows
them, newest first, following the validations as they come."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from helpers.console import until
from helpers.lines import make_data_line, make_line
from helpers.supervise import kill_line_processes, start_supervisor
from textual.widgets import Static

from datalines import open_data_line
from datalines.preparer import prepare_cycle
from engine.config.run import SAMPLES_KEY
from engine.protocol.facts import Stage
from engine.supervisor.registry import line_id
from nsconsole.app import ConsoleApp
from nsconsole.screens.line import LineScreen
from nsconsole.state import LineView
from nsconsole.widgets.lines_table import LinesTable
from nsconsole.widgets.samples_tab import visible

pytestmark = pytest.mark.usefixtures("private_host")  # conftest: an empty host.json, a private runtime dir


def sampled_updates(line: LineView) -> list[int]:
    return [row["update"] for row in line.validations if row.get(SAMPLES_KEY)]


def written_samples(line_path: Path) -> dict[int, list[dict]]:
    """Each validation's samples as rows.jsonl holds them (complete lines only)."""
    written = {}
    for text in (line_path / "rows.jsonl").read_text().splitlines():
        row = json.loads(text)
        if SAMPLES_KEY in row:
            written[row["update"]] = row[SAMPLES_KEY]
    return written


@pytest.mark.slow
def test_samples_written_at_validation_reach_the_samples_tab(tmp_path: Path) -> None:
    # Only cycle 0 is prepared and no preparer runs: after it the trainer waits for data, alive,
    # until the test prepares cycle 1 (whose validations then come while the tab is open).
    data = make_data_line(tmp_path / "data_root", prepare=1)
    line_path = make_line(tmp_path, data, **{"validation.every_updates": 2, "wandb.mode": "disabled"})
    supervisor = start_supervisor(tmp_path, line_path, run_preparer=False)

    async def scenario() -> None:
        app = ConsoleApp(refresh_interval=0.2)
        async with app.run_test(size=(150, 40)) as pilot:
            line: LineView = await until(pilot, lambda: app.book.get(line_id(line_path)), "the line to appear")
            await until(pilot, lambda: sampled_updates(line), "a validation with samples")
            # The row must be in the table (a refresh tick after the line came) before Enter opens it.
            await until(pilot, lambda: line.key in app.screen.query_one(LinesTable).rows, "the line's row")
            await pilot.press("enter")
            await until(pilot, lambda: isinstance(app.screen, LineScreen), "the line's screen")
            app.screen.query_one("TabbedContent").active = "tab-samples"
            tab = app.screen.query_one("#samples-text", Static)

            def newest_on_top() -> int | None:
                """The line's newest validation with samples, when the tab shows it at the top with its
                first sample as rows.jsonl holds it."""
                updates = sampled_updates(line)
                if not updates:
                    return None
                sample = written_samples(line_path)[updates[-1]][0]
                plain = str(tab.content)
                on_top = plain.startswith(f"update {updates[-1]}") and visible(sample["prompt"] + sample["text"]) in plain
                return updates[-1] if on_top else None

            # Cycle 0 done (its validations all written), the trainer waits for cycle 1.
            await until(pilot, lambda: (line.heartbeat or {}).get("stage") == Stage.WAITING_DATA, "the data wait")
            first = await until(pilot, newest_on_top, "the samples of cycle 0's last validation in the tab")
            # Cycle 1's validations come while the tab is open: their samples come to the top.
            prepare_cycle(open_data_line(data), 1)
            later = await until(pilot, lambda: (update := newest_on_top()) is not None and update > first and update,
                                "a later validation's samples at the top")  # fmt: skip
            assert str(tab.content).index(f"update {later}") < str(tab.content).index(f"update {first}")

    try:
        asyncio.run(scenario())
    finally:
        supervisor.kill()  # what it wrote is all read: nothing to stop gracefully for
        supervisor.wait()
        kill_line_processes(tmp_path)
