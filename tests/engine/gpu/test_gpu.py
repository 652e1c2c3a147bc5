"""The GPU view (a clean "no GPU" here) and the lease: one line per GPU, released with its holder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from engine.gpu import devices as gpu
from engine.gpu.devices import GpuLease, lease_holder


@pytest.fixture(autouse=True)
def runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    (tmp_path / "run").mkdir(mode=0o700)
    return tmp_path / "run" / "nsconsole"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_no_driver_gives_a_clean_no_gpu_snapshot() -> None:
    snapshot = gpu.gpu_snapshot()
    assert not snapshot.available and snapshot.devices == [] and snapshot.driver == ""
    assert snapshot.reason.startswith("no NVIDIA GPU")
    assert snapshot.to_json() == {"available": False, "reason": snapshot.reason, "driver": "", "devices": []}


@pytest.mark.cuda
def test_nvml_sees_this_process_and_its_memory() -> None:
    held = torch.empty(512 * 1024 * 1024, dtype=torch.uint8, device="cuda")  # 512 MiB
    torch.cuda.synchronize()
    snapshot = gpu.gpu_snapshot()
    assert snapshot.available and snapshot.driver and snapshot.devices
    device = snapshot.devices[torch.cuda.current_device()]
    assert device.memory_total > device.memory_used > held.numel()
    mine = [process for process in device.processes if process.pid == os.getpid()]
    assert mine and (mine[0].used_memory is None or mine[0].used_memory >= held.numel())
    del held


def holder_script(tmp_path: Path, line: Path) -> Path:
    script = tmp_path / "hold.py"
    script.write_text(
        "import sys, time\n"
        "from engine.gpu.devices import GpuLease\n"
        f"lease = GpuLease(0, {str(line)!r})\n"
        "assert lease.acquire(timeout=10)\n"
        "print('held', flush=True)\n"
        "time.sleep(600)\n"
    )
    return script


def test_the_lease_excludes_a_second_holder_until_the_first_is_killed(tmp_path: Path) -> None:
    first_line, second_line = tmp_path / "first", tmp_path / "second"
    holder = subprocess.Popen(
        [sys.executable, str(holder_script(tmp_path, first_line))], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        current = lease_holder(0)
        assert current is not None and current.line == str(first_line) and current.pid == holder.pid
        second = GpuLease(0, second_line)
        waits = []
        assert not second.acquire(timeout=0.3, poll_seconds=0.05, on_wait=lambda h, s: waits.append(h))
        assert waits and all(h is not None and h.line == str(first_line) for h in waits)
        assert not second.held

        acquired = threading.Event()

        def wait_for_lease() -> None:
            if second.acquire(timeout=20, poll_seconds=0.05):
                acquired.set()

        waiter = threading.Thread(target=wait_for_lease)
        waiter.start()
        time.sleep(0.2)
        assert not acquired.is_set()
        os.kill(holder.pid, signal.SIGKILL)  # the kernel drops the flock with the process
        holder.wait()
        waiter.join()
        assert acquired.is_set() and second.held
        current = lease_holder(0)
        assert current is not None and current.line == str(second_line) and current.pid == os.getpid()
        second.release()
        assert lease_holder(0) is None
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_a_lease_handed_to_a_child_lives_as_long_as_the_child(tmp_path: Path) -> None:
    lease = GpuLease(1, tmp_path / "line")
    assert lease.try_acquire()
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], pass_fds=[lease.fileno()]
    )
    try:
        lease.release()  # the supervisor lets go: the trainer (child) holds it now
        assert lease_holder(1) is not None
        assert not GpuLease(1, tmp_path / "other").try_acquire()
        child.kill()
        child.wait()
        assert lease_holder(1) is None
        assert GpuLease(1, tmp_path / "other").try_acquire()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
