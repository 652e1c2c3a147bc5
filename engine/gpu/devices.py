"""The GPUs as NVML sees them, and the GPU lease: one training line per GPU.

`gpu_snapshot()` reads every device's memory, utilisation and compute processes (with each
process's memory, through `nvmlDeviceGetComputeRunningProcesses_v3` where the driver has it), or
returns a clean "no GPU" snapshot with the reason on a machine without an NVIDIA driver.

The lease on GPU `i` (NVML's index, nvidia-smi's: the physical GPU, whatever CUDA_VISIBLE_DEVICES
says; `engine/gpu/placement.py`) is an exclusive `fcntl.flock` on `<run dir>/gpu<i>.lock` (the
registry's directory, `engine.supervisor.registry.runtime_dir()`: one path for every process of the
user on this host, and one a logout does not remove, so the lock file a holder locked is the one the
next line opens), with the holder's line path, pid and the GPU's index and UUID written in the file.
`take_free_leases` takes the first N free leases of a list of GPUs, all or none. A flock belongs to the open file description:
the supervisor takes it, hands the descriptor to the trainer (`pass_fds`) and closes its own
copy, so the lease lives exactly as long as the trainer; the kernel releases it however the
trainer ends (kill -9 included). Between a trainer's exit and its relaunch another line waiting
for the GPU may take it: lines that share a GPU wait for each other, none has priority.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from engine.supervisor.registry import runtime_dir

_nvml_lock = threading.Lock()
_nvml_ready: bool | None = None
_nvml_failure = ""


@dataclass(frozen=True)
class GpuProcess:
    """A compute process on a device."""

    pid: int
    """Its pid (as the driver sees it: the host's pid namespace)."""
    used_memory: int | None
    """Device memory it holds in bytes; None where the driver does not say."""


@dataclass(frozen=True)
class GpuDevice:
    """One device's state at the moment of the snapshot."""

    index: int
    """NVML index (the CUDA index where CUDA_DEVICE_ORDER=PCI_BUS_ID)."""
    name: str
    """Product name."""
    uuid: str
    """Stable identifier."""
    memory_total: int
    """Bytes."""
    memory_used: int
    """Bytes in use by every process together."""
    utilization: int | None
    """Percent of the last sample period a kernel ran; None where not supported (e.g. MIG)."""
    processes: list[GpuProcess] = field(default_factory=list)
    """Compute processes on the device."""


@dataclass(frozen=True)
class GpuSnapshot:
    """Every device, or why there are none to show."""

    available: bool
    """False on a machine without an NVIDIA driver (or where NVML fails)."""
    reason: str
    """Why it is not available ("" when it is)."""
    driver: str
    """Driver version ("" when not available)."""
    devices: list[GpuDevice]
    """The devices, by index."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _init_nvml() -> bool:
    global _nvml_ready, _nvml_failure
    with _nvml_lock:
        if _nvml_ready is None:
            try:
                import pynvml

                pynvml.nvmlInit()
                _nvml_ready = True
            except Exception as error:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
                _nvml_ready = False
                _nvml_failure = f"no NVIDIA GPU: {error}"
        return _nvml_ready


def gpu_snapshot() -> GpuSnapshot:
    """Read every device now (tens of microseconds per device on a live driver)."""
    if not _init_nvml():
        return GpuSnapshot(available=False, reason=_nvml_failure, driver="", devices=[])
    import pynvml

    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        devices = [_read_device(pynvml, index) for index in range(pynvml.nvmlDeviceGetCount())]
    except pynvml.NVMLError as error:
        return GpuSnapshot(available=False, reason=f"NVML failed: {error}", driver="", devices=[])
    return GpuSnapshot(available=True, reason="", driver=driver, devices=devices)


def _read_device(pynvml: Any, index: int) -> GpuDevice:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    try:
        utilization: int | None = int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except pynvml.NVMLError:
        utilization = None
    return GpuDevice(
        index=index,
        name=_text(pynvml.nvmlDeviceGetName(handle)),
        uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
        memory_total=int(memory.total),
        memory_used=int(memory.used),
        utilization=utilization,
        processes=_compute_processes(pynvml, handle),
    )


def _compute_processes(pynvml: Any, handle: Any) -> list[GpuProcess]:
    # v3 reports per-process memory on current drivers; older bindings or drivers lack it.
    generic = pynvml.nvmlDeviceGetComputeRunningProcesses
    reader = getattr(pynvml, "nvmlDeviceGetComputeRunningProcesses_v3", generic)
    try:
        processes = reader(handle)
    except pynvml.NVMLError_FunctionNotFound:
        processes = generic(handle)
    return [
        GpuProcess(pid=int(process.pid), used_memory=_bytes_or_none(process.usedGpuMemory))
        for process in processes
    ]


def _bytes_or_none(value: int | None) -> int | None:
    return None if value is None else int(value)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


# ---- the lease ---------------------------------------------------------------------------------


def lease_path(index: int) -> Path:
    return runtime_dir() / f"gpu{index}.lock"


@dataclass(frozen=True)
class LeaseHolder:
    """Who holds a GPU's lease, as written in its lock file."""

    line: str
    """The holding line's directory."""
    pid: int
    """The process that took the lease (the supervisor; the trainer holds it after)."""
    since: float
    """When it was taken (Unix time)."""
    gpu: int | None = None
    """The GPU's NVML index as the holder wrote it (None: not written)."""
    uuid: str = ""
    """The GPU's UUID as the holder wrote it ("" where it did not know it)."""


class GpuLease:
    """The exclusive lease on one GPU; see the module docstring."""

    def __init__(self, index: int, line: Path | str, uuid: str = "") -> None:
        self.index = index
        """The GPU's NVML index (the lock file's number)."""
        self.uuid = uuid
        """The GPU's UUID, written in the lock file for whoever reads the holder."""
        self.line = os.path.realpath(line)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def fileno(self) -> int:
        """The lock's descriptor, to hand to the process that keeps the lease (`pass_fds`)."""
        if self._fd is None:
            raise RuntimeError(f"the lease on GPU {self.index} is not held")
        return self._fd

    def try_acquire(self) -> bool:
        """Take the lease if it is free; never waits."""
        if self._fd is not None:
            return True
        fd = os.open(lease_path(self.index), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._fd = fd
        # Written after the lock is ours: a reader sees the current holder, or an empty file.
        self.record_holder(os.getpid())
        return True

    def record_holder(self, pid: int) -> None:
        """Name `pid` in the lock file as the holder (the trainer the descriptor is handed to)."""
        record = json.dumps(
            {"line": self.line, "pid": pid, "since": time.time(), "gpu": self.index, "uuid": self.uuid}
        )
        fd = self.fileno()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record.encode() + b"\n", 0)

    def acquire(
        self,
        timeout: float | None = None,
        poll_seconds: float = 1.0,
        on_wait: Callable[[LeaseHolder | None, float], None] | None = None,
    ) -> bool:
        """Wait for the lease up to `timeout` seconds (None: for ever); True once held.

        `on_wait(holder, waited_seconds)` is called at every poll while another line holds it
        (the supervisor notifies a long wait from there).
        """
        started = time.monotonic()
        while not self.try_acquire():
            waited = time.monotonic() - started
            if timeout is not None and waited >= timeout:
                return False
            if on_wait is not None:
                on_wait(lease_holder(self.index), waited)
            remaining = poll_seconds if timeout is None else min(poll_seconds, timeout - waited)
            time.sleep(max(remaining, 0.0))
        return True

    def release(self) -> None:
        """Close this process's descriptor (a process that was handed it keeps the lease)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> GpuLease:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def take_free_leases(leases: Sequence[GpuLease], count: int = 1) -> list[GpuLease] | None:
    """The first `count` of `leases` that are free, taken now (in the order given), or None -- and
    none held -- when fewer are free: a line that needs N GPUs never sits on part of them while it
    waits (two such lines would each hold what the other waits for)."""
    taken: list[GpuLease] = []
    for lease in leases:
        if len(taken) == count:
            break
        if lease.try_acquire():
            taken.append(lease)
    if len(taken) < count:
        for lease in taken:
            lease.release()
        return None
    return taken


def lease_holder(index: int) -> LeaseHolder | None:
    """Who holds GPU `index`'s lease now, or None when it is free."""
    path = lease_path(index)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        try:
            # A shared lock succeeds only when nobody holds the exclusive one.
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_holder(fd)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _read_holder(fd: int) -> LeaseHolder:
    with contextlib.suppress(ValueError, KeyError, TypeError, OSError):
        record = json.loads(os.pread(fd, 4096, 0))
        gpu = record.get("gpu")  # absent in the files of older versions
        return LeaseHolder(
            line=str(record["line"]), pid=int(record["pid"]), since=float(record["since"]),
            gpu=gpu if isinstance(gpu, int) else None, uuid=str(record.get("uuid") or ""),
        )
    # Held, but the holder has not written its record yet (or it is unreadable).
    return LeaseHolder(line="", pid=0, since=0.0)
