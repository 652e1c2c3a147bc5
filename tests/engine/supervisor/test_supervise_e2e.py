"""A real tiny line under the real supervisor: kill -9 the trainer (resumed), kill -9 the
supervisor (the trainer stops with a checkpoint), start again and finish: one unbroken record."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from helpers.lines import copy_data_line, make_data_line, make_line
from helpers.supervise import RUNNER, wait_for

from datalines import open_data_line
from datalines.preparer import prepare_cycle
from engine.supervisor import registry
from nsconsole.client import SupervisorClient

pytestmark = pytest.mark.usefixtures("private_host")  # conftest: an empty host.json, a private runtime dir


@pytest.fixture(scope="module")
def data_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Only cycle 0 is prepared: the trainer then waits for cycle 1, alive, whatever its speed.
    return make_data_line(tmp_path_factory.mktemp("template"), prepare=1)


@pytest.mark.slow
def test_run_in_the_background_returns_once_the_supervisor_answers(
    tmp_path: Path, data_template: Path
) -> None:
    line = make_line(tmp_path, copy_data_line(data_template, tmp_path))
    started = subprocess.run(
        [sys.executable, "-m", "engine.supervisor.supervisor", str(line), "--stop-at", "3"],
        capture_output=True, text=True, timeout=120,
    )
    assert started.returncode == 0, started.stderr
    assert "runs in the background" in started.stdout
    entry = registry.find_supervisor(line)
    assert entry is not None and os.getsid(entry.pid) == entry.pid  # a session of its own
    psutil.Process(entry.pid).wait(timeout=120)  # trains to --stop-at, then ends
    assert json.loads((line / "supervisor.json").read_text())["state"] == "finished"
    updates = [json.loads(row)["update"] for row in (line / "rows.jsonl").read_text().splitlines()]
    assert updates == [1, 2, 3]
    # The data preparer ran beside the trainer (cycle 1 got prepared) and was stopped with the line.
    preparer = json.loads((tmp_path / "data" / "preparer.json").read_text())
    assert preparer["state"] == "stopped" and 1 in preparer["ready"]
    refused = subprocess.run(
        [sys.executable, "-m", "engine.supervisor.supervisor", str(tmp_path / "nowhere")], capture_output=True, text=True
    )
    assert refused.returncode == 2 and refused.stderr.startswith("nsconsole: ")


@pytest.mark.slow
def test_a_real_line_survives_crashes_of_its_trainer_and_its_supervisor(
    tmp_path: Path, data_template: Path
) -> None:
    data = copy_data_line(data_template, tmp_path)
    line = make_line(tmp_path, data)
    runner = tmp_path / "runner.py"
    runner.write_text(RUNNER)
    # No preparer: the trainer must stay waiting for cycle 1 (the test prepares it later itself).
    settings = {"poll_seconds": 0.1, "relaunch_delay_seconds": 0.05, "run_preparer": False}
    supervisor = subprocess.Popen([sys.executable, str(runner), str(line), json.dumps(settings)])
    trainer_pid = None
    try:
        deadline = time.monotonic() + 60
        while registry.find_supervisor(line) is None:
            assert time.monotonic() < deadline and supervisor.poll() is None
            time.sleep(0.05)
        with SupervisorClient(line / "supervisor.sock") as client:
            client.subscribe(since_seq=0)
            wait_for(client, "row", lambda row: row["update"] >= 7)  # past the rolling checkpoint at 5
            os.kill(client.call("status")["trainer_pid"], signal.SIGKILL)
            wait_for(client, "event", lambda event: event["event"] == "crashed")
            launched = wait_for(client, "event", lambda event: event["event"] == "launched")
            trainer_pid = int(launched["message"].split("pid ")[1].rstrip(")"))
            wait_for(client, "heartbeat", lambda beat: beat["pid"] == trainer_pid)  # resumed and running
            status = client.call("status")
            assert status["launches"] == 2 and status["last_exit"]["code"] == -signal.SIGKILL
            assert status["trainer_pid"] == trainer_pid
        os.kill(supervisor.pid, signal.SIGKILL)
        supervisor.wait()
        psutil.Process(trainer_pid).wait(timeout=60)  # it saw its supervisor die and stopped
    finally:
        for pid in (supervisor.pid, trainer_pid):
            if pid is not None and psutil.pid_exists(pid):
                os.kill(pid, signal.SIGKILL)
    heartbeat = json.loads((line / "heartbeat").read_text())
    assert heartbeat["stage"] == "stopped" and heartbeat["reason"] == "signal SIGTERM"
    assert (line / "checkpoints" / "latest").read_text().strip() == f"u{heartbeat['update']:08d}"
    assert registry.list_supervisors() == []  # the dead supervisor's entry is stale

    data_line = open_data_line(data)
    index = 1
    while data_line.last_cycle() is None or index <= data_line.last_cycle():
        prepare_cycle(data_line, index)
        index += 1
    stop_at = heartbeat["update"] + 3
    again = subprocess.run(
        [sys.executable, "-m", "engine.supervisor.supervisor", str(line), "--foreground", "--stop-at", str(stop_at)],
        capture_output=True, text=True, timeout=300,
    )
    assert again.returncode == 0, again.stdout + again.stderr
    assert "stopped: reached --stop-at" in again.stdout  # run.log echoed to the terminal
    updates = [json.loads(row)["update"] for row in (line / "rows.jsonl").read_text().splitlines()]
    assert updates == list(range(1, stop_at + 1))
    assert json.loads((line / "supervisor.json").read_text())["state"] == "finished"
    assert not (line / "supervisor.sock").exists()
