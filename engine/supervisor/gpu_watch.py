"""What the supervisor reads of the GPUs (through NVML; no CUDA in the supervisor's process).

GPUs are named by NVML's index, the physical GPU whatever CUDA_VISIBLE_DEVICES says
(`engine/gpu/placement.py`); every reading goes through this module's `gpu_snapshot`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from engine.gpu.devices import GpuDevice, gpu_snapshot
from engine.gpu.placement import PhysicalGpu, gpu_candidates


def _device(index: int) -> GpuDevice | None:
    snapshot = gpu_snapshot()
    if not snapshot.available:
        return None
    return next((device for device in snapshot.devices if device.index == index), None)


def processes_on_gpu(index: int, exclude: Sequence[int]) -> list[int]:
    """Pids of the compute processes on GPU `index` but those in `exclude` (none without NVML)."""
    device = _device(index)
    if device is None:
        return []
    return sorted(process.pid for process in device.processes if process.pid not in exclude)


def memory_of_others_on_gpu(index: int) -> int | None:
    """Bytes the compute processes on GPU `index` hold together (the supervisor holds none); None
    where the driver does not say (then they are not taken to fit anything)."""
    device = _device(index)
    if device is None:
        return 0
    used = [process.used_memory for process in device.processes]
    return None if any(value is None for value in used) else sum(used)


def line_gpus(device: str, degree: int = 1, environ: Mapping[str, str] | None = None) -> list[PhysicalGpu] | None:
    """The GPUs a line with run.json's `device` and `parallel.degree` may lease, in the order to try
    them (None: the CPU); `PlacementError` when it names none there is
    (`engine.gpu.placement.gpu_candidates`)."""
    return gpu_candidates(device, gpu_snapshot(), environ, degree)
