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
from nsconsole.widgets.gpu_panel import GpuPanel, read_gpus


def line_on(book: LineBook, path: Path, status: dict) -> LineView:
    line = LineView(f"{path.name}-id", path, LineFacts(preset="pssa-1.5m"))
    line.apply_status({"launches": 1, "crashes": 0, **status})
    book.add(line)
    return line


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
    app = ConsoleApp(book=book, attach=False, clock=lambda: NOW, gpu_reader=read_gpus, refresh_interval=3600)

    async def panel() -> list[str]:
        async with app.run_test(size=(170, 44)) as pilot:
            while app.gpu_reading is None:
                await pilot.pause(0.05)
            app.refresh_views()
            await pilot.pause()
            return app.screen.query_one(GpuPanel).render_text(app.gpu_reading, book, None).plain.splitlines()

    try:
        text = asyncio.run(panel())
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
