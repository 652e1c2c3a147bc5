"""A fake NVML host for tests: N GPUs with the processes a test puts on them.

`FakeNvmlHost(path, count)` writes the host file the stand-in `pynvml` (`helpers/fake_nvml/`)
reports; `environment()` is what a child process needs to see it (PYTHONPATH first, then the
file's path); `install(monkeypatch)` makes this process's `engine.gpu.devices` read it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

FAKE_NVML_DIR = Path(__file__).resolve().parent / "fake_nvml"
GIB = 1 << 30


def fake_uuid(index: int) -> str:
    """The UUID the fake host gives GPU `index` (unlike any index, so a mix-up shows)."""
    return f"GPU-{index:08x}-fake-4000-8000-{0xA0 + index * 7:012x}"


class FakeNvmlHost:
    """A host of `count` GPUs (H200-sized, idle) in a file the fake pynvml reads."""

    def __init__(self, path: Path, count: int = 4, name: str = "NVIDIA H200") -> None:
        self.path = path
        self.devices = [
            {"name": name, "uuid": fake_uuid(index), "memory_total": 141 * GIB, "memory_used": 0,
             "utilization": 0, "processes": []}
            for index in range(count)
        ]  # fmt: skip
        self.write()

    def set_processes(self, index: int, processes: list[tuple[int, int]]) -> None:
        """GPU `index` now runs these (pid, bytes) compute processes."""
        device = self.devices[index]
        device["processes"] = [list(process) for process in processes]
        device["memory_used"] = sum(used for _pid, used in processes)
        self.write()

    def write(self) -> None:
        # Replaced at once: a reader polling the file never sees it half written.
        partial = self.path.with_suffix(".partial")
        partial.write_text(json.dumps({"driver": "580.159.04", "devices": self.devices}))
        os.replace(partial, self.path)

    def environment(self) -> dict[str, str]:
        """Variables for a child process that must see this host through `import pynvml`."""
        path = os.environ.get("PYTHONPATH")
        return {
            "PYTHONPATH": os.pathsep.join([str(FAKE_NVML_DIR), *([path] if path else [])]),
            "FAKE_NVML_HOST": str(self.path),
        }

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """This process's NVML readings come from this host (for the rest of the test)."""
        import importlib.util
        import sys

        from engine.gpu import devices

        spec = importlib.util.spec_from_file_location("pynvml", FAKE_NVML_DIR / "pynvml.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        monkeypatch.setitem(sys.modules, "pynvml", module)
        monkeypatch.setenv("FAKE_NVML_HOST", str(self.path))
        monkeypatch.setattr(devices, "_nvml_ready", None)  # initialise again, against the fake
