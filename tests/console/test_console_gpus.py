"""The GPU panel on a 4-GPU host: every GPU with the line holding its lease, the lines waiting for it,
and the lines waiting for any free GPU -- read as the console reads them (NVML through the stand-in
pynvml, the real lease files), in the running app."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from helpers.console import NOW
from helpers.nvml import GIB, FakeNvmlHost, fake_uuid

from engine.gpu.devices import GpuLease
from nsconsole.app import ConsoleApp
from nsconsole.state import LineBook, LineFacts, LineView
from nsconsole.widgets.gpu_panel import BAR_WIDTH, GpuPanel, read_gpus
from nsconsole.widgets.host_panel import HostReading, ProcessReading, host_text
from nsconsole.widgets.lines_table import gpu_cell


def line_on(book: LineBook, path: Path, status: dict) -> LineView:
    line = LineView(f"{path}-id", path, LineFacts(preset="pssa-1.5m"))
    line.apply_status({"launches": 1, "crashes": 0, **status})
    book.add(line)
    return line


def panel_text(book: LineBook, selected: LineView | None) -> list[str]:
    """The GPU panel's lines in the running app, once it has read the GPUs (the real reader)."""
    app = ConsoleApp(book=book, attach=False, clock=lambda: NOW, gpu_reader=read_gpus, refresh_interval=3600)

    async def panel() -> list[str]:
        async with app.run_test(size=(170, 44)) as pilot:
            while app.gpu_reading is None:
                await pilot.pause(0.05)
            app.refresh_views()
            await pilot.pause()
            return app.screen.query_one(GpuPanel).render_text(app.gpu_reading, book, selected).plain.splitlines()

    return asyncio.run(panel())


def test_the_panel_shows_every_gpu_of_the_host_with_its_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    host = FakeNvmlHost(tmp_path / "nvml.json", count=4)
    host.install(monkeypatch)
    host.set_processes(0, [(5100, 60 * GIB)])
    host.set_processes(3, [(5103, 30 * GIB), (7777, 10 * GIB)])
    runs = tmp_path / "runs"
    book = LineBook()
    auto = ["auto-a", "auto-b", None, "tf-d"]
    held = []
    for index, name in enumerate(auto):
        if name is None:
            continue  # GPU 2: nobody's
        path = runs / name
        line_on(book, path, {"state": "training", "trainer_pid": 5100 + index, "gpu_index": index,
                             "gpu_uuid": fake_uuid(index), "gpu_candidates": [0, 1, 2, 3]})  # fmt: skip
        lease = GpuLease(index, path, fake_uuid(index))
        assert lease.try_acquire()
        held.append(lease)
    outside = GpuLease(2, tmp_path / "elsewhere" / "sweep", fake_uuid(2))  # a line this console does not list
    assert outside.try_acquire()
    held.append(outside)
    line_on(book, runs / "pinned-c", {"state": "waiting-gpu", "gpu_index": None, "gpu_candidates": [1]})
    line_on(book, runs / "auto-e", {"state": "waiting-gpu", "gpu_index": None, "gpu_candidates": [0, 1, 2, 3]})
    try:
        text = panel_text(book, None)
    finally:
        for lease in held:
            lease.release()
    rows = [row for row in text if row.startswith("GPU")]
    assert [row.split()[0] for row in rows] == ["GPU0", "GPU1", "GPU2", "GPU3"]
    assert rows[0].endswith("lease: auto-a")
    assert rows[1].endswith("lease: auto-b  waiting: pinned-c")
    assert rows[2].endswith("lease: sweep")
    assert rows[3].endswith("lease: tf-d") and "40.0/141.0 GiB" in rows[3]
    assert "auto-e waits for a free GPU (leases of 0, 1, 2, 3 held)" in text


def test_a_line_over_two_gpus_holds_both_leases_and_its_ranks_memory_is_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    host = FakeNvmlHost(tmp_path / "nvml.json", count=4)
    host.install(monkeypatch)
    # torchrun (6000) holds no GPU memory; its ranks 6001 and 6002 do, one GPU each; 7777 is another user's.
    host.set_processes(2, [(6001, 50 * GIB), (7777, 10 * GIB)])
    host.set_processes(3, [(6002, 50 * GIB)])
    book = LineBook()
    path = tmp_path / "runs" / "wide"
    line = line_on(book, path, {"state": "training", "trainer_pid": 6000, "trainer_children": [6001, 6002],
                                "gpu_index": 2, "gpu_uuid": fake_uuid(2), "gpu_indices": [2, 3],
                                "gpu_candidates": [2, 3]})  # fmt: skip
    assert line.trainer_pids == [6000, 6001, 6002]
    assert gpu_cell(line) == ("gpu2,3", "")
    leases = [GpuLease(index, path, fake_uuid(index)) for index in (2, 3)]
    assert all(lease.try_acquire() for lease in leases)
    try:
        text = panel_text(book, line)
    finally:
        for lease in leases:
            lease.release()
    rows = {row.split()[0]: row for row in text if row.startswith("GPU")}
    assert "lease: wide" in rows["GPU2"] and "lease: wide" in rows["GPU3"]
    # The bar: each rank's 50 GiB as the line's (█), the other user's 10 GiB as others' (▓).
    assert rows["GPU2"].count("█") == round(50 / 141 * BAR_WIDTH) and rows["GPU2"].count("▓") == round(10 / 141 * BAR_WIDTH)
    assert rows["GPU3"].count("█") == round(50 / 141 * BAR_WIDTH) and "▓" not in rows["GPU3"]


def test_the_host_column_sums_a_line_s_ranks() -> None:
    book = LineBook()
    line_on(book, Path("/runs/wide"), {"state": "training", "trainer_pid": 6000, "trainer_children": [6001, 6002],
                                       "gpu_index": 2, "gpu_indices": [2, 3]})  # fmt: skip
    processes = {6000: ProcessReading(1.0, GIB), 6001: ProcessReading(95.0, 4 * GIB), 6002: ProcessReading(97.0, 4 * GIB)}
    reading = HostReading(cpu_percent=50.0, cores=16, memory_used=20 * GIB, memory_total=128 * GIB, processes=processes)
    [row] = [row for row in host_text(reading, book).plain.splitlines() if row.startswith("wide")]
    assert "trainer 6000 +2  CPU  193%  RSS 9.0 GiB  GPU2,3" in row


def test_lines_of_one_name_are_told_apart_in_the_leases_and_the_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the lines table and the host column name them: `lease: line` beside `waiting: line` could
    be either line."""
    host = FakeNvmlHost(tmp_path / "nvml.json", count=2)
    host.install(monkeypatch)
    host.set_processes(0, [(5100, 30 * GIB)])
    book = LineBook()
    holder, waiter, other = tmp_path / "c" / "line", tmp_path / "d" / "line", tmp_path / "e" / "line"
    line_on(book, holder, {"state": "training", "trainer_pid": 5100, "gpu_index": 0, "gpu_uuid": fake_uuid(0),
                           "gpu_candidates": [0]})  # fmt: skip
    line_on(book, waiter, {"state": "waiting-gpu", "gpu_index": None, "gpu_candidates": [0]})
    line_on(book, other, {"state": "waiting-gpu", "gpu_index": None, "gpu_candidates": [0, 1]})
    lease = GpuLease(0, holder, fake_uuid(0))
    assert lease.try_acquire()
    try:
        text = panel_text(book, None)
    finally:
        lease.release()
    [gpu0] = [row for row in text if row.startswith("GPU0")]
    assert gpu0.endswith("lease: ⚠ …/c/line  waiting: ⚠ …/d/line"), gpu0
    assert "⚠ …/e/line waits for a free GPU (leases of 0, 1 held)" in text
