"""The host beside the GPU panel: CPU use, memory, and each line's trainer process (CPU, RSS and the
GPU it trains on).

Read with psutil on the GPU reading's thread and cadence (`gpu_panel.read_gpus`), never on the
UI thread. A process's CPU share is measured between two readings, so the sampler keeps each
watched process from one reading to the next; the first reading of a process shows "—".
The panel tells the sampler which processes to watch: the trainers its lines name.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import psutil
from rich.text import Text

from nsconsole.state import LineBook
from nsconsole.widgets import format as fmt


@dataclass(frozen=True)
class ProcessReading:
    """One watched process at one reading."""

    cpu_percent: float | None
    """Its CPU use since the previous reading, in % of one core (None: first reading)."""
    rss: int
    """Its resident memory, bytes."""


@dataclass(frozen=True)
class HostReading:
    """The host at one reading."""

    cpu_percent: float
    """CPU use of all cores together since the previous reading, % of the whole machine."""
    cores: int
    memory_used: int
    """Memory in use (total less available), bytes."""
    memory_total: int
    processes: dict[int, ProcessReading] = field(default_factory=dict)
    """The watched processes still running, by pid."""


class HostSampler:
    """Reads the host and the watched processes (see the module docstring)."""

    def __init__(self) -> None:
        self._watched: frozenset[int] = frozenset()
        self._processes: dict[int, psutil.Process] = {}

    def watch(self, pids: Iterable[int]) -> None:
        """The processes the next readings measure (called on the UI thread; read on another)."""
        self._watched = frozenset(pids)

    def read(self) -> HostReading:
        memory = psutil.virtual_memory()
        readings = {}
        watched = self._watched
        for pid in list(self._processes):
            if pid not in watched:
                del self._processes[pid]
        for pid in watched:
            known = self._processes.get(pid)
            try:
                process = known if known is not None and known.is_running() else psutil.Process(pid)
                cpu = process.cpu_percent(interval=None)
                readings[pid] = ProcessReading(cpu if process is known else None, process.memory_info().rss)
                self._processes[pid] = process
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                self._processes.pop(pid, None)
        return HostReading(
            cpu_percent=psutil.cpu_percent(interval=None),
            cores=psutil.cpu_count() or 1,
            memory_used=memory.total - memory.available,
            memory_total=memory.total,
            processes=readings,
        )


HOST_SAMPLER = HostSampler()
"""The console's one sampler: its processes' CPU shares carry from one reading to the next."""


def host_text(reading: HostReading, book: LineBook) -> Text:
    """The host's column beside the GPUs."""
    text = Text()
    text.append("host ", style="bold")
    text.append(f"CPU {reading.cpu_percent:.0f}% of {reading.cores} cores  ")
    text.append(f"RAM {fmt.gib(reading.memory_used)}/{fmt.gib(reading.memory_total)} GiB")
    names = Counter(line.name for line in book)
    for line in book:
        pids = line.trainer_pids
        process = reading.processes.get(pids[0]) if pids else None
        if process is None:
            continue
        # A line over several processes (torchrun and its ranks) is their sum.
        group = [reading.processes[pid] for pid in pids if pid in reading.processes]
        shares = [member.cpu_percent for member in group]
        cpu = "—" if None in shares else f"{sum(share or 0.0 for share in shares):.0f}%"
        rss = sum(member.rss for member in group)
        ranks = f" +{len(pids) - 1}" if len(pids) > 1 else ""
        label = fmt.line_label(line.name, line.path, names[line.name] > 1, width=16)
        text.append(f"\n{label[:18]:<18} ", style="bold")
        text.append(f"trainer {pids[0]}{ranks}  CPU {cpu:>5}  RSS {fmt.gib(rss)} GiB")
        if line.gpu_index is not None:
            text.append("  GPU" + ",".join(str(index) for index in line.gpu_indices))
    return text
