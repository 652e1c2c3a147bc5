"""The supervisor's decisions, driven by a scripted stand-in trainer (each launch does what the
test's script says: crash, hang, stop on a signal, train until asked to stop...), with the real
supervisor process, socket, registry, GPU lease and notify command around it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from helpers.lines import make_data_line, make_line

from engine.errors import LineError
from engine.gpu.devices import GpuLease, lease_holder
from engine.supervisor import registry
from engine.supervisor.reserve import RESERVE_NAME
from nsconsole.client import RemoteError, SupervisorClient

FAKE_TRAINER = r'''
import json, os, signal, sys, time
from engine.supervisor.child import die_with_parent
line = sys.argv[1]
if not die_with_parent(int(sys.argv[sys.argv.index("--parent") + 1])):  # as the real trainer does
    sys.exit(128 + signal.SIGTERM)
with open(os.path.join(line, "pids.txt"), "a") as handle:
    handle.write(f"{os.getpid()}\n")
script_path = os.environ["FAKE_TRAINER_SCRIPT"]
steps = json.load(open(script_path))
action = steps.pop(0) if steps else "finish"
with open(script_path, "w") as handle:
    json.dump(steps, handle)
with open(os.path.join(line, "launches.txt"), "a") as handle:
    handle.write(action + "\n")
latest_path = os.path.join(line, "checkpoints", "latest")
try:
    update = int(open(latest_path).read().strip()[1:])
except (OSError, ValueError):
    update = 0

clock_offset = 0.0  # seconds this trainer's wall clock reads ahead of the supervisor's


def beat(stage, **extra):
    temporary = os.path.join(line, ".heartbeat.fake")
    with open(temporary, "w") as handle:
        beat = {"time": time.time() + clock_offset, "update": update, "stage": stage, "pid": os.getpid(), **extra}
        json.dump(beat, handle)
    os.replace(temporary, os.path.join(line, "heartbeat"))

beat("training")
if action == "crash":
    sys.exit(1)
if action == "progress-crash":
    os.makedirs(os.path.dirname(latest_path), exist_ok=True)
    open(latest_path, "w").write("u%08d\n" % (update + 1))
    sys.exit(1)
if action == "hang":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    beat("hanging")  # from now on deaf to SIGTERM
    time.sleep(600)
if action == "sigterm":
    sys.exit(128 + signal.SIGTERM)
if action == "gpu-busy":
    sys.exit(75)
if action == "progress-gpu-busy":  # trained on, then left the GPU (a switch that could not get its memory)
    os.makedirs(os.path.dirname(latest_path), exist_ok=True)
    open(latest_path, "w").write("u%08d\n" % (update + 1))
    sys.exit(75)
if action == "line-error":
    print("nsconsole: run.json: lr.peak must be > 0, got -1", file=sys.stderr)
    sys.exit(2)
if action == "disk-full":
    print("nsconsole: /lines/x: 0.40 GiB free on its disk, below guards.min_free_disk_gb = 20", file=sys.stderr)
    sys.exit(74)
if action == "slow-exit":  # stopped, then a long close (W&B's bounded one, a group's last barrier)
    beat("stopped", reason="the plan is complete")
    time.sleep(2.5)
    sys.exit(0)
if action == "wait-data":
    for _ in range(40):
        beat("waiting-data", cycle=3)
        time.sleep(0.05)
if action == "hang-waiting-data":  # waits for a cycle, then hangs there, deaf to SIGTERM: no more beats
    for _ in range(4):
        beat("waiting-data", cycle=3)
        time.sleep(0.05)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)
if action in ("clock-behind", "hang-clock-ahead"):
    # The supervisor's wall clock stepped two hours forward (an NTP step after a paused VM) or back
    # between the trainer's beats: its beats carry times two hours behind or ahead of its clock.
    clock_offset = -7200.0 if action == "clock-behind" else 7200.0
    for _ in range(30 if action == "clock-behind" else 1):  # 1.5 s of beats, past the 0.5 s watchdog
        beat("training")
        time.sleep(0.05)
    if action == "hang-clock-ahead":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(600)
if action == "crash-at-stop":  # trains until a stop is asked, then crashes before serving it
    while not os.path.exists(os.path.join(line, "STOP")):
        beat("training")
        time.sleep(0.05)
    sys.exit(1)
if action == "train-until-stop":
    stop_path = os.path.join(line, "STOP")
    terminated = []
    signal.signal(signal.SIGTERM, lambda number, frame: terminated.append(number))
    rows = open(os.path.join(line, "rows.jsonl"), "a")
    while not terminated and not os.path.exists(stop_path):
        update += 1
        rows.write(json.dumps({"update": update, "loss": 1.0 / update}) + "\n")
        rows.flush()
        beat("training")
        time.sleep(0.05)
    if terminated:
        beat("stopped", reason="signal SIGTERM")
        sys.exit(128 + signal.SIGTERM)
    os.remove(stop_path)
    beat("stopped", reason="stop requested")
    sys.exit(0)
beat("stopped", reason="the plan is complete")
'''

RUNNER = r'''
import json, os, sys
import engine.supervisor.supervisor
import engine.supervisor.gpu_watch
from engine.gpu.devices import GpuDevice, GpuProcess, GpuSnapshot

def snapshot_from_file():
    # NVML as the test sets it: GPU 0 with the pids listed in $FAKE_GPU_PIDS (none where unset).
    pids = json.load(open(os.environ["FAKE_GPU_PIDS"])) if os.environ.get("FAKE_GPU_PIDS") else []
    processes = [GpuProcess(pid, 1 << 30) for pid in pids]
    device = GpuDevice(0, "fake", "GPU-fake", 80 << 30, len(pids) << 30, 0, processes)
    return GpuSnapshot(True, "", "fake", [device])

engine.supervisor.gpu_watch.gpu_snapshot = snapshot_from_file  # what the supervisor asks NVML
settings = engine.supervisor.supervisor.SupervisorSettings(**json.loads(sys.argv[2]))
raise SystemExit(engine.supervisor.supervisor.Supervisor(sys.argv[1], settings).run())
'''

FAKE_PREPARER = r'''
import json, os, signal, sys, time
data = sys.argv[sys.argv.index("--work") + 1]
with open(os.path.join(data, "preparer-runs.txt"), "a") as handle:
    handle.write("run\n")
runs = open(os.path.join(data, "preparer-runs.txt")).read().split()
status = {"state": "failed", "consecutive_failures": 1, "last_error": "hub unreachable"}
if len(runs) <= 3:  # the first three runs fail
    json.dump(status, open(os.path.join(data, "preparer.json"), "w"))
    sys.exit(1)
ready = {"state": "ready", "consecutive_failures": 0, "last_error": None}
json.dump(ready, open(os.path.join(data, "preparer.json"), "w"))
signal.signal(signal.SIGTERM, lambda number, frame: sys.exit(0))
time.sleep(600)
'''

NOTIFY = r'''
import json, sys
event = json.load(sys.stdin)
with open(sys.argv[1], "a") as handle:
    handle.write(json.dumps(event) + "\n")
'''


@pytest.fixture(scope="module")
def run_json(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A valid run.json (its data line is never read: the stand-in trainer does not train)."""
    root = tmp_path_factory.mktemp("template")
    return (make_line(root, make_data_line(root, files=1)) / "run.json").read_text()


class Rig:
    """A line with a scripted trainer, a notify command and a private runtime dir."""

    def __init__(self, root: Path, run_json: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = root
        self.line = root / "line"
        self.line.mkdir()
        (self.line / "run.json").write_text(run_json)
        self.script = root / "script.json"
        self.events = root / "events.jsonl"
        (root / "fake_trainer.py").write_text(FAKE_TRAINER)
        (root / "runner.py").write_text(RUNNER)
        (root / "notify.py").write_text(NOTIFY)
        notify_command = f"{sys.executable} {root / 'notify.py'} {self.events}"
        (root / "host.json").write_text(json.dumps({"notify": notify_command}))
        (root / "run").mkdir(mode=0o700)
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(root / "run"))
        monkeypatch.setenv("NSCONSOLE_HOST", str(root / "host.json"))
        monkeypatch.setenv("FAKE_TRAINER_SCRIPT", str(self.script))
        self.process: subprocess.Popen[str] | None = None

    def set_device(self, device: str) -> None:
        document = json.loads((self.line / "run.json").read_text())
        document["device"] = device
        (self.line / "run.json").write_text(json.dumps(document))

    def start(self, steps: list[str], **settings: Any) -> subprocess.Popen[str]:
        self.script.write_text(json.dumps(steps))
        chosen = {
            "poll_seconds": 0.05,
            "relaunch_delay_seconds": 0.01,
            "kill_wait_seconds": 10,
            "watchdog_seconds": 30,
            "trainer_command": [sys.executable, str(self.root / "fake_trainer.py")],
            "run_preparer": False,
            **settings,
        }
        self.process = subprocess.Popen(
            [sys.executable, str(self.root / "runner.py"), str(self.line), json.dumps(chosen)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        return self.process

    def finish(self, timeout: float = 60) -> int:
        """The supervisor's exit code; its output is printed (pytest shows it when a test fails)."""
        assert self.process is not None
        try:
            code = self.process.wait(timeout=timeout)
            print(self.process.stdout.read())
            return code
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()

    def notified(self, wait_for: str | None = None, timeout: float = 10) -> list[dict[str, Any]]:
        """The events the notify command received (background threads: wait for the last one)."""
        deadline = time.monotonic() + timeout
        while True:
            lines = self.events.read_text().splitlines() if self.events.exists() else []
            events = [json.loads(line) for line in lines]
            if wait_for is None or any(event["event"] == wait_for for event in events):
                return events
            if time.monotonic() > deadline:
                return events
            time.sleep(0.05)

    def state(self) -> dict[str, Any]:
        return json.loads((self.line / "supervisor.json").read_text())

    def launches(self) -> list[str]:
        return (self.line / "launches.txt").read_text().split()

    def wait_for_socket(self, timeout: float = 30) -> SupervisorClient:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if registry.find_supervisor(self.line) is not None:
                return SupervisorClient(self.line / "supervisor.sock")
            assert self.process is None or self.process.poll() is None, self.process.stdout.read()
            time.sleep(0.05)
        raise AssertionError("the supervisor never registered")


@pytest.fixture
def rig(tmp_path: Path, run_json: str, monkeypatch: pytest.MonkeyPatch):
    made = Rig(tmp_path, run_json, monkeypatch)
    yield made
    # Whatever a failed test left running: its supervisor, then the stand-in trainers it started.
    if made.process is not None and made.process.poll() is None:
        made.process.kill()
        made.process.wait()
    pids = made.line / "pids.txt"
    for pid in map(int, pids.read_text().split() if pids.exists() else []):
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).kill()


def wait_gone(process: psutil.Process, timeout: float = 60) -> None:
    """Wait for a process that is not our child to end (a zombie counts as ended)."""
    deadline = time.monotonic() + timeout
    while process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"pid {process.pid} is still running"
        time.sleep(0.05)


def test_five_crashes_without_progress_stop_the_line(rig: Rig) -> None:
    rig.start(["crash"] * 6)
    assert rig.finish() == 1
    assert rig.launches() == ["crash"] * 5
    state = rig.state()
    assert state["state"] == "failed" and state["failures_in_a_row"] == 5 and state["launches"] == 5
    failed = [event for event in rig.notified("failed") if event["event"] == "failed"]
    assert len(failed) == 1 and "5 failures in a row without progress" in failed[0]["message"]
    assert failed[0]["line"] == str(rig.line)
    assert registry.list_supervisors() == [] and not (rig.line / "supervisor.sock").exists()


def test_a_crash_after_progress_starts_the_count_again(rig: Rig) -> None:
    steps = ["crash", "crash", "progress-crash", "crash", "crash", "crash", "finish"]
    rig.start(steps)
    assert rig.finish() == 0
    assert rig.launches() == steps
    assert rig.state()["state"] == "finished"
    assert [event["event"] for event in rig.notified("finished")] == ["finished"]
    assert "the plan is complete" in rig.notified()[0]["message"]


def test_a_silent_trainer_is_killed_and_relaunched(rig: Rig) -> None:
    rig.start(["hang", "finish"], watchdog_seconds=1.0)
    assert rig.finish() == 0
    assert rig.launches() == ["hang", "finish"]
    kinds = [event["event"] for event in rig.notified("finished")]
    assert kinds == ["watchdog_restart", "finished"]
    assert "no heartbeat for 1 s" in (rig.line / "run.log").read_text()


def test_a_wall_clock_step_forward_does_not_kill_a_trainer_that_beats(rig: Rig) -> None:
    rig.start(["clock-behind"], watchdog_seconds=0.5)
    assert rig.finish() == 0
    assert rig.launches() == ["clock-behind"] and rig.state()["state"] == "finished"
    assert "no heartbeat" not in (rig.line / "run.log").read_text()


def test_a_wall_clock_step_back_does_not_hide_a_silent_trainer(rig: Rig) -> None:
    rig.start(["hang-clock-ahead", "finish"], watchdog_seconds=1.0)
    assert rig.finish() == 0  # killed after 1 s of silence, not after the two hours its beat claimed
    assert rig.launches() == ["hang-clock-ahead", "finish"]
    assert "no heartbeat for 1 s" in (rig.line / "run.log").read_text()


def test_a_trainer_that_said_stopped_may_take_longer_than_the_watchdog_to_leave(rig: Rig) -> None:
    # Found under a loaded CI: killed while closing W&B, a finished trainer was relaunched in a loop.
    rig.start(["slow-exit"], watchdog_seconds=0.5)
    assert rig.finish() == 0
    assert rig.launches() == ["slow-exit"]
    assert rig.state()["state"] == "finished"
    assert "no heartbeat" not in (rig.line / "run.log").read_text()


def test_a_sigterm_it_did_not_send_relaunches_the_trainer(rig: Rig) -> None:
    rig.start(["sigterm", "finish"])
    assert rig.finish() == 0
    assert [event["event"] for event in rig.notified("finished")] == ["signal_restart", "finished"]


def test_a_line_error_fails_at_once_with_the_trainers_message(rig: Rig) -> None:
    rig.start(["line-error", "finish"])
    assert rig.finish() == 1
    assert rig.launches() == ["line-error"]
    [failed] = rig.notified("failed")
    assert failed["event"] == "failed" and failed["message"] == "run.json: lr.peak must be > 0, got -1"


def test_a_full_disk_stops_the_line_for_the_operator(rig: Rig) -> None:
    rig.start(["disk-full", "finish"])
    assert rig.finish() == 1
    assert rig.launches() == ["disk-full"]  # a relaunch would stop again at once
    [event] = rig.notified("disk_full")
    assert event["message"] == "/lines/x: 0.40 GiB free on its disk, below guards.min_free_disk_gb = 20"
    assert json.loads((rig.line / "supervisor.json").read_text())["state"] == "disk-full"
    # Its 1 MiB reserve for last words is given back once they are written: not left in the line.
    assert not (rig.line / RESERVE_NAME).exists()


def test_a_line_that_ends_leaves_no_disk_reserve_behind(rig: Rig) -> None:
    rig.start(["finish"])
    assert rig.finish() == 0
    assert not (rig.line / RESERVE_NAME).exists()


def test_a_long_wait_for_data_is_notified(rig: Rig) -> None:
    rig.start(["wait-data"], watchdog_seconds=1.0)
    assert rig.finish() == 0
    kinds = [event["event"] for event in rig.notified("finished")]
    assert kinds == ["data_wait", "finished"]


def test_a_trainer_that_crashes_before_serving_a_stop_leaves_the_line_stopped_not_relaunched(rig: Rig) -> None:
    rig.start(["crash-at-stop", "train-until-stop"])
    with rig.wait_for_socket() as client:
        deadline = time.monotonic() + 30
        while client.call("status")["state"] != "training":
            assert time.monotonic() < deadline, "the line never trained"
            time.sleep(0.05)
        client.mutate("stop")
    assert rig.finish() == 0
    assert rig.launches() == ["crash-at-stop"]  # no relaunch only to stop at its first boundary
    state = rig.state()
    assert (state["state"], state["crashes"]) == ("stopped", 1) and not (rig.line / "STOP").exists()
    run_log = (rig.line / "run.log").read_text()
    assert "the trainer exited with status 1 before serving it, so its newest checkpoint stands" in run_log


def test_a_stop_over_the_socket_ends_the_line_with_no_stop_left(rig: Rig) -> None:
    rig.start(["train-until-stop", "finish"])
    with rig.wait_for_socket() as client:
        client.subscribe(since_seq=0)
        kinds = set()
        while "row" not in kinds:
            notification = client.next_notification(timeout=20)
            assert notification is not None
            kinds.add(notification.kind)
        status = client.call("status")
        assert status["state"] == "training" and status["trainer_pid"] and status["line"] == str(rig.line)
        reply = client.mutate("stop")
        assert reply["stopping"] and reply["when"] == "at the next update"
        assert client.mutate("stop", request_id="retry-me") == client.mutate("stop", request_id="retry-me")
    assert rig.finish() == 0
    assert rig.launches() == ["train-until-stop"]
    assert rig.state()["state"] == "stopped" and not (rig.line / "STOP").exists()
    assert rig.notified() == []  # a stop the operator asked for is not news to the operator
    assert "supervisor: stopped: the line stopped" in (rig.line / "run.log").read_text()  # but run.log says it
    assert "retry-me" in {record["request_id"] for record in rig.state()["requests"]}


def test_sigterm_to_the_supervisor_stops_the_trainer_first(rig: Rig) -> None:
    process = rig.start(["train-until-stop"])
    with rig.wait_for_socket() as client:
        client.subscribe(since_seq=0)
        notification = client.next_notification(timeout=20)
        while notification is not None and notification.kind != "row":
            notification = client.next_notification(timeout=20)
        trainer_pid = client.call("status")["trainer_pid"]
    process.send_signal(signal.SIGTERM)
    assert rig.finish() == 0
    assert not psutil.pid_exists(trainer_pid) or psutil.Process(trainer_pid).status() == psutil.STATUS_ZOMBIE
    assert json.loads((rig.line / "heartbeat").read_text())["stage"] == "stopped"
    assert rig.state()["state"] == "stopped"


def test_the_line_waits_for_the_gpu_lease_and_hands_it_to_the_trainer(rig: Rig) -> None:
    rig.set_device("cuda")
    other = GpuLease(0, rig.root / "other-line")
    assert other.try_acquire()
    rig.start(["train-until-stop"], watchdog_seconds=0.5)
    assert [event["event"] for event in rig.notified("gpu_wait")] == ["gpu_wait"]
    assert rig.state()["state"] == "waiting-gpu"
    other.release()
    with rig.wait_for_socket() as client:
        deadline = time.monotonic() + 20
        while (trainer_pid := client.call("status")["trainer_pid"]) is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        holder = lease_holder(0)
        assert holder is not None and holder.line == str(rig.line) and holder.pid == trainer_pid
        client.mutate("stop")
    assert rig.finish() == 0
    assert lease_holder(0) is None  # released with the trainer


def test_a_logout_removing_the_xdg_runtime_dir_neither_hides_the_line_nor_frees_its_gpu(rig: Rig) -> None:
    rig.set_device("cuda")
    rig.start(["train-until-stop"])
    with rig.wait_for_socket() as client:
        deadline = time.monotonic() + 20
        while (trainer_pid := client.call("status")["trainer_pid"]) is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        shutil.rmtree(rig.root / "run")  # systemd-logind at the user's last logout
        assert [entry.line for entry in registry.list_supervisors()] == [str(rig.line)]
        with GpuLease(0, rig.root / "second-line") as second:
            assert not second.try_acquire()
        holder = lease_holder(0)
        assert holder is not None and holder.line == str(rig.line) and holder.pid == trainer_pid
        client.mutate("stop")
    assert rig.finish() == 0


def wait_until(predicate, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def set_gpu_pids(path: Path, pids: list[int]) -> None:
    """What the stand-in NVML reports, replaced at once: the supervisor polls the file every 50 ms,
    and a write in place can be read half done (empty: the rig's snapshot then raises, as NVML never
    does)."""
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(pids))
    os.replace(partial, path)


def test_crashes_beside_other_gpu_processes_are_not_failures(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig.set_device("cuda")
    gpu_pids = rig.root / "gpu-pids.json"
    set_gpu_pids(gpu_pids, [4242])  # another job on the GPU
    monkeypatch.setenv("FAKE_GPU_PIDS", str(gpu_pids))
    rig.start(["crash", "crash", "crash", "finish"], max_failures=2)
    run_log = rig.line / "run.log"
    wait_until(lambda: run_log.exists() and "waiting for GPU 0 to be free" in run_log.read_text())
    assert rig.launches() == ["crash", "crash", "crash"]  # not 2 failures: 3 crashes beside another job
    assert rig.state()["failures_in_a_row"] == 0 and rig.state()["state"] == "waiting-gpu"
    set_gpu_pids(gpu_pids, [])  # the other job left
    assert rig.finish() == 0
    assert rig.launches() == ["crash", "crash", "crash", "finish"]
    assert "not counted as a failure" in (rig.line / "run.log").read_text()


def test_a_trainer_that_leaves_the_gpu_to_others_is_relaunched_once_it_is_free(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig.set_device("cuda")
    gpu_pids = rig.root / "gpu-pids.json"
    set_gpu_pids(gpu_pids, [4242])
    monkeypatch.setenv("FAKE_GPU_PIDS", str(gpu_pids))
    rig.start(["gpu-busy", "finish"], watchdog_seconds=0.5)
    assert [event["event"] for event in rig.notified("gpu_wait")] == ["gpu_wait"]
    assert rig.launches() == ["gpu-busy"]
    set_gpu_pids(gpu_pids, [])
    assert rig.finish() == 0
    assert rig.launches() == ["gpu-busy", "finish"] and rig.state()["failures_in_a_row"] == 0


def supervisor_lines(line: Path) -> list[str]:
    """The supervisor's run.log lines, without their time stamps."""
    marker = " supervisor: "
    return [text.split(marker, 1)[1] for text in (line / "run.log").read_text().splitlines() if marker in text]


def test_run_log_tells_a_relaunch_only_as_what_comes_next(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """"relaunching in 0 s" came before the supervisor waited for the GPU (or ran a tune, or ended
    for a stop): a relaunch that did not come then. A backoff is told as the wait it is."""
    rig.set_device("cuda")
    gpu_pids = rig.root / "gpu-pids.json"
    set_gpu_pids(gpu_pids, [4242])
    monkeypatch.setenv("FAKE_GPU_PIDS", str(gpu_pids))
    rig.start(["gpu-busy", "crash", "finish"], watchdog_seconds=0.5)
    run_log = rig.line / "run.log"
    wait_until(lambda: run_log.exists() and "waiting for GPU 0 to be free" in run_log.read_text())
    set_gpu_pids(gpu_pids, [])
    assert rig.finish() == 0
    lines = supervisor_lines(rig.line)
    assert not [text for text in lines if text.startswith("relaunching in")]
    left = lines.index("the trainer left GPU 0 to other processes: relaunching once it is free")
    assert lines[left + 1] == "waiting for GPU 0 to be free (other processes on it: [4242])"
    assert lines[left + 2].startswith("trainer launched (pid ") and lines[left + 2].endswith(", launch 2)")
    crashed = lines.index("the trainer exited with status 1")
    assert lines[crashed + 1] == "waiting 0.01 s before relaunching (failures in a row: 1)"
    assert lines[crashed + 2].startswith("trainer launched (pid ") and lines[crashed + 2].endswith(", launch 3)")


def test_a_trainer_that_trained_then_left_is_relaunched_beside_others_that_fit_the_reserve(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig.set_device("cuda")
    document = json.loads((rig.line / "run.json").read_text())
    document["guards"]["share_reserve_gb"] = 1.5  # the fake NVML gives each other process 1 GiB
    (rig.line / "run.json").write_text(json.dumps(document))
    gpu_pids = rig.root / "gpu-pids.json"
    set_gpu_pids(gpu_pids, [4242])
    monkeypatch.setenv("FAKE_GPU_PIDS", str(gpu_pids))
    # Trained on and left: relaunched at once beside the one that fits. Left at once: it waits.
    rig.start(["progress-gpu-busy", "gpu-busy", "finish"], watchdog_seconds=0.5)
    run_log = rig.line / "run.log"
    wait_until(lambda: run_log.exists() and "waiting for GPU 0 to be free" in run_log.read_text())
    assert rig.launches() == ["progress-gpu-busy", "gpu-busy"]
    set_gpu_pids(gpu_pids, [4242, 4343])  # 2 GiB: past the reserve, so nothing changes
    time.sleep(0.5)
    assert rig.launches() == ["progress-gpu-busy", "gpu-busy"]
    set_gpu_pids(gpu_pids, [])
    assert rig.finish() == 0
    assert rig.launches() == ["progress-gpu-busy", "gpu-busy", "finish"]


def test_the_data_preparer_is_kept_running_and_its_failures_notified(rig: Rig) -> None:
    data = rig.root / "data"
    data.mkdir()
    document = json.loads((rig.line / "run.json").read_text())
    document["data"]["line"] = str(data)
    (rig.line / "run.json").write_text(json.dumps(document))
    (rig.root / "fake_preparer.py").write_text(FAKE_PREPARER)
    rig.start(
        ["train-until-stop"],
        run_preparer=True,
        preparer_command=[sys.executable, str(rig.root / "fake_preparer.py")],
    )
    [failing] = [event for event in rig.notified("preparer_failing") if event["event"] == "preparer_failing"]
    assert "3 times in a row: hub unreachable" in failing["message"]
    with rig.wait_for_socket() as client:

        def preparer_ready() -> bool:
            preparer = client.call("status")["preparer"]
            return preparer["pid"] is not None and (preparer["status"] or {}).get("state") == "ready"

        wait_until(preparer_ready)
        preparer = client.call("status")["preparer"]
        client.mutate("stop")
    assert rig.finish() == 0
    assert not psutil.pid_exists(preparer["pid"]) or psutil.Process(preparer["pid"]).status() == "zombie"
    assert (data / "preparer-runs.txt").read_text().split() == ["run"] * 4
    assert "data preparer stopped" in (rig.line / "run.log").read_text()


def test_the_real_preparer_stops_when_its_supervisor_is_killed(rig: Rig) -> None:
    # run.json's data line is the module's prepared one: the real preparer finds it ready and polls.
    process = rig.start(["train-until-stop"], run_preparer=True)
    with rig.wait_for_socket() as client:
        # Both pids first: psutil.Process(None) is this test's own process, which never ends.
        def both_started() -> bool:
            status = client.call("status")
            return (status["preparer"] or {}).get("pid") is not None and status["trainer_pid"] is not None

        wait_until(both_started)
        status = client.call("status")
        preparer = psutil.Process(status["preparer"]["pid"])
        trainer = psutil.Process(status["trainer_pid"])
    process.kill()
    rig.finish()
    wait_gone(preparer)  # SIGTERM from the kernel when its parent died
    wait_gone(trainer)


def test_a_second_supervisor_of_the_line_is_refused(rig: Rig) -> None:
    rig.start(["train-until-stop"])
    with rig.wait_for_socket() as client:
        second = subprocess.run(
            [sys.executable, "-m", "engine.supervisor.supervisor", str(rig.line), "--foreground"],
            capture_output=True, text=True, timeout=60,
        )
        assert second.returncode == 2
        assert "a supervisor already runs this line" in second.stderr
        client.mutate("stop")
    assert rig.finish() == 0


def test_the_trainer_gets_sigterm_when_its_supervisor_dies(tmp_path: Path) -> None:
    marker = tmp_path / "terminated"
    child = (
        "import os, signal, sys, time\n"
        "from engine.supervisor.child import die_with_parent\n"
        "assert die_with_parent(int(sys.argv[1]))\n"
        f"signal.signal(signal.SIGTERM, lambda n, f: (open({str(marker)!r}, 'w').close(), sys.exit(0)))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = (
        "import os, subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-c', {child!r}, str(os.getpid())])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    supervisor = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    assert supervisor.stdout is not None
    child_pid = int(supervisor.stdout.readline())
    try:
        assert supervisor.stdout.readline().strip() == "ready"  # the child shares the pipe: past its prctl
        os.kill(supervisor.pid, signal.SIGKILL)
        supervisor.wait()
        deadline = time.monotonic() + 30
        while not marker.exists():
            assert time.monotonic() < deadline, "the trainer never got its SIGTERM"
            time.sleep(0.05)
    finally:
        if psutil.pid_exists(child_pid):
            os.kill(child_pid, signal.SIGKILL)


def fake_checkpoints(line: Path, *updates: int) -> None:
    """Checkpoint directories with nothing in them: a rollback's first checks pass, its verification fails."""
    for update in updates:
        (line / "checkpoints" / f"u{update:08d}").mkdir(parents=True)
    (line / "checkpoints" / "latest").write_text(f"u{max(updates):08d}\n")


def wait_for_state(client: SupervisorClient, state: str, timeout: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = client.call("status")
        if status["state"] == state:
            return status
        time.sleep(0.05)
    raise AssertionError(f"the supervisor never was {state!r}")


def wait_for_row(client: SupervisorClient) -> None:
    """Until a row is pushed (the stand-in trainer writes rows once it listens for SIGTERM)."""
    notification = client.next_notification(timeout=20)
    while notification is not None and notification.kind != "row":
        notification = client.next_notification(timeout=20)
    assert notification is not None


def test_a_rollback_refused_once_the_trainer_stopped_relaunches_it_and_counts_no_failure(rig: Rig) -> None:
    fake_checkpoints(rig.line, 1, 2)
    rig.start(["train-until-stop", "train-until-stop"])
    with rig.wait_for_socket() as client:
        client.subscribe(since_seq=0)
        wait_for_row(client)
        first = client.call("status")["trainer_pid"]
        with pytest.raises(RemoteError, match="u00000001") as refused:
            client.mutate("rollback", to=1)  # stops the trainer, then finds no checkpoint files
        assert refused.value.code == -32010
        deadline = time.monotonic() + 30
        while (client.call("status")["heartbeat"] or {}).get("pid") in (None, first):  # until relaunched
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert client.call("status")["failures_in_a_row"] == 0
        client.mutate("stop")
    assert rig.finish() == 0
    assert rig.launches() == ["train-until-stop", "train-until-stop"]
    assert "rollback refused: " in (rig.line / "run.log").read_text()
    assert rig.state()["state"] == "stopped" and rig.notified() == []


def test_work_waiting_for_the_trainer_is_refused_when_the_supervisor_stops_first(rig: Rig) -> None:
    fake_checkpoints(rig.line, 1, 2)
    process = rig.start(["hang"], stop_wait_seconds=2)  # a trainer that ignores SIGTERM
    answers: list[BaseException] = []

    def roll_back() -> None:
        with SupervisorClient(rig.line / "supervisor.sock") as other:
            try:
                other.mutate("rollback", to=1)
            except LineError as error:  # the refusal (RemoteError), or a connection lost before it came
                answers.append(error)

    with rig.wait_for_socket() as client:
        deadline = time.monotonic() + 30
        while (client.call("status")["heartbeat"] or {}).get("stage") != "hanging":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        asking = threading.Thread(target=roll_back)
        asking.start()
        wait_for_state(client, "pausing")
        process.send_signal(signal.SIGTERM)
        asking.join(timeout=30)
    assert rig.finish() == 0
    [answer] = answers
    assert "the supervisor ended (state stopped) before the rollback ran; nothing was changed" in str(answer)
    assert rig.launches() == ["hang"] and rig.state()["state"] == "stopped"
    assert (rig.line / "checkpoints" / "latest").read_text() == "u00000002\n"


class UnkillableTrainer:
    """A trainer that SIGKILL does not end (a process stuck in the driver, say): `wait` times out."""

    pid = 2**22 + 7  # no such pid: nothing real is signalled

    def __init__(self) -> None:
        self.killed = False

    def kill(self) -> None:
        self.killed = True

    def wait(self, timeout: float | None = None) -> int:
        raise subprocess.TimeoutExpired("trainer", timeout or 0)


def test_a_trainer_that_survives_sigkill_leaves_the_line_stuck_and_says_so(rig: Rig) -> None:
    from engine.protocol.facts import SupervisorExitCode
    from engine.supervisor.supervisor import Supervisor, SupervisorSettings

    supervisor = Supervisor(rig.line, SupervisorSettings(kill_wait_seconds=0.05))
    trainer = UnkillableTrainer()
    outcome = supervisor._kill(trainer, time.time() - 5, watchdog=True, stopped_by_us=False)
    assert trainer.killed and outcome.code is None and outcome.killed_by_watchdog
    assert supervisor._judge(outcome) == SupervisorExitCode.FAILED
    state = rig.state()
    assert state["state"] == "stuck" and state["last_event"]["event"] == "stuck"
    assert "stuck: the trainer was killed but does not exit" in (rig.line / "run.log").read_text()


def test_crashes_are_counted_over_every_life_of_the_supervisor_and_deliberate_relaunches_are_not(rig: Rig) -> None:
    rig.start(["crash", "sigterm", "finish"])
    assert rig.finish() == 0
    assert (rig.state()["launches"], rig.state()["crashes"]) == (3, 2)
    # A stop and a resume: no crash; the count carries over to the next supervisor.
    rig.start(["train-until-stop", "finish"])
    with rig.wait_for_socket() as client:
        client.subscribe(since_seq=0)
        wait_for_row(client)
        assert client.call("status")["crashes"] == 2
        client.mutate("stop")
    assert rig.finish() == 0
    assert rig.state()["crashes"] == 2
    # A supervisor killed with the line training: the next one counts it.
    process = rig.start(["train-until-stop", "finish"])
    with rig.wait_for_socket() as client:
        client.subscribe(since_seq=0)
        wait_for_row(client)
        trainer = psutil.Process(client.call("status")["trainer_pid"])
    process.kill()
    rig.finish()
    wait_gone(trainer)  # it stops on the SIGTERM its supervisor's death sends
    rig.start(["finish"])
    assert rig.finish() == 0
    assert rig.state()["crashes"] == 3 and rig.state()["state"] == "finished"
    assert "ended in state training without ending the line: counted as a crash" in (rig.line / "run.log").read_text()
