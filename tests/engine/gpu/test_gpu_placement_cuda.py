"""On a real GPU (the H200): a tiny line with `device: cuda:0` under CUDA_VISIBLE_DEVICES=0 trains on
the physical GPU the supervisor leased -- the lease, the supervisor's state, NVML's process list and
the trainer's own NVML lookup (by the UUID CUDA reports) all name that GPU."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from helpers.lines import make_data_line, make_line
from helpers.supervise import start_supervisor, stop_supervisor

from engine.gpu.devices import gpu_snapshot, lease_holder
from engine.gpu.placement import gpu_candidates
from engine.gpu.sharing import cuda_uuid, reading_from_snapshot

pytestmark = pytest.mark.cuda


def test_a_cuda_0_line_under_cuda_visible_devices_trains_on_the_gpu_it_leased(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # This pytest process must hold no CUDA context of its own: the line would see it as another
    # process on its GPU and wait for it (the sharing rules). So this test runs first in the file.
    assert not torch.cuda.is_initialized(), "run this test before any CUDA test of its pytest process"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # the supervisor's (and so the line's) view
    physical = gpu_candidates("cuda:0", gpu_snapshot())
    assert physical is not None
    gpu = physical[0]
    line = make_line(tmp_path, make_data_line(tmp_path, files=2), device="cuda:0")
    supervisor = start_supervisor(tmp_path, line)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert time.monotonic() < deadline, (line / "run.log").read_text()
            assert supervisor.poll() is None, (line / "run.log").read_text()
            state = json.loads((line / "supervisor.json").read_text()) if (line / "supervisor.json").exists() else {}
            pid = state.get("trainer_pid")
            rows = (line / "rows.jsonl").read_text().splitlines() if (line / "rows.jsonl").exists() else []
            on_gpu = [p.pid for device in gpu_snapshot().devices if device.index == gpu.index for p in device.processes]
            if pid is not None and rows and pid in on_gpu:
                break
            time.sleep(0.2)
        assert (state["gpu_index"], state["gpu_uuid"], state["gpu_candidates"]) == (gpu.index, gpu.uuid, [gpu.index])
        holder = lease_holder(gpu.index)
        assert holder is not None and (holder.line, holder.pid, holder.uuid) == (str(line), pid, gpu.uuid)
        assert all(json.loads(row)["gpu_mode"] == "own" for row in rows)  # its NVML check saw no one else
        stop_supervisor(line)
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.wait()
    assert lease_holder(gpu.index) is None


def test_cuda_reports_the_uuid_nvml_names_and_the_trainer_s_lookup_finds_others_by_it() -> None:
    snapshot = gpu_snapshot()
    uuid = cuda_uuid(torch.device("cuda", 0))
    placed = gpu_candidates("cuda:0", snapshot)
    assert placed is not None and placed[0].uuid == uuid  # this process's cuda:0 is NVML's GPU behind it
    held = torch.empty(256 << 20, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    # Seen from another process's side (not this pid), this process is "another process" on the GPU.
    reading = reading_from_snapshot(gpu_snapshot(), uuid, own_pid=0)
    assert reading.others >= 1 and reading.others_bytes >= held.numel()
    del held
