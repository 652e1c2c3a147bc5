"""A console app on a frozen line book (fixed clock, rows and GPU readings) for snapshots and keys."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TypeVar

from engine.gpu.devices import GpuDevice, GpuProcess, GpuSnapshot, LeaseHolder
from engine.units import GIB
from nsconsole.app import ConsoleApp
from nsconsole.state import LineBook, LineFacts, LineView
from nsconsole.widgets.gpu_panel import GpuPanel, GpuReading

NOW = 1_800_000_000.0


SIZE = (150, 40)


def _bank_probes(update: int, blocks: int) -> dict[str, float]:
    """Per-block memory probes of a 512-slot bank that fills, then overwrites and defends."""
    probes = {}
    for block in range(blocks):
        appended = min(512, int(update * (1.3 - 0.4 * block)))
        readings = {
            "occupancy": appended / 512, "writes": appended,
            "overwrites": max(0, int(update * (1.3 - 0.4 * block)) - 512) // 2,
            "defended": int(update * (0.05 + 0.1 * block)),
            "confidence_mean": 0.95 - 0.0005 * update + 0.03 * block,
            "confidence_min": 0.2 + 0.1 * block - 0.0002 * update,
            "age_mean": update / 4 + 10 * block, "age_max": 0.9 * update - 20 * block,
        }  # fmt: skip
        probes.update({f"val_64/pssa/block{block:02d}/{name}": value for name, value in readings.items()})
    return probes


def rows_of(count: int, base: float, seed: float, memory_blocks: int = 0) -> list[dict]:
    rows = []
    for update in range(1, count + 1):
        tokens = update * 512
        loss = 7.0 * math.exp(-update / 150) + base + 0.05 * math.sin(update * seed)
        rows.append({
            "update": update, "tokens": tokens, "loss": loss, "lr": 3e-3 * min(1.0, (tokens - 512) / 20000),
            "grad_norm": 1.0 + 0.3 * math.cos(update / 7), "tokens_per_s": 1700 + 30 * math.sin(update / 11),
            "cycle": update // 200, "stage": "trunk", "skipped": False, "tokens_per_update": 512, "seq_len": 64,
        })
        if update % 100 == 0:
            rows.append({
                "update": update, "tokens": tokens, "seq_len": 64, "val_64/mix": loss + 0.2,
                "val_64/text": loss + 0.25, "val_64/pssa/memory_occupancy": min(1.0, update / 400),
                "val_64/pssa/read_entropy": 2.0 - update / 500, "opt/decay/update_ratio": 1e-3 * (1 + update / 1000),
                **_bank_probes(update, memory_blocks),
            })
    return rows


def frozen_book(memory_blocks: int = 0) -> LineBook:
    """Three lines: a healthy PSSA trunk, a transformer whose loss just spiked, one whose supervisor is gone.

    memory_blocks > 0 gives the PSSA line's validations per-block memory probes (the memory tab's).
    """
    book = LineBook()
    schedule = lambda tokens: 3e-3 * min(1.0, tokens / 20000)  # noqa: E731
    specs = [
        ("pssa-trunk", "pssa-1.5m", 1, 0, 3.0, 1.0),
        ("tf-baseline", "transformer-1.5m", 3, None, 3.4, 1.7),
        ("ns-probe", "ns-tiny", 1, None, 3.1, 2.3),
    ]
    for index, (name, preset, launches, gpu, base, seed) in enumerate(specs):
        reserve = 8.0 if gpu is not None else None  # the GPU line shares its GPU, leaving 8 GiB to others
        facts = LineFacts(preset=preset, schedule=schedule, share_reserve_gb=reserve)
        line = LineView(f"{name}-id", f"/srv/runs/{name}", facts)
        line.apply_hello({"epoch": f"epoch{index}", "pid": 4100 + index}, NOW - 3600)
        line.apply_status({
            "state": "training", "launches": launches, "crashes": launches - 1, "gpu_index": gpu,
            "trainer_pid": 5100 + index,
            "latest_checkpoint": 400, "preset": preset,
            "heartbeat": {"time": NOW - 2 - 50 * index, "update": 500, "stage": "training", "pid": 5100 + index},
        })
        rows = rows_of(500, base, seed, memory_blocks if preset.startswith("pssa") else 0)
        if name == "tf-baseline":
            rows[-2] = {**rows[-2], "loss": 9.5}  # a spike on the newest training row (before its validation)
        line.apply_rows(rows, 0)
        line.add_event(NOW - 3000, "launched", "trainer launched (pid 5101)")
        line.add_event(NOW - 600, "watchdog_restart", "no heartbeat for 1800 s: the trainer was killed and is relaunched", "warning")
        line.disk_free, line.disk_total = 800 * GIB, 2000 * GIB
        if name == "ns-probe":
            line.mark_disconnected("no supervisor answers (Connection refused)", NOW - 30)
        line.refresh_health(NOW)
        book.add(line)
    return book


def gpu_reading(utilisation: int = 87) -> GpuReading:
    device = GpuDevice(
        index=0, name="NVIDIA H200", uuid="GPU-0", memory_total=140 * GIB, memory_used=96 * GIB,
        utilization=utilisation, processes=[GpuProcess(5100, 80 * GIB), GpuProcess(7777, 16 * GIB)],
    )
    snapshot = GpuSnapshot(available=True, reason="", driver="580.159.04", devices=[device])
    return GpuReading(snapshot, [LeaseHolder("/srv/runs/pssa-trunk", 5100, NOW - 3600)])


NO_GPU = GpuReading(GpuSnapshot(False, "no NVIDIA GPU: NVML Shared Library Not Found", "", []))


def console(theme: str = "dark", book: LineBook | None = None, reading: GpuReading | None = None) -> ConsoleApp:
    frozen = reading or gpu_reading()
    return ConsoleApp(
        theme_name=theme, book=frozen_book() if book is None else book, attach=False,
        clock=lambda: NOW, gpu_reader=lambda: frozen, refresh_interval=3600,
    )


async def settle(pilot) -> None:
    """Wait for the first GPU reading, give the panel a frozen utilisation history, draw."""
    app = pilot.app
    while app.gpu_reading is None:
        await pilot.pause(0.05)
    for panel in app.screen.query(GpuPanel):
        panel.utilisation.clear()
        for step in range(30):
            panel.record(gpu_reading(int(50 + 45 * math.sin(step / 4))))
    app.refresh_views()
    await pilot.pause()


T = TypeVar("T")


async def until(pilot, condition: Callable[[], T], what: str, timeout: float = 120.0) -> T:
    """Let the app run until `condition()` is truthy; its value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        await pilot.pause(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def book_of(*lines: LineView) -> LineBook:
    """A book holding `lines`, in order."""
    book = LineBook()
    for line in lines:
        book.add(line)
    return book
