"""Lines on a 4-GPU host (fake NVML through the real pynvml code path): real supervisors, each with a
stand-in trainer that records the GPUs it was shown, take the first free lease (`auto`) or wait for
the GPU they name (`cuda:N`); under CUDA_VISIBLE_DEVICES, `cuda:N` is the physical GPU behind the
N-th entry: leased, read through NVML and shown to the trainer (by UUID) as that GPU."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from helpers.lines import make_data_line, make_line
from helpers.nvml import FakeNvmlHost, fake_uuid
from helpers.supervise import stop_supervisor

from engine.gpu.devices import GpuLease, lease_holder
from engine.ops.status import line_status

TRAINER = r'''
import fcntl, json, os, signal, sys, time
from engine.supervisor.child import die_with_group, die_with_parent
line = sys.argv[1]
parent = int(sys.argv[sys.argv.index("--parent") + 1])
rank = os.environ.get("RANK")  # under torchrun (parallel.degree > 1): one of its ranks
if not (die_with_parent(parent) if rank is None else die_with_group(parent)):
    sys.exit(128 + signal.SIGTERM)
exits_path = os.path.join(line, "exits.json")  # exit codes of the next launches (then: train until stopped)
# One code per launch, shared by its ranks: a torchrun group is its agent's children, so the agent's pid
# names the launch. Claimed under a lock: ranks start together, and one may be killed before it reads.
launch = os.getpid() if rank is None else os.getppid()
with open(os.path.join(line, "exits.lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    exits = json.load(open(exits_path)) if os.path.exists(exits_path) else []
    exits = {"next": exits, "claimed": {}} if isinstance(exits, list) else exits
    if str(launch) not in exits["claimed"]:
        exits["claimed"][str(launch)] = exits["next"].pop(0) if exits["next"] else None
    code = exits["claimed"][str(launch)]
    json.dump(exits, open(exits_path, "w"))
seen = {"pid": os.getpid(), "rank": rank, "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "placed": os.environ.get("NSCONSOLE_GPUS")}
with open(os.path.join(line, "launches.jsonl"), "a") as handle:
    handle.write(json.dumps(seen) + "\n")

def beat(stage, **extra):
    if rank not in (None, "0"):
        return  # rank 0 beats the line's heartbeat
    temporary = os.path.join(line, ".heartbeat.fake")
    json.dump({"time": time.time(), "update": 0, "stage": stage, "pid": os.getpid(), **extra}, open(temporary, "w"))
    os.replace(temporary, os.path.join(line, "heartbeat"))

beat("training")
if code is not None:
    sys.exit(code)
terminated = []
signal.signal(signal.SIGTERM, lambda number, frame: terminated.append(number))
stop_path = os.path.join(line, "STOP")
def asked_to_stop():  # rank 0 takes the STOP file; a rank above 0 ends when rank 0 has stopped
    if rank in (None, "0"):
        return os.path.exists(stop_path)
    try:
        with open(os.path.join(line, "heartbeat")) as handle:
            return json.load(handle)["stage"] == "stopped"
    except FileNotFoundError:  # rank 0 has not beaten yet
        return False

while not terminated and not asked_to_stop():
    beat("training")
    time.sleep(0.1)
if terminated:
    beat("stopped", reason="signal SIGTERM")
    sys.exit(128 + signal.SIGTERM)
if rank not in (None, "0"):  # (with fails_at_stop: fails on its way out, after rank 0's stop)
    sys.exit(1 if os.path.exists(os.path.join(line, "fails_at_stop")) else 0)
os.remove(stop_path)
beat("stopped", reason="stop requested")
'''

RUNNER = r'''
import json, sys
from engine.supervisor.supervisor import Supervisor, SupervisorSettings
raise SystemExit(Supervisor(sys.argv[1], SupervisorSettings(**json.loads(sys.argv[2]))).run())
'''


class Host:
    """A fake 4-GPU host and the supervisors a test starts on it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.nvml = FakeNvmlHost(root / "nvml.json", count=4)
        (root / "trainer.py").write_text(TRAINER)
        (root / "runner.py").write_text(RUNNER)
        self.data = make_data_line(root, files=1)
        self.processes: dict[Path, subprocess.Popen[bytes]] = {}

    def line(self, name: str, device: str, **overrides: Any) -> Path:
        (self.root / name).mkdir()
        return make_line(self.root / name, self.data, device=device, **overrides)

    def start(self, line: Path, visible: str | None = None) -> subprocess.Popen[bytes]:
        settings = {
            "poll_seconds": 0.05, "relaunch_delay_seconds": 0.01, "watchdog_seconds": 60, "run_preparer": False,
            "trainer_command": [sys.executable, str(self.root / "trainer.py")],
        }  # fmt: skip
        environment = {**os.environ, **self.nvml.environment()}
        environment.pop("CUDA_VISIBLE_DEVICES", None)
        if visible is not None:
            environment["CUDA_VISIBLE_DEVICES"] = visible
        process = subprocess.Popen(
            [sys.executable, str(self.root / "runner.py"), str(line), json.dumps(settings)], env=environment,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        self.processes[line] = process
        return process

    def close(self) -> None:
        for line, process in self.processes.items():
            if process.poll() is None:
                process.kill()
                process.wait()
            for launch in launches(line):
                with contextlib.suppress(psutil.Error):
                    psutil.Process(launch["pid"]).kill()


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Host]:
    made = Host(tmp_path)
    yield made
    made.close()


def supervisor_json(line: Path) -> dict[str, Any]:
    try:
        return json.loads((line / "supervisor.json").read_text())
    except (FileNotFoundError, ValueError):
        return {}


def launches(line: Path) -> list[dict[str, Any]]:
    path = line / "launches.jsonl"
    return [json.loads(text) for text in path.read_text().splitlines()] if path.exists() else []


def wait_until(what: str, predicate: Callable[[], Any], timeout: float = 180) -> Any:
    """`predicate`'s first true value; `timeout` bounds a hang, not a speed (under CI's load a
    crashed two-rank launch took over 60 s to come back training)."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def training_on(line: Path, index: int) -> dict[str, Any]:
    """Wait until the line's trainer runs holding GPU `index`'s lease; the supervisor's state then."""
    def trains() -> dict[str, Any] | None:
        state = supervisor_json(line)
        holder = lease_holder(index)
        pid = state.get("trainer_pid")
        ours = holder is not None and holder.line == str(line) and holder.pid == pid
        started = any(launch["pid"] == pid for launch in launches(line))  # it wrote what it saw
        return state if state.get("state") == "training" and ours and started else None

    state = wait_until(f"{line} training on GPU {index}", trains)
    holder = lease_holder(index)
    assert holder is not None and (holder.gpu, holder.uuid) == (index, fake_uuid(index))
    assert (state["gpu_index"], state["gpu_uuid"]) == (index, fake_uuid(index))
    # The trainer was shown that GPU alone, by UUID: its cuda:0.
    last = launches(line)[-1]
    assert last["pid"] == state["trainer_pid"]
    assert last["visible"] == last["placed"] == fake_uuid(index)
    return state


def waiting_for(line: Path, holders: dict[int, Path]) -> dict[str, Any]:
    """Wait until the line waits for a lease, naming `holders` (GPU -> line) as the leases' holders."""
    expected = sorted((index, str(holder)) for index, holder in holders.items())

    def waits() -> dict[str, Any] | None:
        state = supervisor_json(line)
        named = sorted((record["gpu"], record["line"]) for record in state.get("gpu_holders", []))
        return state if state.get("state") == "waiting-gpu" and named == expected else None

    return wait_until(f"{line} waiting for {expected}", waits)


def test_auto_lines_take_the_first_free_gpus_and_a_cuda_n_line_waits_for_its_gpu(host: Host) -> None:
    first, second, third = host.line("a", "auto"), host.line("b", "auto"), host.line("c", "cuda:1")
    host.start(first)
    assert training_on(first, 0)["gpu_candidates"] == [0, 1, 2, 3]
    host.start(second)
    training_on(second, 1)
    host.start(third)
    state = waiting_for(third, {1: second})
    assert state["gpu_candidates"] == [1] and state["gpu_index"] is None and launches(third) == []
    log = (third / "run.log").read_text()
    assert f"waiting for GPU 1: leases held (GPU 1 by {second})" in log
    assert line_status(third).gpu == f"waiting for a lease (held: GPU 1 by {second})"  # nsconsole status

    stop_supervisor(second)  # its trainer ends, and with it its lease: the waiting line takes GPU 1
    training_on(third, 1)
    assert line_status(third).gpu == f"GPU 1 ({fake_uuid(1)})"
    holder = lease_holder(0)
    assert holder is not None and holder.line == str(first)  # untouched
    assert lease_holder(2) is None and lease_holder(3) is None
    for line in (first, third):
        stop_supervisor(line)
    assert all(lease_holder(index) is None for index in range(4))
    assert line_status(third).gpu == f"GPU 1 ({fake_uuid(1)}), its last lease"


def test_an_auto_line_with_every_lease_held_says_who_holds_them_and_takes_the_first_freed(
    host: Host, tmp_path: Path
) -> None:
    others = [tmp_path / f"other{index}" for index in range(4)]
    leases = [GpuLease(index, others[index], fake_uuid(index)) for index in range(4)]
    assert all(lease.try_acquire() for lease in leases)
    try:
        line = host.line("d", "auto")
        host.start(line)
        waiting_for(line, dict(enumerate(others)))
        leases[2].release()
        training_on(line, 2)
        stop_supervisor(line)
    finally:
        for lease in leases:
            lease.release()


def test_under_cuda_visible_devices_cuda_1_is_physical_gpu_3_leased_watched_and_trained_on(host: Host) -> None:
    line = host.line("e", "cuda:1")
    (line / "exits.json").write_text(json.dumps([75]))  # the first launch leaves the GPU to another process
    host.nvml.set_processes(3, [(4242, 2 << 30)])  # ... which NVML shows on physical GPU 3, not on 1
    host.nvml.set_processes(1, [(4343, 2 << 30)])  # (a process on visible GPU 1 is not the line's concern)
    host.start(line, visible="2,3")
    run_log = line / "run.log"
    wait_until("the wait for a free GPU 3", lambda: run_log.exists() and
               "waiting for GPU 3 to be free (other processes on it: [4242])" in run_log.read_text())  # fmt: skip
    # run.log says why first, then supervisor.json's state follows (engine.supervisor.leasing).
    wait_until("the state waiting-gpu", lambda: supervisor_json(line)["state"] == "waiting-gpu")
    state = supervisor_json(line)
    assert (state["state"], state["gpu_index"], state["gpu_candidates"]) == ("waiting-gpu", 3, [3])
    host.nvml.set_processes(3, [])
    training_on(line, 3)
    assert [launch["visible"] for launch in launches(line)] == [fake_uuid(3)] * 2
    process = host.processes[line]
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0
    assert lease_holder(3) is None


def test_a_gpu_past_the_visible_ones_stops_the_supervisor_with_one_line(host: Host) -> None:
    line = host.line("f", "cuda:2")
    environment = {**os.environ, **host.nvml.environment(), "CUDA_VISIBLE_DEVICES": "2,3"}
    command = [sys.executable, "-m", "engine.supervisor.supervisor", str(line), "--foreground"]
    finished = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=120)
    assert finished.returncode == 2, finished.stderr
    assert finished.stderr.strip() == (
        f"nsconsole: {line / 'run.json'}: device cuda:2: no such GPU (2 visible under CUDA_VISIBLE_DEVICES=2,3)"
    )
    assert lease_holder(2) is None and launches(line) == []


def test_a_line_over_two_gpus_leases_both_watches_both_and_shows_the_ranks_both(host: Host) -> None:
    line = host.line("g", "cuda:2", **{"parallel.degree": 2})
    (line / "exits.json").write_text(json.dumps([1]))  # the first launch (both its ranks) crashes
    host.nvml.set_processes(3, [(4242, 2 << 30)])  # another process on rank 1's GPU, not rank 0's
    host.start(line)
    run_log = line / "run.log"
    crash = "the trainer exited with status 1 beside other processes on GPUs 2, 3 (pids [4242])"
    wait_until("the crash beside GPU 3's process", lambda: run_log.exists() and crash in run_log.read_text())
    host.nvml.set_processes(3, [])

    def trains_on_both() -> dict[str, Any] | None:
        state = supervisor_json(line)
        pid = state.get("trainer_pid")
        ours = [(holder := lease_holder(index)) is not None and holder.line == str(line) and holder.pid == pid
                for index in (2, 3)]  # fmt: skip
        ranks = [launch for launch in launches(line) if launch["pid"] in state.get("trainer_children", [])]
        return state if state.get("state") == "training" and all(ours) and len(ranks) == 2 else None

    state = wait_until(f"{line} training on GPUs 2 and 3", trains_on_both)
    assert (state["gpu_index"], state["gpu_uuid"], state["gpu_indices"]) == (2, fake_uuid(2), [2, 3])
    assert state["gpu_candidates"] == [2, 3] and state["crashes"] == 1
    ranks = [launch for launch in launches(line) if launch["pid"] in state["trainer_children"]]
    assert sorted(launch["rank"] for launch in ranks) == ["0", "1"]
    for launch in ranks:  # each rank sees both GPUs, by UUID, in rank order (rank r on its cuda:r)
        assert launch["visible"] == launch["placed"] == f"{fake_uuid(2)},{fake_uuid(3)}"
    assert lease_holder(0) is None and lease_holder(1) is None
    assert line_status(line).gpu == f"GPUs 2, 3 (rank 0 on GPU 2 ({fake_uuid(2)}))"  # nsconsole status

    # A second line over two GPUs takes the first two free ones: 0 and 1.
    other = host.line("h", "auto", **{"parallel.degree": 2})
    host.start(other)
    wait_until(f"{other} on GPUs 0 and 1", lambda: supervisor_json(other).get("gpu_indices") == [0, 1])
    for each in (line, other):
        stop_supervisor(each)
    assert all(lease_holder(index) is None for index in range(4))
    assert supervisor_json(line)["trainer_children"] == []


def test_a_group_whose_rank_fails_after_rank_0_served_the_stop_stays_stopped(host: Host) -> None:
    line = host.line("i", "auto", **{"parallel.degree": 2})
    (line / "fails_at_stop").touch()  # rank 1 exits 1 once rank 0 has checkpointed and beaten `stopped`
    host.start(line)
    wait_until(f"{line} training", lambda: supervisor_json(line).get("state") == "training"
               and len(supervisor_json(line).get("trainer_children", [])) == 2)  # fmt: skip
    stop_supervisor(line)  # ... and the supervisor stops (no relaunch that would train on, STOP gone)
    state = supervisor_json(line)
    assert (state["launches"], state["crashes"], state["last_exit"]["code"]) == (1, 0, 1)
    assert "the line stopped on request (the trainer then exited with status 1)" in (line / "run.log").read_text()
