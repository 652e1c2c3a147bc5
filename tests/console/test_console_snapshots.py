"""Snapshot tests of every console screen, with the clock and the data frozen (no supervisor).

The lines come from `frozen_book()`: rows, validations, events and statuses fed through the
same `LineView` methods the live console uses; the GPUs from a frozen reading. Update the
stored SVGs with `pytest tests/test_console_snapshots.py --snapshot-update` after checking them.
"""

from __future__ import annotations

import pytest
from helpers.console import (
    NO_GPU,
    SIZE,
    console,
    frozen_book,
    settle,
)

from nsconsole import app as app_module
from nsconsole.screens.branch_form import BranchForm
from nsconsole.screens.confirm import ConfirmScreen
from nsconsole.state import LineBook


@pytest.fixture(autouse=True)
def only_the_first_readings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU and disks read once, at mount: a timed GPU reading (every 2 s) that landed while a
    loaded machine drew a snapshot added a 31st sample to the frozen utilisation history (seen in a
    CI run)."""
    monkeypatch.setattr(app_module, "GPU_INTERVAL_S", 3600.0)
    monkeypatch.setattr(app_module, "DISK_INTERVAL_S", 3600.0)






@pytest.mark.parametrize("theme", ["dark", "light", "colorblind"])
def test_the_lines_screen(snap_compare, theme: str) -> None:
    async def select_the_gpu_line(pilot) -> None:
        await settle(pilot)
        await pilot.press("down")  # the GPU panel splits memory for the selected line
        pilot.app.refresh_views()

    assert snap_compare(console(theme), terminal_size=SIZE, run_before=select_the_gpu_line)


def test_the_lines_screen_without_lines_or_gpu(snap_compare) -> None:
    assert snap_compare(console(book=LineBook(), reading=NO_GPU), terminal_size=SIZE, run_before=settle)


def test_the_line_screen_curves_and_their_log_axis(snap_compare) -> None:
    async def open_first(pilot) -> None:
        await settle(pilot)
        await pilot.press("enter", "l")
        pilot.app.refresh_views()

    assert snap_compare(console(), terminal_size=SIZE, run_before=open_first)


@pytest.mark.parametrize("tab", ["probes", "events", "memory"])
def test_the_line_screen_tabs(snap_compare, tab: str) -> None:
    async def open_tab(pilot) -> None:
        await settle(pilot)
        await pilot.press("down", "enter")  # the PSSA line
        pilot.app.screen.query_one("TabbedContent").active = f"tab-{tab}"
        await pilot.pause()
        pilot.app.refresh_views()

    # Only the memory tab's snapshot has per-block bank probes: the probes tab would list them all.
    book = frozen_book(memory_blocks=2) if tab == "memory" else None
    assert snap_compare(console(book=book), terminal_size=SIZE, run_before=open_tab)


@pytest.mark.parametrize("dialog", ["branch", "confirm"])
def test_the_dialogs(snap_compare, dialog: str) -> None:
    async def open_dialog(pilot) -> None:
        await settle(pilot)
        if dialog == "branch":
            await pilot.app.push_screen(BranchForm("pssa-trunk", "/srv/runs/pssa-trunk", 2))
        else:
            question = "Stop pssa-trunk at the end of cycle 2?"
            await pilot.app.push_screen(ConfirmScreen(question, "It stops with a checkpoint."))

    assert snap_compare(console(), terminal_size=SIZE, run_before=open_dialog)


def test_the_help_screen_lists_every_key_with_its_id(snap_compare) -> None:
    assert snap_compare(console(), terminal_size=SIZE, run_before=settle, press=["question_mark"])
