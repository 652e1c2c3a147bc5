"""A line at parallel.degree 2 under the real supervisor: torchrun starts two gloo ranks on the CPU.

One rank SIGKILLed ends the group and the supervisor relaunches it from the newest checkpoint; a
rank stopped by SIGSTOP hangs the group's next collective, rank 0's heartbeat stops, and the
supervisor's watchdog kills the whole group (the stopped rank included) and relaunches it. Either
way the line's record has every update once, in order, and its checkpoint counts it.
"""

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
from helpers.lines import copy_data_line, data_template_fixture, make_line
from helpers.supervise import RUNNER, gone

from engine.checkpoints.format import read_latest, verify_line_checkpoints
from engine.checkpoints.tensors import load_checkpoint
from engine.supervisor.child import host_cores

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("private_host")]

data_template = data_template_fixture()

STOP_AT = 24


def supervise(tmp_path: Path, line: Path, **settings: object) -> subprocess.Popen[bytes]:
    runner = tmp_path / "runner.py"
    runner.write_text(RUNNER)
    settings = {"poll_seconds": 0.1, "relaunch_delay_seconds": 0.05, "run_preparer": False,
                "stop_at": STOP_AT, **settings}  # fmt: skip
    return subprocess.Popen([sys.executable, str(runner), str(line), json.dumps(settings)])


def count_rows(line: Path) -> int:
    try:
        return (line / "rows.jsonl").read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def rank_process(line: Path, rank: int, supervisor: subprocess.Popen[bytes]) -> psutil.Process:
    """The running group's rank `rank` (a descendant of the trainer the supervisor launched)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert supervisor.poll() is None
        state = json.loads((line / "supervisor.json").read_text()) if (line / "supervisor.json").exists() else {}
        if state.get("trainer_pid"):
            try:
                for child in psutil.Process(state["trainer_pid"]).children(recursive=True):
                    if child.environ().get("RANK") == str(rank):
                        return child
            except psutil.Error:
                pass
        time.sleep(0.05)
    raise AssertionError(f"no rank {rank} appeared")


def wait_for_rows(line: Path, rows: int, supervisor: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 300
    while count_rows(line) < rows:
        assert time.monotonic() < deadline and supervisor.poll() is None, "the line stopped training"
        time.sleep(0.005)


def assert_one_unbroken_record(line: Path) -> None:
    """Every update once and in order, up to the checkpoint that ends the line, which counts them."""
    updates = [json.loads(row)["update"] for row in (line / "rows.jsonl").read_text().splitlines()]
    assert updates == list(range(1, len(updates) + 1))
    latest = load_checkpoint(line / "checkpoints" / read_latest(line / "checkpoints"))
    assert latest.update == updates[-1] and latest.state["rows"] == len(updates)
    assert latest.state["degree"] == 2
    assert verify_line_checkpoints(line) == []


def test_a_killed_rank_ends_the_group_and_the_line_resumes(tmp_path: Path, data_template: Path) -> None:
    line = make_line(tmp_path, copy_data_line(data_template, tmp_path), **{"parallel.degree": 2})
    supervisor = supervise(tmp_path, line)
    try:
        victim = rank_process(line, 1, supervisor)
        wait_for_rows(line, 7, supervisor)  # past the checkpoint at update 5
        victim.send_signal(signal.SIGKILL)
        assert supervisor.wait(timeout=600) == 0
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
    state = json.loads((line / "supervisor.json").read_text())
    assert state["state"] == "finished" and state["launches"] == 2 and state["crashes"] == 1
    assert_one_unbroken_record(line)
    assert "resumed from u0000000" in (line / "run.log").read_text()
    assert gone(victim.pid)


def test_a_stopped_rank_hangs_the_group_until_the_watchdog_kills_it(tmp_path: Path, data_template: Path) -> None:
    # The collective's own timeout far beyond the watchdog's: the heartbeat is what ends this group.
    line = make_line(tmp_path, copy_data_line(data_template, tmp_path),
                     **{"parallel.degree": 2, "parallel.timeout_minutes": 10})  # fmt: skip
    supervisor = supervise(tmp_path, line, watchdog_seconds=30)  # margin for a loaded CI machine
    try:
        victim = rank_process(line, 1, supervisor)
        wait_for_rows(line, 7, supervisor)
        victim.send_signal(signal.SIGSTOP)
        assert supervisor.wait(timeout=600) == 0
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
    state = json.loads((line / "supervisor.json").read_text())
    assert state["state"] == "finished" and state["launches"] == 2
    assert "no heartbeat for 30 s: killing the trainer" in (line / "run.log").read_text()
    assert gone(victim.pid)  # the stopped rank was killed with its group
    assert_one_unbroken_record(line)


def test_a_stopped_supervisor_stops_the_group_with_a_checkpoint(tmp_path: Path, data_template: Path) -> None:
    """SIGTERM to the supervisor: torchrun forwards it to both ranks, which agree on the update to stop
    at; rank 0 checkpoints it and the supervisor reads the ranks' status through torchrun's 1."""
    line = make_line(tmp_path, copy_data_line(data_template, tmp_path), **{"parallel.degree": 2})
    supervisor = supervise(tmp_path, line, stop_at=None)
    try:
        # torchrun's default of one thread a rank (its banner in run.log), not the host's cores shared out.
        threads = rank_process(line, 1, supervisor).environ()["OMP_NUM_THREADS"]
        assert threads == os.environ.get("OMP_NUM_THREADS", str(host_cores()))
        wait_for_rows(line, 3, supervisor)
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(timeout=600) == 0
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
    state = json.loads((line / "supervisor.json").read_text())
    assert state["state"] == "stopped" and state["crashes"] == 0
    assert state["last_exit"]["code"] == 128 + signal.SIGTERM  # the ranks' status, not torchrun's
    log = (line / "run.log").read_text()
    assert "stopped: signal SIGTERM" in log
    assert "Traceback" not in log  # torchrun's SignalException, printed whole after every stop, read as a crash
    assert "Setting OMP_NUM_THREADS" not in log
    assert "stopped: signal SIGTERM" in (line / "ranks" / "rank1.log").read_text()
    assert_one_unbroken_record(line)
