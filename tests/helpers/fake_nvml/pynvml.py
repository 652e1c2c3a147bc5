"""A stand-in `pynvml` for tests: the host it reports is the JSON file `$FAKE_NVML_HOST` names.

Put this directory first on a process's `sys.path` (PYTHONPATH for a child) and `import pynvml`
finds it, so the project's NVML code (`engine.gpu.devices.gpu_snapshot`) runs unchanged against
a host of the test's making. The file is read at `nvmlDeviceGetCount` and at each handle, so a
test changes the processes on a GPU by rewriting it (atomically: `helpers.nvml.FakeNvmlHost`).
Only what `engine.gpu.devices` calls is here.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any

HOST_VARIABLE = "FAKE_NVML_HOST"


class NVMLError(Exception):
    """pynvml's error base."""


class NVMLError_FunctionNotFound(NVMLError):  # noqa: N801 (pynvml's name)
    pass


class NVMLError_LibraryNotFound(NVMLError):  # noqa: N801 (pynvml's name)
    pass


def _host() -> dict[str, Any]:
    path = os.environ.get(HOST_VARIABLE)
    if not path:
        raise NVMLError_LibraryNotFound("NVML Shared Library Not Found (no $FAKE_NVML_HOST)")
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def nvmlInit() -> None:  # noqa: N802 (pynvml's names, here and below)
    _host()


def nvmlSystemGetDriverVersion() -> str:  # noqa: N802
    return str(_host().get("driver", "fake"))


def nvmlDeviceGetCount() -> int:  # noqa: N802
    return len(_host()["devices"])


def nvmlDeviceGetHandleByIndex(index: int) -> dict[str, Any]:  # noqa: N802
    devices = _host()["devices"]
    if not 0 <= index < len(devices):
        raise NVMLError(f"Invalid Argument: no GPU {index}")
    return devices[index]


def nvmlDeviceGetMemoryInfo(handle: dict[str, Any]) -> SimpleNamespace:  # noqa: N802
    return SimpleNamespace(total=handle["memory_total"], used=handle["memory_used"], free=handle["memory_total"] - handle["memory_used"])


def nvmlDeviceGetUtilizationRates(handle: dict[str, Any]) -> SimpleNamespace:  # noqa: N802
    return SimpleNamespace(gpu=handle.get("utilization", 0), memory=0)


def nvmlDeviceGetName(handle: dict[str, Any]) -> str:  # noqa: N802
    return handle["name"]


def nvmlDeviceGetUUID(handle: dict[str, Any]) -> str:  # noqa: N802
    return handle["uuid"]


def nvmlDeviceGetComputeRunningProcesses_v3(handle: dict[str, Any]) -> list[SimpleNamespace]:  # noqa: N802
    return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in handle.get("processes", [])]


nvmlDeviceGetComputeRunningProcesses = nvmlDeviceGetComputeRunningProcesses_v3
