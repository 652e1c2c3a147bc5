"""The console's branch form checks a request as `nsconsole branch` does, on the line's own files:
a fork past the end of the trunk's data and a plan longer than the branch's data are refused in the
form, before anything is sent, and the confirmation says the tokens each stage trains (whole rows).

A real tiny line (no training, no supervisor: the checks read files) behind a fake link to its
supervisor, which records what would be sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from helpers.console import book_of, console, settle
from helpers.lines import data_template_fixture, make_line
from textual.widgets import Input, Static

from nsconsole.screens.branch_form import BranchForm
from nsconsole.screens.confirm import ConfirmScreen
from nsconsole.state import LineFacts, LineView

pytestmark = pytest.mark.usefixtures("private_host")

data_template = data_template_fixture(prepare=1)
"""Cycles of 5,000 tokens, one planned: about 4 cycles and 21,312 tokens to train, estimated."""


class Live:
    """The link to the supervisors: records each mutation and accepts it."""

    problem = None

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict]] = []

    async def mutate(self, key: str, method: str, **params: object) -> object:
        self.sent.append((method, params))
        return {"state": "queued", "path": params["path"], "at_cycle": params["at_cycle"]}


def run_console(line: Path, scenario: Callable[[Any], Awaitable[None]]) -> Live:
    """The console with `line` as its only row, attached through a fake link; what was sent."""
    view = LineView(f"{line}-id", str(line), LineFacts(preset="transformer-tiny"))
    view.apply_hello({"epoch": "e", "pid": 4100}, 0.0)
    view.apply_status({"state": "training", "launches": 1, "trainer_pid": 5100})
    app = console(book=book_of(view))
    live = Live()

    async def main() -> None:
        async with app.run_test(size=(150, 40)) as pilot:
            await settle(pilot)
            app.live = live  # type: ignore[assignment]
            await scenario(pilot)

    asyncio.run(main())
    return live


async def submit_form(pilot: Any, at_cycle: int, plan: str, branch: Path, data: Path) -> None:
    """Press b, fill the form in, submit it."""
    await pilot.press("b")
    await pilot.pause()
    form = pilot.app.screen
    assert isinstance(form, BranchForm)
    values = {"path": str(branch), "at_cycle": str(at_cycle), "plan": plan, "data": str(data)}
    for name, value in values.items():
        form.query_one(f"#{name}", Input).value = value
    await pilot.click("#submit")
    await pilot.pause()


def form_error(pilot: Any) -> str:
    form = pilot.app.screen
    assert isinstance(form, BranchForm), "the form stays open"
    return str(form.query_one("#error", Static).render())


def test_the_form_refuses_a_fork_past_the_end_of_the_trunk_s_data(tmp_path: Path, data_template: Path) -> None:
    line = make_line(tmp_path, data_template)

    async def scenario(pilot: Any) -> None:
        await submit_form(pilot, 7, "decay:1e3", tmp_path / "b", data_template)
        error = form_error(pilot)
        assert error.startswith(f"✗ {data_template}: the trunk's data line will have about 4 cycles (0 to 3; ")
        assert error.endswith("so cycle 7 never ends on it; the last cycle a branch can fork at is about 3")
        await pilot.press("escape")

    assert run_console(line, scenario).sent == []


def test_the_form_refuses_a_plan_longer_than_the_branch_s_data(tmp_path: Path, data_template: Path) -> None:
    line = make_line(tmp_path, data_template)

    async def scenario(pilot: Any) -> None:
        await submit_form(pilot, 1, "decay:3e4", tmp_path / "b", data_template)
        assert form_error(pilot).startswith(
            f"✗ {data_template}: the branch's plan trains 30,016 tokens (decay 30,016) but its data line holds "
            "about 21,312 tokens to train in rows of 32 in 4 cycles (0 to 3; "
        )
        await pilot.press("escape")

    assert run_console(line, scenario).sent == []


def test_the_confirmation_says_the_tokens_each_stage_trains(tmp_path: Path, data_template: Path) -> None:
    line = make_line(tmp_path, data_template)

    async def scenario(pilot: Any) -> None:
        await submit_form(pilot, 1, "decay:100", tmp_path / "b", data_template)
        confirm = pilot.app.screen
        assert isinstance(confirm, ConfirmScreen)
        assert confirm.detail.splitlines()[:2] == [
            "Plan: decay:100", "It trains: decay at 32 for 128 tokens (100 asked, rounded up to 4 whole rows of 32)",
        ]  # fmt: skip
        await pilot.press("y")
        await pilot.pause(0.2)

    sent = run_console(line, scenario).sent
    assert sent == [("branch", {"path": str(tmp_path / "b"), "at_cycle": 1, "plan": "decay:100",
                                "data": str(data_template)})]  # fmt: skip


def test_the_offered_directory_follows_the_cycle_typed_until_it_is_typed_by_hand(
    tmp_path: Path, data_template: Path
) -> None:
    """Found on a host of many lines: `r1-c1` was offered, and queued, for a fork at cycle 5."""
    line = make_line(tmp_path, data_template)

    async def scenario(pilot: Any) -> None:
        await pilot.press("b")
        await pilot.pause()
        form = pilot.app.screen
        assert isinstance(form, BranchForm)
        path, at_cycle = form.query_one("#path", Input), form.query_one("#at_cycle", Input)
        assert path.value == str(line.with_name(f"{line.name}-c0"))
        at_cycle.value = "3"
        await pilot.pause()
        assert path.value == str(line.with_name(f"{line.name}-c3"))
        at_cycle.value = ""  # cleared to type another: the offer stays until a number comes
        await pilot.pause()
        at_cycle.value = "2"
        await pilot.pause()
        assert path.value == str(line.with_name(f"{line.name}-c2"))
        path.value = str(tmp_path / "mine")
        at_cycle.value = "1"
        await pilot.pause()
        assert path.value == str(tmp_path / "mine")
        await pilot.press("escape")

    assert run_console(line, scenario).sent == []
