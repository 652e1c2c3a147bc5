"""The GPU panel: every GPU of the host (NVML's index: the physical GPU, whatever a line's
CUDA_VISIBLE_DEVICES) with its memory split between the selected line, other processes, the
reserve and what is free; its utilisation as a sparkline; the line holding its lease and the lines
waiting for it; whether the selected line shares the GPU. Lines that wait for any free GPU
(`auto`, with every lease held) are listed under the GPUs. A machine without a GPU shows why,
once. Beside it, the host: CPU, memory and each line's trainer process (`widgets/host_panel.py`),
read with the GPUs.

Memory segments are drawn with different characters (█ this line, ▓ other processes,
░ the reserve, · free) with a legend, so the split reads without colour.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rich.cells import cell_len
from rich.table import Table
from rich.text import Text

from engine.gpu.devices import GpuSnapshot, LeaseHolder, gpu_snapshot, lease_holder
from nsconsole.state import LineBook, LineView
from nsconsole.widgets import format as fmt
from nsconsole.widgets.host_panel import HOST_SAMPLER, HostReading, host_text
from nsconsole.widgets.plot import sparkline
from nsconsole.widgets.quiet_static import QuietStatic, text_height, text_key

UTILISATION_HISTORY = 120
"""Utilisation samples kept per GPU (a minute at the panel's 2 Hz)."""
BAR_WIDTH = 40
SPARK_WIDTH = 60
HOST_GAP = 3
"""Cells between the GPUs and the host beside them."""


@dataclass(frozen=True)
class GpuReading:
    """One look at the GPUs: NVML's snapshot and each device's lease holder."""

    snapshot: GpuSnapshot
    """What NVML reports (or why there is nothing)."""
    leases: list[LeaseHolder | None] = field(default_factory=list)
    """The holder of each device's lease, by index (None: free)."""
    host: HostReading | None = None
    """The host's CPU, memory and trainer processes, read at the same time (None: not read)."""


GpuReader = Callable[[], GpuReading]
"""Where the app gets its readings (`read_gpus`, or frozen ones in the snapshot tests)."""


def read_gpus() -> GpuReading:
    """The GPUs and the host now, from NVML, the lease files and psutil (call it off the UI thread)."""
    snapshot = gpu_snapshot()
    return GpuReading(snapshot, [lease_holder(device.index) for device in snapshot.devices], HOST_SAMPLER.read())


def memory_bar(
    total: int, this_line: int, others: int, reserve: int, width: int = BAR_WIDTH
) -> list[tuple[str, int, str]]:
    """(character, cells, segment) runs of a memory bar of `width` cells, in display order."""
    if total <= 0:
        return [("·", width, "free")]
    free = max(0, total - this_line - others - reserve)
    segments = [("█", this_line, "line"), ("▓", others, "others"), ("░", reserve, "reserve"), ("·", free, "free")]
    cells = [round(size / total * width) for _, size, _ in segments]
    cells[-1] = max(0, width - sum(cells[:-1]))  # rounding lands on the free space
    return [(char, count, name) for (char, _, name), count in zip(segments, cells) if count > 0]


class GpuPanel(QuietStatic):
    """See the module docstring; `show(reading, book, selected)` redraws it."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.utilisation: dict[int, deque[float | None]] = {}

    def record(self, reading: GpuReading) -> None:
        """Add a utilisation sample per device (a reading taken on the panel's cadence)."""
        for device in reading.snapshot.devices:
            history = self.utilisation.setdefault(device.index, deque(maxlen=UTILISATION_HISTORY))
            history.append(None if device.utilization is None else float(device.utilization))

    def show(self, reading: GpuReading | None, book: LineBook, selected: LineView | None) -> None:
        HOST_SAMPLER.watch(pid for line in book for pid in line.trainer_pids)
        gpus = self.render_text(reading, book, selected)
        host = host_text(reading.host, book) if reading is not None and reading.host is not None else None
        # Most ticks of a line watched for hours show what the panel shows: nothing is repainted
        # then; and a new reading (the host's CPU share every few seconds) repaints the panel alone
        # unless its height changes (see `QuietStatic`).
        width = self.content_size.width
        if host is None:
            self.show_text(gpus)
            return
        key = (text_key(gpus), text_key(host), width)
        if _widest(gpus) + HOST_GAP + _widest(host) <= width:
            beside = Table.grid(padding=(0, HOST_GAP, 0, 0))
            beside.add_row(gpus, host)
            self.show_content(beside, key, max(len(gpus.plain.split("\n")), len(host.plain.split("\n"))))
        else:  # too narrow for both side by side: the host under the GPUs
            stacked = Text("\n").join([gpus, host])
            self.show_content(stacked, key, text_height(stacked, width))

    def render_text(self, reading: GpuReading | None, book: LineBook, selected: LineView | None) -> Text:
        theme = self.app.current_theme
        text = Text()
        if reading is None:
            return Text("GPUs: reading…", style="dim")
        snapshot = reading.snapshot
        if not snapshot.available:
            text.append("○ no GPU", style="bold")
            text.append(f"  {snapshot.reason or 'NVML reports no device'}; lines train on the CPU", style="dim")
            return text
        by_path = {line.path: line for line in book}
        names = Counter(line.name for line in book)
        trainer_pids: dict[int, LineView] = {line.trainer_pid: line for line in book if line.trainer_pid}
        selected_pids = set(selected.trainer_pids) if selected is not None else set()  # every rank's
        for device in snapshot.devices:
            if text:
                text.append("\n")
            this_line = sum(process.used_memory or 0 for process in device.processes if process.pid in selected_pids)
            others = max(0, device.memory_used - this_line)
            sharing = selected is not None and selected.facts.sharing
            reserve = (selected.facts.share_reserve_bytes or 0) if sharing and selected else 0
            reserve = min(reserve, max(0, device.memory_total - device.memory_used))
            text.append(f"GPU{device.index} ", style="bold")
            text.append(f"{device.name[:20]:<20} ")
            for char, cells, segment in memory_bar(device.memory_total, this_line, others, reserve):
                style = {"line": theme.primary, "others": theme.warning, "reserve": theme.secondary}.get(segment, "dim")
                text.append(char * cells, style=style or "")
            text.append(f" {fmt.gib(device.memory_used)}/{fmt.gib(device.memory_total)} GiB  ")
            holder = reading.leases[device.index] if device.index < len(reading.leases) else None
            text.append(f"lease: {_holder_name(holder, by_path, trainer_pids, names)}")
            if selected is not None:
                text.append(f"  sharing: {'on' if sharing else 'off'}")
            waiting = [_label(line, names) for line in book if line.waiting_for_gpus == [device.index]]
            if waiting:
                text.append(f"  waiting: {', '.join(waiting)}", style=theme.warning or "")
            history = self.utilisation.get(device.index, deque())
            utilisation = "—" if device.utilization is None else f"{device.utilization}%"
            text.append(f"\n{'':<26}utilisation {utilisation:>4} ")
            text.append(sparkline(list(history), SPARK_WIDTH, 0.0, 100.0), style=theme.success or "")
        for line in book:
            candidates = line.waiting_for_gpus
            if len(candidates) > 1:
                gpus = ", ".join(str(index) for index in candidates)
                text.append(f"\n{_label(line, names)} waits for a free GPU (leases of {gpus} held)",
                            style=theme.warning or "")
        text.append("\n█ this line  ▓ other processes  ░ reserve  · free", style="dim")
        return text


def _widest(text: Text) -> int:
    return max((cell_len(line) for line in text.plain.splitlines()), default=0)


def _label(line: LineView, names: Counter[str]) -> str:
    """The line as the lines table names it (two of one name by their short paths)."""
    return fmt.line_label(line.name, line.path, names[line.name] > 1, width=24)


def _holder_name(
    holder: LeaseHolder | None, by_path: dict[str, LineView], trainer_pids: dict[int, LineView], names: Counter[str]
) -> str:
    if holder is None:
        return "free"
    line = by_path.get(holder.line) or trainer_pids.get(holder.pid)
    if line is not None:
        return _label(line, names)
    return Path(holder.line).name or f"pid {holder.pid}"

