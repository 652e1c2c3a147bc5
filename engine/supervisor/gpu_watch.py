"""What the supervisor reads of the GPUs (through NVML; no CUDA in the supervisor's process)."""

from __future__ import annotations

from collections.abc import Sequence

from engine.gpu.devices import gpu_snapshot


def processes_on_gpu(index: int, exclude: Sequence[int]) -> list[int]:
    """Pids of the compute processes on GPU `index` but those in `exclude` (none without NVML)."""
    snapshot = gpu_snapshot()
    if not snapshot.available or index >= len(snapshot.devices):
        return []
    return sorted(process.pid for process in snapshot.devices[index].processes if process.pid not in exclude)


def memory_of_others_on_gpu(index: int) -> int | None:
    """Bytes the compute processes on GPU `index` hold together (the supervisor holds none); None
    where the driver does not say (then they are not taken to fit anything)."""
    snapshot = gpu_snapshot()
    if not snapshot.available or index >= len(snapshot.devices):
        return 0
    used = [process.used_memory for process in snapshot.devices[index].processes]
    return None if any(value is None for value in used) else sum(used)


def gpu_index(device: str) -> int | None:
    """The GPU a run.json `device` trains on (None: the CPU), without initialising CUDA here."""
    if device == "cpu":
        return None
    if device == "auto":
        return 0 if gpu_snapshot().available else None
    return int(device.split(":", 1)[1]) if ":" in device else 0
