"""What a console walkthrough found (items 6, 8-14 of its report), on frozen data with Pilot: the
dialogs' arrow keys and the branch form kept after a refusal, readable events and toasts, the next
validation and checkpoint at the plan's and the cycle's end, ended lines without live readings,
the header's word on `R`, tune's words by device, the essential keys and whole values at 80
columns, and a tab key that is off saying why."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path

from helpers.console import NOW, book_of, console, frozen_book, settle
from textual.widgets import Input, OptionList, TabbedContent
from textual.widgets._footer import FooterKey
from textual.widgets._toast import Toast, ToastRack

from engine.errors import LineError
from nsconsole.actions.steering import tune_choices
from nsconsole.app import ConsoleApp
from nsconsole.screens.branch_form import BranchForm
from nsconsole.screens.confirm import ConfirmScreen
from nsconsole.screens.help import HelpScreen
from nsconsole.screens.line import LineScreen, summary
from nsconsole.screens.picker import PickerScreen
from nsconsole.state import LineFacts, LineView
from nsconsole.widgets.event_list import EventList
from nsconsole.widgets.line_header import CycleSize, RunPlan, eta_line, read_cycle_size
from nsconsole.widgets.lines_table import LinesTable
from nsconsole.widgets.probe_table import ProbeTable, fit_name
from nsconsole.widgets.replies import TOAST_CHARS, reply_words, request_words

NARROW = (80, 24)
LONG_REASON = (
    "/srv/lines/demo-decay-data: trained by /srv/lines/demo-c0, the first line that started on it; a data line "
    "is trained by one line, so the branch needs a data line of its own [nsconsole data init DIR --like it]; "
) * 4
"""A refusal longer than an 80x24 screen holds in a half-width toast (the walkthrough's was cut)."""


def run(app: ConsoleApp, scenario: Callable[..., Awaitable[None]], size: tuple[int, int] = (150, 40),
        notifications: bool = False) -> None:
    async def main() -> None:
        async with app.run_test(size=size, notifications=notifications) as pilot:
            await settle(pilot)
            await scenario(pilot)

    asyncio.run(main())


def rows(last: int, tokens_per_s: float = 1700.0, slow_from: int | None = None, cycle: int = 0) -> list[dict]:
    """Training rows of 512 tokens an update (8 rows of 64), one every 2 s; from `slow_from` on at a
    tenth of the pace."""
    made = []
    for update in range(1, last + 1):
        rate = tokens_per_s / 10 if slow_from is not None and update >= slow_from else tokens_per_s
        made.append({
            "update": update, "tokens": update * 512, "data_tokens": update * 512, "time": NOW - 2 * (last - update),
            "loss": 3.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": rate, "cycle": cycle, "stage": "trunk",
            "seq_len": 64, "tokens_per_update": 512,
        })  # fmt: skip
    return made


def a_line(path: str, last: int = 200, state: str = "training", **status: object) -> LineView:
    line = LineView(f"{path}-id", path, LineFacts(preset="ns-tiny"))
    line.apply_hello({"epoch": "e", "pid": 4100}, NOW - 3600)
    line.apply_status({"state": state, "launches": 1, "trainer_pid": 5100, "preset": "ns-tiny",
                       "heartbeat": {"time": NOW - 1000, "update": last, "stage": "training"}, **status})
    line.apply_rows(rows(last), 0)
    return line


class Live:
    """The console's link to the supervisors: each mutation is answered with the next of `replies`
    (an exception is raised)."""

    problem = None

    def __init__(self, *replies: object) -> None:
        self.replies = list(replies)
        self.sent: list[tuple[str, dict]] = []

    async def mutate(self, key: str, method: str, **params: object) -> object:
        self.sent.append((method, params))
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply


def noted(app: ConsoleApp) -> list[str]:
    """Every toast the app shows from now on."""
    messages: list[str] = []
    app.notify = lambda message, **_: messages.append(str(message))  # type: ignore[method-assign]
    return messages


# ---- 11: dialogs ---------------------------------------------------------------------------------


def test_left_and_right_move_between_yes_and_no_in_a_confirmation() -> None:
    app = console(book=book_of(a_line("/srv/runs/a")))
    answers: list[bool | None] = []

    async def scenario(pilot) -> None:
        for keys in (("left", "enter"), ("left", "right", "enter"), ("enter",)):
            app.push_screen(ConfirmScreen("Stop /srv/runs/a at the next update?"), answers.append)
            await pilot.pause()
            await pilot.press(*keys)
            await pilot.pause()
        assert answers == [True, False, False]  # ← is Yes (left of No), → No; No is focused first

    run(app, scenario)


def test_the_branch_confirmation_shows_plan_and_data_and_a_refused_branch_reopens_as_typed() -> None:
    app = console(book=book_of(a_line("/srv/runs/a")))
    live = Live(LineError("/data/b: trained by /srv/runs/other"), {"state": "queued", "path": "/srv/runs/b",
                                                                    "at_cycle": 0})

    def fields() -> dict[str, str]:
        return {name: app.screen.query_one(f"#{name}", Input).value for name in ("path", "at_cycle", "plan", "data")}

    async def scenario(pilot) -> None:
        app.live = live  # type: ignore[assignment]
        await pilot.press("b", *"/srv/runs/b", "tab", "tab", *"decay:1e6", "tab", *"/data/b", "enter")
        confirm = app.screen
        assert isinstance(confirm, ConfirmScreen)
        assert "Plan: decay:1e6" in confirm.detail and "Data line: /data/b" in confirm.detail
        await pilot.press("y")
        await pilot.pause(0.2)
        await pilot.press("b")
        assert isinstance(app.screen, BranchForm)
        typed = {"path": "/srv/runs/b", "at_cycle": "0", "plan": "decay:1e6", "data": "/data/b"}
        assert fields() == typed  # as typed before the refusal
        await pilot.press("enter", "y")  # sent again as it stands: accepted this time
        await pilot.pause(0.2)
        assert [params for _, params in live.sent] == [{**typed, "at_cycle": 0}] * 2
        await pilot.press("b")
        assert isinstance(app.screen, BranchForm) and fields()["plan"] == ""  # taken: a fresh form

    run(app, scenario)


def test_escape_in_the_branch_form_keeps_what_was_typed_for_the_next_b() -> None:
    """A refusal shown in the form (here a half-typed plan), then Escape: the next `b` reopens the
    fields as typed (they were lost); Escape with nothing typed leaves the next form fresh."""
    app = console(book=book_of(a_line("/srv/runs/a")))

    def fields() -> dict[str, str]:
        return {name: app.screen.query_one(f"#{name}", Input).value for name in ("path", "at_cycle", "plan", "data")}

    async def scenario(pilot) -> None:
        app.live = Live()  # type: ignore[assignment]
        await pilot.press("b")
        fresh = fields()
        await pilot.press("escape")
        await pilot.pause()
        assert not app._branch_drafts  # nothing typed: nothing kept (the next form follows the line's cycle)
        await pilot.press("b")
        await pilot.press(*"/srv/runs/b", "tab", "tab", "tab", *"/data/b", "enter")
        assert isinstance(app.screen, BranchForm)  # refused in the form: no plan
        assert "plan" in str(app.screen.query_one("#error").render())
        await pilot.press("escape")
        await pilot.pause()
        await pilot.press("b")
        assert isinstance(app.screen, BranchForm)
        assert fields() == {**fresh, "path": "/srv/runs/b", "data": "/data/b"}
        for typed in ("plan", "data", "path"):  # emptied by hand: the form as it opened for the line
            app.screen.query_one(f"#{typed}", Input).value = fresh[typed]
        await pilot.press("escape")
        await pilot.pause()
        await pilot.press("b")
        assert fields() == fresh

    run(app, scenario)


# ---- 12: events and toasts -----------------------------------------------------------------------


def test_replies_are_worded_not_shown_as_dictionaries() -> None:
    assert reply_words("branch", {"state": "queued", "path": "/l/demo-c0", "at_cycle": 1}) == (
        "queued for the end of cycle 1 → /l/demo-c0", "")
    summary_text, details = reply_words("branch", {"state": "forked", "path": "/l/b", "at_cycle": 0,
                                                   "fork_update": 244, "fork_tokens": 1_000_000})
    assert summary_text == "forked at update 244 (1.0M tokens), the end of cycle 0 → /l/b" and details == ""
    summary_text, details = reply_words("rollback", {
        "to_update": 244, "set_aside": ["u00000250", "u00000287"], "rows_kept": "/l/demo/rows.rolledback-1.jsonl",
        "rows_now": 244, "reopened_cycles": [1],
    })
    assert summary_text == "the line continues from update 244"
    for part in ("u00000250, u00000287", "rows.jsonl keeps 244 rows", "rows.rolledback-1.jsonl",
                 "data cycles reopened (the preparer rebuilds them): 1"):
        assert part in details
    assert reply_words("tune", {"shared": False, "lengths": [{"seq_len": 256, "micro_batch_rows": 8,
                                                             "recompute": "none"}]}) == (
        "run.json has the new shapes", ": seq_len 256: 8 rows a micro-batch, recompute none")
    assert reply_words("stop", {"stopping": True, "when": "at the end of cycle 2", "at_cycle_end": 2})[0] == (
        "it stops at the end of cycle 2")
    assert request_words("branch", {"path": "/l/b", "at_cycle": 1, "plan": "decay:2e5", "data": "/d"}) == (
        "branch into /l/b at the end of cycle 1, plan decay:2e5, data line /d")
    for method, reply in (("branch", {"state": "queued", "path": "/l/b", "at_cycle": 1}),
                          ("tune", {"shared": True, "lengths": []}), ("stop", {"stopping": True})):
        assert "{" not in "".join(reply_words(method, reply))


def test_an_accepted_branch_is_one_readable_event_and_a_long_one_wraps_in_the_events_tab() -> None:
    line = a_line("/srv/runs/a")
    app = console(book=book_of(line))
    live = Live({"state": "queued", "path": "/srv/runs/b", "at_cycle": 0})

    async def scenario(pilot) -> None:
        app.live = live  # type: ignore[assignment]
        await pilot.press("b", *"/srv/runs/b", "tab", "tab", *"decay:1e6", "tab", *"/data/b", "enter", "y")
        await pilot.pause(0.2)
        messages = [event.message for event in line.events if event.kind == "request"]
        assert messages[-2:] == [
            "branch into /srv/runs/b at the end of cycle 0, plan decay:1e6, data line /data/b: sent",
            "branch accepted: queued for the end of cycle 0 → /srv/runs/b",
        ]
        line.add_event(NOW, "refused", f"branch: {LONG_REASON}", "error")
        await pilot.press("enter", "6")
        events = app.screen.query_one(EventList)
        app.refresh_views()
        await pilot.pause()
        # The whole reason on the screen: its row as tall as it needs, nothing past the right edge.
        assert events.virtual_size.width <= events.scrollable_content_region.width
        index = next(index for index in range(events.row_count) if str(events.get_row_at(index)[2]).startswith("branch: /"))
        assert events.ordered_rows[index].height > 10
        assert "[nsconsole data init DIR --like it]" in str(events.get_row_at(index)[2])  # brackets are text

    run(app, scenario, size=NARROW)


def test_a_long_refusal_toast_is_read_whole_at_80x24() -> None:
    app = console(book=book_of(a_line("/srv/runs/a")))

    async def scenario(pilot) -> None:
        app.live = Live(LineError(LONG_REASON))  # type: ignore[assignment]
        await pilot.press("s", "enter", "y")
        await pilot.pause(0.5)
        toasts = list(app.screen.query(Toast))
        assert len(toasts) == 1
        rack = app.screen.query_one(ToastRack)
        # All of the toast is on the screen, the rack scrolls nothing out of view.
        assert rack.max_scroll_y == 0 and toasts[0].region.y >= 0 and toasts[0].region.bottom <= NARROW[1]
        shown = str(toasts[0].render())
        assert len(shown) < TOAST_CHARS + 60 and shown.endswith("(the line's events tab has all of it)")

    run(app, scenario, size=NARROW, notifications=True)


# ---- 6: the next validation and checkpoint -------------------------------------------------------


def plan_of(every: int = 100, checkpoint_every: int = 250, stage_ends: tuple[tuple[str, float], ...] = (),
            cycle: CycleSize | None = None) -> RunPlan:
    plan_tokens = stage_ends[-1][1] if stage_ends else None
    return RunPlan("{}", every, checkpoint_every, plan_tokens, stage_ends, None, None, cycle)


def test_the_next_validation_and_checkpoint_come_at_the_plans_end() -> None:
    # 100,000 tokens at 512 an update end the plan at update 196 (195.3 rounded up): it validates and
    # checkpoints there, not at u200 / u250, which never come.
    text = str(eta_line(a_line("/srv/runs/a", last=190), plan_of(stage_ends=(("decay", 100_000.0),))))
    assert "validation u196 (plan ends)" in text and "checkpoint u196 (plan ends)" in text
    # A stage that is not the last ends with a checkpoint, not a validation.
    two_stages = plan_of(stage_ends=(("trunk", 100_000.0), ("long", 200_000.0)))
    text = str(eta_line(a_line("/srv/runs/a", last=190), two_stages))
    assert "validation u200" in text and "checkpoint u196 (stage trunk ends)" in text


def test_the_next_checkpoint_comes_at_the_cycles_end_from_its_manifest(tmp_path: Path) -> None:
    # Two sources of equal weight: the scarcer, 60,000 tokens, has 937 windows of 64, so the order
    # holds 1,874 samples (119,936 tokens); at update 200 (102,400) that is 35 updates of 512 away.
    cycle_dir = tmp_path / "c0000"
    cycle_dir.mkdir()
    sources = {"text": {"tokens": 60_000, "weight": 1}, "code": {"tokens": 70_000, "weight": 1}}
    (cycle_dir / "manifest.json").write_text(json.dumps({"cycle": 0, "sources": sources}))
    size = read_cycle_size(cycle_dir, 0, 0.0, last=None)
    assert size == CycleSize(0, 0.0, ((60_000, 1), (70_000, 1)), last=False)
    text = str(eta_line(a_line("/srv/runs/a", last=200), plan_of(every=1000, cycle=size)))
    assert "validation u1000" in text and "checkpoint ~u235 (cycle 0 ends)" in text
    # The data line's last cycle: its end ends the line, which validates there.
    last = read_cycle_size(cycle_dir, 0, 0.0, last=0)
    text = str(eta_line(a_line("/srv/runs/a", last=200), plan_of(every=1000, cycle=last)))
    assert "validation ~u235 (the data line ends)" in text
    assert read_cycle_size(tmp_path / "c0001", 1, 0.0, None) is None  # not prepared yet


# ---- 8, 9: ended lines ---------------------------------------------------------------------------


def test_an_ended_line_shows_no_live_beat_rate_or_slow_flag() -> None:
    slow = [{**row, "tokens_per_s": 170.0} if row["update"] > 190 else row for row in rows(200)]
    training, stopped = a_line("/srv/runs/training"), a_line("/srv/runs/stopped", state="stopped")
    for line in (training, stopped):
        line.apply_rows(slow, 0)
        line.refresh_health(NOW)
    assert "slow" in [flag.kind for flag in training.health]
    assert stopped.health == []  # its last rows' pace is history, no alarm
    app = console(book=book_of(stopped, training))

    async def scenario(pilot) -> None:
        table = app.screen.query_one(LinesTable)
        assert str(table.get_cell(stopped.key, "beat")) == "— ended"
        assert str(table.get_cell(stopped.key, "tokens_per_s")) == "—"
        assert str(table.get_cell(training.key, "beat")).endswith(" 17m")  # a live line's beat still ages

    run(app, scenario)


def test_the_header_of_a_line_nothing_runs_says_r_resumes_it() -> None:
    line = a_line("/srv/runs/a", state="stopped")
    line.mark_disconnected("the supervisor exited", NOW)
    text = str(summary(line, NOW, resumable=True))
    assert "the supervisor has exited; last state shown; R resumes the line, other changes off" in text
    assert "beat — (ended; last 2027-01-15 07:43:20 UTC)" in text
    assert "changes off" in str(summary(line, NOW, resumable=False))
    app = console(book=book_of(line))

    async def scenario(pilot) -> None:
        app.live = Live()  # type: ignore[assignment]
        await pilot.press("enter")
        app.refresh_views()
        header = str(app.screen.query_one("#summary").render())
        assert "R resumes the line" in header

    run(app, scenario)


# ---- 10: tune's words by device ------------------------------------------------------------------


def test_tune_offers_the_cpu_its_own_words() -> None:
    assert "GPU" not in " ".join(label for _, label in tune_choices(True))
    assert dict(tune_choices(False))["alone"] == "the GPU to itself"
    cpu = a_line("/srv/runs/cpu", device="cpu", gpu_candidates=None)
    auto_without_gpu = a_line("/srv/runs/auto", device="auto", gpu_candidates=None)
    gpu = a_line("/srv/runs/gpu", device="auto", gpu_candidates=[0])
    assert (cpu.on_cpu, auto_without_gpu.on_cpu, gpu.on_cpu, a_line("/srv/runs/old").on_cpu) == (True, True, False, None)
    app = console(book=book_of(auto_without_gpu))

    async def scenario(pilot) -> None:
        app.live = Live()  # type: ignore[assignment]
        await pilot.press("t")
        picker = app.screen
        assert isinstance(picker, PickerScreen)
        labels = [label for _, label in picker.options]
        assert labels[0] == "alone on the CPU: up to half the free memory" and not any("GPU" in x for x in labels)

    run(app, scenario)


def test_tune_shows_shared_but_does_not_offer_it_without_a_reserve(tmp_path: Path) -> None:
    """The supervisor refuses `tune --shared` on a line without guards.share_reserve_gb: the picker
    says so and its cursor passes over the option (it used to be offered, then refused after the
    confirmation). With a reserve, or a run.json the console cannot read, it is offered."""
    for name, guards, off in (("none", {}, True), ("set", {"share_reserve_gb": 2.0}, False), ("broken", None, False)):
        path = tmp_path / name
        path.mkdir()
        text = "{not json" if guards is None else json.dumps({"model": {"preset": "ns-tiny"}, "data": {"line": "d"}, "guards": guards})
        (path / "run.json").write_text(text)
        app = console(book=book_of(a_line(str(path), device="cpu", gpu_candidates=None)))

        async def scenario(pilot, app: ConsoleApp = app, off: bool = off) -> None:
            app.live = Live()  # type: ignore[assignment]
            await pilot.press("t")
            await pilot.pause()
            picker = app.screen
            assert isinstance(picker, PickerScreen)
            shared = picker.query_one(OptionList).get_option("shared")
            assert shared.disabled is off
            assert ("needs guards.share_reserve_gb in run.json" in str(shared.prompt)) is off
            await pilot.press("down", "enter")
            await pilot.pause(0.3)
            assert isinstance(app.screen, ConfirmScreen)
            chosen = "alone on the CPU" if off else "beside other processes"
            assert f"({chosen}" in app.screen.question

        run(app, scenario)


# ---- 13: 80 columns ------------------------------------------------------------------------------


def test_help_and_quit_stay_in_the_footer_at_80_columns() -> None:
    app = console()

    async def scenario(pilot) -> None:
        for _ in range(2):  # the lines screen, then a line's screen
            await pilot.pause()
            keys = {key.action: key for key in app.screen.query(FooterKey)}
            for action in ("help", "quit"):
                region = keys[action].region
                assert region.width and region.right <= NARROW[0], action
                assert app.screen.get_widget_at(region.x + 1, region.y)[0] is keys[action]  # not covered
            await pilot.press("enter")

    run(app, scenario, size=NARROW)


def test_probe_values_show_whole_at_80_columns() -> None:
    book = frozen_book(memory_blocks=2)  # long names: val_64/pssa/block01/confidence_mean...
    line = book.get("pssa-trunk-id")
    line.add_row({"update": 500, "tokens": 500 * 512, "seq_len": 64, "val_64/mix": 3.1, "opt/decay/param_norm": 64.364,
                  "val_64/pssa/block00/a_reading_with_a_very_long_name_indeed": 0.0011307})
    app = console(book=book_of(line))

    async def scenario(pilot) -> None:
        await pilot.press("enter", "2")
        app.refresh_views()
        await pilot.pause()
        table = app.screen.query_one(ProbeTable)
        assert table.virtual_size.width <= table.scrollable_content_region.width  # nothing past the edge
        names = [str(table.get_row_at(index)[1]) for index in range(table.row_count)]
        assert any("…" in name for name in names)
        values = [str(table.get_row_at(index)[3]) for index in range(table.row_count)]
        assert "64.364" in values and "0.0011307" in values
        assert fit_name("val_64/pssa/block00/confidence_mean", 20) == "val_64…nfidence_mean"

    run(app, scenario, size=NARROW)


# ---- 14: a key that is off says why --------------------------------------------------------------


def test_the_memory_key_on_a_line_that_is_not_pssa_says_why_and_help_tells_it() -> None:
    app = console(book=book_of(a_line("/srv/runs/tf")))
    toasts = noted(app)

    async def scenario(pilot) -> None:
        await pilot.press("enter")
        assert isinstance(app.screen, LineScreen)
        await pilot.press("7")
        assert app.screen.query_one(TabbedContent).active == "tab-curves"
        assert toasts == ["Memory: the memory tab is for PSSA lines' memory banks; tf is a ns-tiny line"]
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        assert app.screen.off_reasons["tab_memory"].startswith("the memory tab is for PSSA lines")
        assert app.screen.off_reasons["stop"] == "this console is not attached to any supervisor"

    run(app, scenario)
