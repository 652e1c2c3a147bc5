"""The curves tab's keys, cursor, markers, pins and trunk history; the header's ETA line and
run.json view; the host beside the GPUs. Frozen lines (Pilot, no supervisor) except the last test,
which runs a real tiny line under its supervisor.
"""

from __future__ import annotations

import asyncio
import io
import json
import math
import os
from pathlib import Path

import pytest
from helpers.console import NOW, book_of, console, gpu_reading, settle, until
from helpers.lines import make_data_line, make_line
from helpers.supervise import start_supervisor, stop_supervisor
from rich.console import Console
from textual.widgets import Input

from engine.supervisor.registry import line_id
from engine.units import GIB
from nsconsole.app import ConsoleApp
from nsconsole.screens.line import LineScreen
from nsconsole.screens.run_config import RunConfigScreen
from nsconsole.state import LineFacts, LineView
from nsconsole.widgets.curves import X_AXES, CurvePlot, marker_strip, smooth
from nsconsole.widgets.curves_tab import CurvesTab
from nsconsole.widgets.gpu_panel import GpuPanel, GpuReading
from nsconsole.widgets.host_panel import HostReading, HostSampler, ProcessReading
from nsconsole.widgets.line_header import EtaLine
from nsconsole.widgets.lines_table import LinesTable
from nsconsole.widgets.plot import NO_LAYER, Layer, cell_column, column_x, draw_layers
from nsconsole.widgets.probe_table import ProbeTable

START = NOW - 10_000.0
"""The first row's time: row u is written at START + 2u (one update every 2 s)."""


def row(update: int, cycle_every: int = 200) -> dict:
    tokens = update * 512
    return {
        "update": update, "tokens": tokens, "data_tokens": tokens, "time": START + 2 * update,
        "loss": 3.0 + 1000.0 / (update + 100), "lr": 1e-3, "grad_norm": 1.0 + update / 1000,
        "tokens_per_s": 256.0, "cycle": update // cycle_every, "stage": "trunk", "seq_len": 64,
        "train/grad_norm/layer00": update / 100,
    }  # fmt: skip


def rows_to(last: int, validate_every: int = 100, first: int = 1) -> list[dict]:
    rows = []
    for update in range(first, last + 1):
        rows.append(row(update))
        if update % validate_every == 0:
            rows[-1] = {**rows[-1], "val_64/mix": 4.0 - update / 1000, "val_64/probe/firing": update / 1000}
    return rows


def a_line(path: str | Path, rows: list[dict], parent: str | None = None, state: str = "training",
           update: int | None = None) -> LineView:
    """A line's view with `rows`, its heartbeat at `update` (default: the last row's)."""
    line = LineView(f"{Path(path).name}-id", str(path), LineFacts(preset="ns-tiny"))
    line.apply_hello({"epoch": "e", "pid": 4100}, NOW - 3600)
    beat = {"time": NOW - 1, "update": rows[-1]["update"] if update is None else update, "stage": "training"}
    line.apply_status({"state": state, "launches": 1, "trainer_pid": None, "parent": parent, "heartbeat": beat})
    line.apply_rows(rows, 0)
    return line


def run(app: ConsoleApp, scenario) -> None:
    async def main() -> None:
        async with app.run_test(size=(150, 44)) as pilot:
            await settle(pilot)
            await pilot.press("enter")
            assert isinstance(app.screen, LineScreen)
            await pilot.pause()
            app.refresh_views()
            await pilot.pause()
            await scenario(pilot)

    asyncio.run(main())


def plot_of(app: ConsoleApp, column: str) -> CurvePlot:
    return next(plot for plot in app.screen.query(CurvePlot) if plot.column == column)


async def redraw(pilot) -> None:
    pilot.app.refresh_views()
    await pilot.pause()
    for plot in pilot.app.screen.query(CurvePlot):
        plot.render()  # what is on screen now (the grid each plot keeps)


def test_smoothing_x_axis_and_log_keys_change_every_plot() -> None:
    app = console(book=book_of(a_line("/srv/runs/a", rows_to(500))))

    async def scenario(pilot) -> None:
        settings = app.screen.query_one(CurvesTab).settings
        assert (settings.smoothing, settings.x_axis, settings.log_y) == (0.0, "tokens", False)
        assert plot_of(app, "loss").render().plain.splitlines()[-1].endswith("256.0K tokens")
        await pilot.press("m")
        assert settings.smoothing == 0.6
        title = plot_of(app, "grad_norm").render().plain.splitlines()[0]
        assert "EMA 0.6" in title
        await pilot.press("m", "m", "m")
        assert settings.smoothing == 0.0 and "EMA" not in plot_of(app, "loss").render().plain
        await pilot.press("x")
        assert settings.x_axis == "update"
        assert plot_of(app, "lr").render().plain.splitlines()[-1].endswith("500 updates")
        await pilot.press("x")
        assert settings.x_axis == "time"
        # 500 rows 2 s apart: the time axis runs from 0 to 998 s (16m38s) after the first row.
        assert plot_of(app, "loss").render().plain.splitlines()[-1].endswith("16m38s wall time")
        await pilot.press("x")
        assert settings.x_axis == X_AXES[0]
        await pilot.press("l")
        assert settings.log_y and "[log]" in plot_of(app, "tokens_per_s").render().plain

    run(app, scenario)


def test_smoothing_draws_the_raw_readings_dimmed_under_the_average() -> None:
    values = [1.0, 2.0, math.nan, 4.0]
    # Debiased: the first average is the first reading; a NaN leaves the average as it was.
    smoothed = smooth(values, 0.5)
    assert smoothed[0] == 1.0 and math.isclose(smoothed[1], (0.5 * 1 * 0.5 + 0.5 * 2) / 0.75)
    assert math.isnan(smoothed[2]) and math.isclose(smoothed[3], (0.125 * 1 + 0.25 * 2 + 0.5 * 4) / 0.875)
    app = console(book=book_of(a_line("/srv/runs/a", rows_to(500))))

    async def scenario(pilot) -> None:
        await pilot.press("m", "m")  # EMA 0.9
        await redraw(pilot)
        owners = {owner for line in plot_of(app, "loss").grid.layers for owner in line}  # type: ignore[union-attr]
        assert {1, 2} <= owners  # raw readings (dimmed) and the average both drawn

    run(app, scenario)


def test_the_cursor_reads_every_curve_at_its_row() -> None:
    rows = rows_to(500)
    app = console(book=book_of(a_line("/srv/runs/a", rows)))

    async def scenario(pilot) -> None:
        readout = app.screen.query_one("#curve-readout")
        assert "←/→ cursor" in str(readout.render())
        await pilot.press("right")  # the first press: the newest row
        tab = app.screen.query_one(CurvesTab)
        width = tab.plot_width
        assert tab.settings.cursor == width - 1
        text = str(readout.render())
        assert "update 500 " in text and "loss 4.667 " in text  # 3 + 1000/600
        await pilot.press(*["left"] * 20)
        column = width - 21
        assert tab.settings.cursor == column
        x = column_x(column, 512.0, 500 * 512.0, width)
        expected = min(range(1, 501), key=lambda update: abs(update * 512 - x))
        wanted = rows[expected - 1]
        text = str(readout.render())
        assert f"update {expected} " in text
        assert f"loss {wanted['loss']:.4g}" in text and f"gradient norm {wanted['grad_norm']:.4g}" in text
        assert f"time {(expected - 1) * 2 // 60}m{(expected - 1) * 2 % 60:02d}s" in text
        await redraw(pilot)
        # The cursor's column is drawn reversed on every plot.
        strip = plot_of(app, "lr").render()
        assert any("reverse" in str(span.style) for span in strip.spans)

    run(app, scenario)


def test_markers_sit_at_validations_cycle_ends_restarts_and_rollbacks() -> None:
    rows = rows_to(500)
    line = a_line("/srv/runs/a", rows)
    line.add_event(START + 2 * 330 + 1, "watchdog_restart", "relaunched")  # just after row 330: at row 331
    line.add_event(START + 2 * 420 + 1, "rolled_back", "rolled back to 400")  # at row 421
    app = console(book=book_of(line))

    async def scenario(pilot) -> None:
        await pilot.press("x")  # by update: the x of row u is u
        await redraw(pilot)
        plot = plot_of(app, "loss")
        width = plot.plot_width
        lines = plot.render().plain.splitlines()
        strip = lines[-2][10:]  # after the axis labels and the ├
        assert len(strip) == width

        def at(update: float) -> str:
            return strip[cell_column(update, 1, 500, width)]

        assert at(199) == "┆" and at(399) == "┆"  # the last rows of cycles 0 and 1
        assert at(100) == "◇" and at(300) == "◇" and at(500) == "◇"
        assert at(331) == "↻" and at(421) == "↶"
        assert strip.count("↻") == 1 and strip.count("↶") == 1
        assert marker_strip([(5.0, "validation"), (5.0, "rollback")], 0, 10, 5) == "  ↶  "

    run(app, scenario)


def test_a_probe_found_by_search_and_pinned_gets_a_plot_of_its_own() -> None:
    app = console(book=book_of(a_line("/srv/runs/a", rows_to(500))))

    async def scenario(pilot) -> None:
        await pilot.press("slash", *"firing", "m", "x", "backspace", "backspace", "left")
        await pilot.pause()
        # Keys typed in the search box are the search's, not the curves' keys.
        search = app.screen.query_one("#probe-search", Input)
        assert search.value == "firing" and search.cursor_position == 5
        settings = app.screen.query_one(CurvesTab).settings
        assert (settings.smoothing, settings.x_axis, settings.cursor) == (0.0, "tokens", None)
        table = app.screen.query_one(ProbeTable)
        app.refresh_views()
        assert table.row_count == 1 and table.selected_name == "val_64/probe/firing"
        await pilot.press("enter")  # from the search box to the table
        await pilot.press("enter")  # pin
        await pilot.pause()
        app.refresh_views()
        assert str(table.get_cell("val_64/probe/firing", "pin")) == "◉"
        app.screen.query_one("TabbedContent").active = "tab-curves"
        await pilot.pause()
        await redraw(pilot)
        plot = plot_of(app, "val_64/probe/firing")
        frame = plot.frame
        assert frame is not None
        trace = frame.pinned["val_64/probe/firing"]
        assert trace.xs == [update * 512.0 for update in (100, 200, 300, 400, 500)]
        assert trace.columns["val_64/probe/firing"] == [0.1, 0.2, 0.3, 0.4, 0.5]
        assert plot.grid is not None and math.isclose(plot.grid.y_high, 0.5)
        # Unpinned from the probes tab, the plot goes.
        app.screen.query_one("TabbedContent").active = "tab-probes"
        await pilot.pause()
        table.focus()
        await pilot.press("enter")
        await pilot.pause()
        assert not [plot for plot in app.screen.query(CurvePlot) if plot.pinned]

    run(app, scenario)


def resting_line(path: Path, rows: list[dict]) -> None:
    """A line's files as a finished line leaves them (no supervisor or trainer runs it)."""
    path.mkdir(parents=True)
    (path / "rows.jsonl").write_text("".join(json.dumps(item) + "\n" for item in rows))
    (path / "supervisor.json").write_text(json.dumps({"state": "finished", "pid": None}))


def test_a_pinned_training_metric_is_read_from_a_line_at_rest(tmp_path: Path) -> None:
    rows = rows_to(500)
    resting_line(tmp_path / "a", rows)
    app = console(book=book_of(a_line(tmp_path / "a", rows, state="finished")))

    async def scenario(pilot) -> None:
        tab = app.screen.query_one(CurvesTab)
        tab.toggle_pin("train/grad_norm/layer00")
        for _ in range(100):
            history = tab.pinned_rows.get("train/grad_norm/layer00")
            if history is not None and len(history.update) == 500:
                break
            await pilot.pause(0.05)
            app.refresh_views()
        await redraw(pilot)
        trace = plot_of(app, "train/grad_norm/layer00").frame.pinned["train/grad_norm/layer00"]  # type: ignore[union-attr]
        # Every row from rows.jsonl, not only the newest the console keeps.
        assert len(trace.xs) == 500 and trace.columns["train/grad_norm/layer00"][0] == 0.01

    run(app, scenario)


def test_a_branch_is_drawn_over_its_trunks_rows_before_the_fork(tmp_path: Path) -> None:
    trunk, branch = tmp_path / "trunk", tmp_path / "branch"
    resting_line(trunk, rows_to(400))
    entry = {"line": str(branch), "at_cycle": 1, "at_update": 300, "at_tokens": 300 * 512}
    (trunk / "branches.json").write_text(json.dumps({"branches": [entry]}))
    branch_rows = rows_to(500, first=301)
    resting_line(branch, branch_rows)
    (branch / "run.json").write_text(json.dumps({"model": {"preset": "ns-tiny"}, "data": {"line": "/nowhere"}}))
    app = console(book=book_of(a_line(branch, branch_rows, parent=str(trunk), state="finished")))

    async def scenario(pilot) -> None:
        tab = app.screen.query_one(CurvesTab)
        for _ in range(100):
            app.refresh_views()
            if tab.trunk is not None:
                break
            await pilot.pause(0.05)
        assert tab.trunk is not None and tab.trunk.update[-1] == 300  # the trunk up to the fork only
        await redraw(pilot)
        plot = plot_of(app, "loss")
        grid = plot.grid
        assert grid is not None and grid.x_low == 512.0  # the trunk's first row
        fork_column = cell_column(300 * 512, grid.x_low, grid.x_high, plot.plot_width)
        owners = [{line[column] for line in grid.layers} - {NO_LAYER} for column in range(plot.plot_width)]
        assert all(owner <= {0} for owner in owners[: fork_column - 1])  # the trunk's layer, dimmed
        assert all(2 in owner for owner in owners[fork_column + 1 :])  # the branch's own curve
        await pilot.press("right", *["left"] * (plot.plot_width - 3))
        assert "▸ trunk update" in str(app.screen.query_one("#curve-readout").render())

    run(app, scenario)


def line_with_run_json(line_dir: Path) -> dict:
    """A line directory with a run.json validating every 100 updates, checkpointing every 250 and
    planning 1M tokens; its run.json."""
    line_dir.mkdir()
    run_json = {
        "model": {"preset": "ns-tiny"}, "data": {"line": "/nowhere"},
        "lengths": [{"seq_len": 64}], "plan": [{"name": "trunk", "seq_len": 64, "tokens": 1_000_000}],
        "tokens_per_update": 512, "validation": {"every_updates": 100}, "checkpoints": {"every_updates": 250},
    }  # fmt: skip
    (line_dir / "run.json").write_text(json.dumps(run_json))
    return run_json


async def read_plan(pilot) -> EtaLine:
    """The header's ETA line once it has read run.json, the views refreshed."""
    eta = pilot.app.screen.query_one(EtaLine)
    for _ in range(100):
        if eta.plan is not None or eta.problem is not None:
            break
        await pilot.pause(0.05)
    assert eta.problem is None
    pilot.app.refresh_views()
    return eta


def test_the_header_says_what_comes_next_and_j_shows_run_json(tmp_path: Path) -> None:
    line_dir = tmp_path / "a"
    run_json = line_with_run_json(line_dir)
    app = console(book=book_of(a_line(line_dir, rows_to(420))))

    async def scenario(pilot) -> None:
        eta = await read_plan(pilot)
        text = str(eta.render())
        # One update every 2 s: validation at 500 in 160 s, checkpoint at 500 likewise;
        # 1,000,000 - 420 * 512 = 784,960 tokens left at 256 tokens/s = 3066 s.
        assert "validation u500 in ~2m" in text and "checkpoint u500 in ~2m" in text
        assert "plan 785.0K tokens left in ~51m" in text
        assert "data line end not planned yet" in text
        await pilot.press("j")
        assert isinstance(app.screen, RunConfigScreen)
        assert app.screen.text == json.dumps(run_json, indent=2)
        await pilot.press("escape")
        assert isinstance(app.screen, LineScreen)

    run(app, scenario)


def test_a_line_waiting_for_data_predicts_no_time_to_anything(tmp_path: Path) -> None:
    # Found in a walkthrough: waiting for its next cycle, the line still said "checkpoint u500 in ~2m"
    # and gave its plan's and data line's ends a time, from the pace it had before the wait.
    line_dir = tmp_path / "a"
    line_with_run_json(line_dir)
    line = a_line(line_dir, rows_to(420))
    line.heartbeat = {**line.heartbeat, "stage": "waiting-data", "cycle": 3}
    app = console(book=book_of(line))

    async def scenario(pilot) -> None:
        text = str((await read_plan(pilot)).render())
        assert text.startswith("next (once its data comes) ◇ validation u500  ⤓ checkpoint u500  plan 785.0K tokens left  ")
        assert " in ~" not in text

    run(app, scenario)


@pytest.mark.parametrize("ending", ["finished", "stopped", "lost"])
def test_a_line_that_nothing_runs_predicts_no_validation_or_checkpoint(tmp_path: Path, ending: str) -> None:
    line_dir = tmp_path / "a"
    line_with_run_json(line_dir)
    line = a_line(line_dir, rows_to(420), state="training" if ending == "lost" else ending)
    if ending == "lost":  # its supervisor and its trainer are gone while it trained
        line.mark_disconnected("no supervisor answers (Connection refused)", NOW)
        line.orphaned = True
    label = {"finished": "✓ finished", "stopped": "■ stopped", "lost": "✗ supervisor lost, trainer exited"}[ending]
    app = console(book=book_of(line))

    async def scenario(pilot) -> None:
        text = str((await read_plan(pilot)).render())
        assert text.startswith(f"next nothing: no trainer runs the line ({label})")
        assert "validation" not in text and "checkpoint" not in text
        assert "plan 785.0K tokens left  data line" in text  # what is left, with no time to it

    run(app, scenario)


def test_a_branch_rolled_back_to_its_fork_has_its_whole_plan_left(tmp_path: Path) -> None:
    # Found in a walkthrough: with no row of its own (rows.jsonl cut back to the fork), the branch
    # counted its tokens from 0, not from the fork, and showed the plan's end (253.6K) as left.
    trunk, branch = tmp_path / "trunk", tmp_path / "branch"
    resting_line(trunk, rows_to(400))
    entry = {"line": str(branch), "at_cycle": 1, "at_update": 300, "at_tokens": 300 * 512}
    (trunk / "branches.json").write_text(json.dumps({"branches": [entry]}))
    resting_line(branch, [])
    run_json = {"model": {"preset": "ns-tiny"}, "data": {"line": "/nowhere"}, "lengths": [{"seq_len": 64}],
                "plan": [{"name": "decay", "seq_len": 64, "tokens": 100_000}], "tokens_per_update": 512}
    (branch / "run.json").write_text(json.dumps(run_json))
    app = console(book=book_of(a_line(branch, [], parent=str(trunk), state="stopped", update=300)))

    async def scenario(pilot) -> None:
        eta = await read_plan(pilot)
        for _ in range(100):  # the fork is read with the plan
            if eta.plan is not None and eta.plan.fork is not None:
                break
            await pilot.pause(0.05)
        pilot.app.refresh_views()
        assert "plan 100.0K tokens left  data line" in str(eta.render())

    run(app, scenario)


def test_the_host_sits_beside_the_gpus_with_each_trainers_cpu_and_rss() -> None:
    sampler = HostSampler()
    sampler.watch([os.getpid()])
    first = sampler.read()
    second = sampler.read()
    assert first.processes[os.getpid()].cpu_percent is None  # a share needs two readings
    assert second.processes[os.getpid()].cpu_percent is not None and second.processes[os.getpid()].rss > 0
    assert 0 < second.memory_used < second.memory_total
    line = a_line("/srv/runs/a", rows_to(10))
    line.apply_status({**line.status, "trainer_pid": 5100})
    host = HostReading(37.0, 16, 20 * GIB, 64 * GIB, {5100: ProcessReading(98.0, int(1.5 * GIB))})
    reading = gpu_reading()
    with_host = GpuReading(reading.snapshot, reading.leases, host)

    async def panel_lines(width: int) -> list[str]:
        app = console(book=book_of(line), reading=with_host)
        async with app.run_test(size=(width, 44)) as pilot:
            await settle(pilot)
            printer = Console(width=width, record=True, file=io.StringIO())
            printer.print(app.screen.query_one(GpuPanel).content)
            return printer.export_text().splitlines()

    # Beside the GPUs where the panel is wide enough, under them where it is not.
    wide = asyncio.run(panel_lines(210))
    assert wide[0].index("host CPU 37% of 16 cores  RAM 20.0/64.0 GiB") > wide[0].index("GPU0")
    assert wide[1].rstrip().endswith("a                  trainer 5100  CPU   98%  RSS 1.5 GiB")
    narrow = asyncio.run(panel_lines(150))
    assert narrow[-2].startswith("host CPU 37%") and narrow[-1].startswith("a                  trainer 5100")


@pytest.mark.slow
def test_a_real_line_shows_its_next_validation_and_a_pinned_metric_fetched_from_its_supervisor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "run").mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("NSCONSOLE_HOST", str(tmp_path / "host.json"))
    (tmp_path / "host.json").write_text("{}")
    data = make_data_line(tmp_path / "data_root", prepare=1)
    line_path = make_line(tmp_path, data, **{"validation.every_updates": 4})
    supervisors = [start_supervisor(tmp_path, line_path)]

    async def scenario() -> None:
        app = ConsoleApp(refresh_interval=0.2)
        async with app.run_test(size=(150, 44)) as pilot:
            line: LineView = await until(pilot, lambda: app.book.get(line_id(line_path)), "the line")
            await until(pilot, lambda: (line.update or 0) >= 3, "three updates")
            # The row must be in the table (a refresh tick after the line came) before Enter opens it.
            await until(pilot, lambda: line.key in app.screen.query_one(LinesTable).rows, "the line's row")
            await pilot.press("enter")
            await until(pilot, lambda: isinstance(app.screen, LineScreen), "the line's screen")
            eta = app.screen.query_one(EtaLine)
            await until(pilot, lambda: "next ◇ validation u" in str(eta.render()), "the ETA line")
            tab = app.screen.query_one(CurvesTab)
            tab.toggle_pin("train/grad_norm/layer00")
            fetched = await until(
                pilot, lambda: len(tab.pinned_rows["train/grad_norm/layer00"].update) >= 3, "the metric's rows"
            )
            assert fetched
            history = tab.pinned_rows["train/grad_norm/layer00"]
            on_disk = [json.loads(text) for text in (line_path / "rows.jsonl").read_text().splitlines()]
            by_update = {item["update"]: item["train/grad_norm/layer00"] for item in on_disk}
            assert all(by_update[int(u)] == v for u, v in zip(history.update, history.values["train/grad_norm/layer00"]))
            await asyncio.to_thread(stop_supervisor, line_path)

    try:
        asyncio.run(scenario())
    finally:
        for process in supervisors:
            if process.poll() is None:
                process.kill()
                process.wait()


def test_an_average_of_a_constant_is_drawn_flat_not_as_its_rounding() -> None:
    readings = [1e-3] * 500
    smoothed = smooth(readings, 0.9)
    assert max(smoothed) != min(smoothed)  # the debiasing leaves rounding differences
    grid = draw_layers([Layer(list(range(500)), smoothed)], 40, 8)
    assert grid is not None and [row.strip() != "" for row in grid.rows].count(True) == 1
