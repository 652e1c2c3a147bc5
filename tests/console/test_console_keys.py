"""The console's keys, views and drawing without a supervisor (frozen data, Pilot)."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

from helpers.console import NOW, book_of, console, frozen_book, rows_of, settle
from textual import events
from textual.widgets import Input, TabbedContent

from engine.gpu.devices import GpuDevice, GpuSnapshot
from engine.units import GIB
from nsconsole.app import ConsoleApp
from nsconsole.screens.branch_form import BranchForm, parse_branch
from nsconsole.screens.confirm import ConfirmScreen
from nsconsole.screens.help import HelpScreen
from nsconsole.screens.line import LineScreen
from nsconsole.screens.picker import PickerScreen
from nsconsole.state import LineBook, LineFacts, LineView
from nsconsole.widgets.checkpoint_list import read_checkpoints
from nsconsole.widgets.curves_tab import CurvesTab
from nsconsole.widgets.gpu_panel import GpuPanel, GpuReading, memory_bar
from nsconsole.widgets.lines_table import LinesTable
from nsconsole.widgets.plot import MARKER, draw, sparkline


def run(app: ConsoleApp, scenario) -> None:
    async def main() -> None:
        async with app.run_test(size=(150, 40)) as pilot:
            await settle(pilot)
            await scenario(pilot)

    asyncio.run(main())


def test_only_changed_cells_are_redrawn_and_pause_holds_the_view() -> None:
    app = console()

    async def scenario(pilot) -> None:
        table = app.screen.query_one(LinesTable)
        written = table.cells_written
        app.refresh_views()
        assert table.cells_written == written  # nothing changed, nothing written
        line = app.book.get("pssa-trunk-id")
        line.apply_status({**line.status, "crashes": 3})
        app.refresh_views()
        assert table.cells_written == written + 1  # the restarts cell alone
        assert str(table.get_cell("pssa-trunk-id", "restarts")) == "3"
        await pilot.press("p")
        assert "paused" in app.sub_title
        line.apply_status({**line.status, "crashes": 5})
        app.refresh_views()
        assert str(table.get_cell("pssa-trunk-id", "restarts")) == "3"
        await pilot.press("p")
        assert str(table.get_cell("pssa-trunk-id", "restarts")) == "5"

    run(app, scenario)


def test_the_filter_narrows_the_table_and_escape_clears_it() -> None:
    app = console()

    async def scenario(pilot) -> None:
        table = app.screen.query_one(LinesTable)
        assert table.row_count == 3
        await pilot.press("slash", *"pssa")
        assert table.row_count == 1 and table.selected_key == "pssa-trunk-id"
        await pilot.press("enter", "escape")
        assert table.row_count == 3

    run(app, scenario)


def test_mutating_keys_are_off_without_a_supervisor_and_in_readonly_mode() -> None:
    app = console()

    async def scenario(pilot) -> None:
        assert app.check_action("stop", ()) is None  # no supervisor attached
        names = [command.title for command in app.get_system_commands(app.screen)]
        assert "Filter (/)" in names and "Pause (p)" in names and "Help (?)" in names
        assert not any(name.startswith("Stop") for name in names)
        await pilot.press("s")
        assert app.screen.__class__.__name__ == "LinesScreen"

    run(app, scenario)
    readonly = ConsoleApp(readonly=True, discover=lambda: [], clock=lambda: NOW)

    async def readonly_scenario(pilot) -> None:
        assert readonly.check_action("branch", ()) is None and readonly.sub_title == "read-only"

    run(readonly, readonly_scenario)


def test_a_new_health_flag_rings_the_bell_once() -> None:
    app = console(book=frozen_book())
    app.bell_severities = frozenset({"warning", "error"})  # a spike is a warning: `--bell error,warning`
    rings: list[int] = []

    async def scenario(pilot) -> None:
        app.bell = lambda: rings.append(1)  # type: ignore[method-assign]
        line = app.book.get("pssa-trunk-id")
        line.add_row({**line.last_row, "update": 501, "loss": 50.0, "tokens": 501 * 512})
        app.refresh_views()
        app.refresh_views()
        assert rings == [1]
        assert "▲ spike" in str(app.screen.query_one(LinesTable).get_cell("pssa-trunk-id", "health"))

    run(app, scenario)


def test_the_help_lists_each_binding_with_its_id() -> None:
    app = console()

    async def scenario(pilot) -> None:
        keys = {binding_id: (key, enabled) for key, binding_id, _, enabled in app.key_help(app.screen)}
        assert {"stop", "branch", "rollback", "tune", "filter", "pause", "quit", "help", "open"} <= set(keys)
        assert keys["stop"] == ("s", False) and keys["filter"] == ("/", True)

    run(app, scenario)


def test_an_empty_host_says_how_to_start_a_line() -> None:
    app = console(book=LineBook())

    async def scenario(pilot) -> None:
        assert "nsconsole --run" in str(app.screen.query_one("#empty").render())
        assert app.screen.query_one("#empty").has_class("visible")

    run(app, scenario)


def test_the_plot_keeps_a_spike_between_dots_and_the_log_axis_drops_non_positive_values() -> None:
    xs = [float(x) for x in range(1000)]
    ys = [1.0] * 1000
    ys[501] = 10.0  # one row among ~50 per dot column
    grid = draw(xs, ys, width=10, height=4)
    assert grid is not None and grid.y_high == 10.0
    top_row = grid.rows[0]
    assert top_row.strip() != ""  # the spike reaches the top
    assert draw(xs, [0.0] * 1000, 10, 4, log_y=True) is None
    logged = draw([1, 2, 3], [1.0, 10.0, 100.0], 3, 3, log_y=True, marker_xs=[2], marker_ys=[10.0])
    assert logged is not None and math.isclose(logged.y_high, 100.0) and math.isclose(logged.y_low, 1.0)
    assert MARKER in logged.rows[1]  # 10 sits mid-way on a log axis
    assert sparkline([0.0, 50.0, 100.0, None], 4, 0.0, 100.0) == "▁▅█ "


def test_memory_bar_splits_the_width_by_segment() -> None:
    runs = memory_bar(100, 50, 25, 10, width=20)
    assert runs == [("█", 10, "line"), ("▓", 5, "others"), ("░", 2, "reserve"), ("·", 3, "free")]
    assert sum(cells for _, cells, _ in memory_bar(7, 1, 1, 1, width=13)) == 13


def test_the_gpu_panel_draws_the_reserve_in_gib_like_the_trainer() -> None:
    """share_reserve_gb 1.0 is 1 GiB = 1073741824 bytes: on an idle 11 GiB GPU that is 40/11 = 3.6
    cells of 40, so 4 (as 1e9 bytes it was 3.4 cells, so 3)."""
    book = LineBook()
    book.add(LineView("s-id", "/srv/runs/s", LineFacts(preset="pssa-1.5m", share_reserve_gb=1.0)))
    device = GpuDevice(0, "NVIDIA H200", "GPU-0", memory_total=11 * GIB, memory_used=0, utilization=0, processes=[])
    reading = GpuReading(GpuSnapshot(True, "", "580", [device]), [None])
    app = console(book=book, reading=reading)

    async def scenario(pilot) -> None:
        selected = book.get("s-id")
        assert selected is not None and selected.facts.share_reserve_bytes == 1_073_741_824
        first_line = app.screen.query_one(GpuPanel).render_text(reading, book, selected).plain.splitlines()[0]
        assert first_line.count("░") == 4 and first_line.count("·") == 36

    run(app, scenario)


def test_checkpoints_are_listed_newest_first_with_kept_reasons(tmp_path: Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    for update, kept in ((0, "line-start"), (5, None), (10, "cycle-end 0")):
        directory = checkpoints / f"u{update:08d}"
        directory.mkdir(parents=True)
        state = {"kept": kept, "position": {"tokens_trained": update * 128}}
        (directory / "state.json").write_text(json.dumps(state))
    (checkpoints / "u00000015.partial").mkdir()  # being written: not listed
    (checkpoints / "latest").write_text("u00000010\n")
    listed = read_checkpoints(tmp_path)
    assert [(info.update, info.kept, info.latest, info.tokens) for info in listed] == [
        (10, "cycle-end 0", True, 1280), (5, None, False, 640), (0, "line-start", False, 0),
    ]
    assert read_checkpoints(tmp_path / "nowhere") == []


def test_the_branch_form_names_the_field_that_is_wrong() -> None:
    request = parse_branch(" /runs/b ", "3", " decay:1e6 ", "/data/b")
    assert request.params() == {"path": "/runs/b", "at_cycle": 3, "plan": "decay:1e6", "data": "/data/b"}
    for fields, message in (
        (("", "3", "p", "d"), "new line"), (("/b", "x", "p", "d"), "a whole number"),
        (("/b", "-1", "p", "d"), ">= 0"), (("/b", "3", " ", "d"), "plan"), (("/b", "3", "p", ""), "data line"),
    ):
        try:
            parse_branch(*fields)
        except ValueError as error:
            assert message in str(error)
        else:
            raise AssertionError(f"{fields} was accepted")


def test_a_runtime_directory_owned_by_someone_else_is_reported_on_screen(tmp_path: Path) -> None:
    from engine.errors import LineError

    def refuse() -> list:
        raise LineError(f"{tmp_path}/nsconsole: not a directory owned by uid 0; refusing to use it")

    app = ConsoleApp(discover=refuse, clock=lambda: NOW, refresh_interval=0.1)

    async def scenario(pilot) -> None:
        empty = app.screen.query_one("#empty")
        for _ in range(50):
            if "cannot look for lines" in str(empty.render()):
                break
            await pilot.pause(0.1)
        assert "refusing to use it" in str(empty.render()) and empty.has_class("visible")

    run(app, scenario)


def test_a_curve_of_few_rows_is_drawn_as_a_connected_stroke() -> None:
    grid = draw([0.0, 1.0, 2.0], [0.0, 3.0, 1.0], width=20, height=4)
    assert grid is not None
    # Every dot column from the first row to the last holds a dot: no gaps between the rows.
    for column in range(40):
        bits = [ord(row[column // 2]) - 0x2800 if row[column // 2] != " " else 0 for row in grid.rows]
        mask = (0x01 | 0x02 | 0x04 | 0x40) if column % 2 == 0 else (0x08 | 0x10 | 0x20 | 0x80)
        assert any(cell & mask for cell in bits), f"dot column {column} is empty"


def test_rollback_offers_only_checkpoints_before_latest_and_says_what_it_sets_aside(tmp_path: Path) -> None:
    for update, kept in ((100, "cycle-end 0"), (200, None), (300, None)):
        directory = tmp_path / "checkpoints" / f"u{update:08d}"
        directory.mkdir(parents=True)
        state = {"kept": kept, "position": {"tokens_trained": update * 512}}
        (directory / "state.json").write_text(json.dumps(state))
    (tmp_path / "checkpoints" / "latest").write_text("u00000300\n")
    line = LineView("k", str(tmp_path), LineFacts(preset="ns-tiny"))
    line.apply_hello({"epoch": "e", "pid": 1}, NOW - 60)
    line.apply_status({"state": "training", "trainer_pid": 2, "latest_checkpoint": 300})
    line.apply_rows(rows_of(340, 3.0, 1.0), 0)
    book = LineBook()
    book.add(line)
    app = console(book=book)
    sent: list[tuple[str, dict]] = []

    class Live:
        async def mutate(self, key: str, method: str, **params: object) -> dict:
            sent.append((method, params))
            return {"to_update": params["to"]}

    async def scenario(pilot) -> None:
        app.live = Live()
        await pilot.press("r")
        await pilot.pause()
        picker = app.screen
        assert isinstance(picker, PickerScreen)
        assert [value for value, _label in picker.options] == ["200", "100"]  # not u300, which `latest` names
        await pilot.press("enter")
        await pilot.pause()
        confirm = app.screen
        assert isinstance(confirm, ConfirmScreen)
        assert confirm.question == f"Roll {tmp_path} back to update 200?"
        assert confirm.detail.startswith("Sets aside updates 201-340 (71.7K tokens): their rows are kept in "
                                         "rows.rolledback-<time>.jsonl")
        await pilot.press("y")
        await pilot.pause(0.2)
        assert sent == [("rollback", {"to": 200})]

    run(app, scenario)


def test_the_line_screen_tabs_are_reached_from_the_keyboard() -> None:
    """`]`/`[` and 1-7 show a tab and focus what it shows; on the focused tab bar ←/→ go from tab to
    tab; on the curves ←/→ move the cursor, which stays where it was across tabs."""
    book = frozen_book()
    app = console(book=book_of(book.get("pssa-trunk-id"), book.get("tf-baseline-id")))

    async def scenario(pilot) -> None:
        await pilot.press("enter")  # the PSSA line: seven tabs, memory last
        screen = app.screen
        assert isinstance(screen, LineScreen)
        tabs = screen.query_one(TabbedContent)
        curves = screen.query_one(CurvesTab)

        def shown() -> tuple[str, str]:
            focused = screen.focused
            return tabs.active, "" if focused is None else type(focused).__name__

        assert shown() == ("tab-curves", "CurvesTab")
        await pilot.press("right", "left")  # the first press: the newest row; then one to its left
        cursor = curves.plot_width - 2
        assert curves.settings.cursor == cursor
        await pilot.press("right_square_bracket")
        assert shown() == ("tab-probes", "ProbeTable")
        await pilot.press("right_square_bracket")
        assert shown() == ("tab-samples", "SamplesTab")
        await pilot.press("left_square_bracket", "left_square_bracket")
        assert shown() == ("tab-curves", "CurvesTab")
        await pilot.press("left_square_bracket")  # round the end
        assert shown() == ("tab-memory", "ContentTabs")  # nothing to focus in it: the tab bar
        await pilot.press("4")
        assert shown() == ("tab-checkpoints", "CheckpointList")
        await pilot.press("6")
        assert shown() == ("tab-events", "EventList")
        await pilot.press("5")
        assert shown() == ("tab-log", "LogFollower")
        await pilot.press("1")
        assert shown() == ("tab-curves", "CurvesTab")
        await pilot.pause()
        assert curves.settings.cursor == cursor  # kept while another tab was shown
        # Shift-Tab: the tab bar, where ←/→ go from tab to tab and leave the cursor alone.
        await pilot.press("shift+tab")
        assert shown() == ("tab-curves", "ContentTabs")
        await pilot.press("right")
        assert shown() == ("tab-probes", "ContentTabs")
        await pilot.press("left")
        assert shown() == ("tab-curves", "ContentTabs")
        assert curves.settings.cursor == cursor
        await pilot.press("tab", "left")
        assert shown() == ("tab-curves", "CurvesTab") and curves.settings.cursor == cursor - 1
        # The keys are in the help with their ids, in the footer and in the command palette.
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        listed = {binding_id: key for key, binding_id, _, enabled in app.screen.keys if enabled}
        assert listed["previous_tab"] == "[" and listed["next_tab"] == "]"
        assert [listed[f"tab_{name}"] for name in ("curves", "probes", "samples", "checkpoints", "log", "events",
                                                   "memory")] == list("1234567")
        await pilot.press("escape")
        footer = {key.key_display for key in screen.query("FooterKey")}  # type: ignore[attr-defined]
        assert {"[", "]"} <= footer
        commands = [command.title for command in app.get_system_commands(screen)]
        assert "Previous tab ([)" in commands and "Next tab (])" in commands and "Events (6)" in commands
        # A line without a memory tab: 7 does nothing, and `]` goes round from events to curves.
        await pilot.press("escape", "down", "enter")
        other = app.screen
        assert isinstance(other, LineScreen) and other.line.key == "tf-baseline-id"
        other_tabs = other.query_one(TabbedContent)
        await pilot.press("7")
        assert other_tabs.active == "tab-curves"
        await pilot.press("6", "right_square_bracket")
        assert other_tabs.active == "tab-curves"

    run(app, scenario)


def test_typing_into_the_branch_form_at_once_fills_its_first_field() -> None:
    """The form opens with its first field focused (its suggestion selected: typing replaces it);
    Tab goes from field to field."""
    book = book_of(frozen_book().get("pssa-trunk-id"))
    app = console(book=book)
    sent: list[tuple[str, dict]] = []

    class Live:
        problem = None

        async def mutate(self, key: str, method: str, **params: object) -> dict:
            sent.append((method, params))
            return {}

    async def scenario(pilot) -> None:
        app.live = Live()
        await pilot.press("b", *"/srv/runs/b-c25")
        form = app.screen
        assert isinstance(form, BranchForm)
        fields = {name: form.query_one(f"#{name}", Input) for name in ("path", "at_cycle", "plan", "data")}
        assert {name: field.value for name, field in fields.items()} == {
            "path": "/srv/runs/b-c25", "at_cycle": "2", "plan": "", "data": "",
        }
        await pilot.press("tab", "3", "tab", *"decay:1e6", "tab", *"/data/b", "enter")
        confirm = app.screen
        assert isinstance(confirm, ConfirmScreen)
        assert confirm.question == "Branch /srv/runs/pssa-trunk into /srv/runs/b-c25 at the end of cycle 3?"
        await pilot.press("y")
        await pilot.pause(0.2)
        assert sent == [("branch", {"path": "/srv/runs/b-c25", "at_cycle": 3, "plan": "decay:1e6", "data": "/data/b"})]

    run(app, scenario)


def test_a_tab_key_pressed_before_the_line_screens_tab_bar_is_there_is_taken_once_it_is() -> None:
    # On a loaded machine a tab key can reach a line's screen just after Enter, while its tab bar
    # is still mounting: showing a tab then broke Textual's mount of the bar (`No Tab with id
    # '--content-tab-tab-curves'`, or `'' is not in list` for `]`) and the console exited. The
    # bindings' actions are called at that moment (a posted key comes a few ticks too late here).
    for press, shown in ((lambda screen: screen.action_step_tab(1), "tab-probes"),
                         (lambda screen: screen.action_show_tab("tab-log"), "tab-log")):
        app = console()

        async def scenario(pilot, app: ConsoleApp = app, press=press, shown: str = shown) -> None:
            app.post_message(events.Key("enter", None))  # (`pilot.press` would wait for the mount)
            while not (isinstance(app.screen, LineScreen) and app.screen.query(TabbedContent)):
                await asyncio.sleep(0)
            press(app.screen)
            await pilot.pause(0.3)
            assert app.is_running and app.return_code is None
            assert app.screen.query_one(TabbedContent).active == shown

        run(app, scenario)
