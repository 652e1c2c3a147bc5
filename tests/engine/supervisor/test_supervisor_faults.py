"""Faults a weeks-long line meets at its supervisor (issue 25, item 12), on a real supervisor and
trainer: a retried mutation after a kill -9 of the supervisor is answered, not applied twice; a
supervisor.json damaged by hand (a non-integer error code) does not stop the next start; a queued
branch into a path with a non-UTF-8 byte does not wedge `status`."""

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
from helpers.lines import make_data_line, make_line
from helpers.supervise import gone, start_supervisor

from engine.supervisor import registry
from nsconsole.client import SupervisorClient

pytestmark = pytest.mark.usefixtures("private_host")  # conftest: an empty host.json, a private runtime dir


def _wait_registered(line: Path, supervisor: subprocess.Popen[bytes]) -> int:
    deadline = time.monotonic() + 60
    while (entry := registry.find_supervisor(line)) is None or entry.pid != supervisor.pid:
        assert supervisor.poll() is None, f"the supervisor exited with {supervisor.returncode}"
        assert time.monotonic() < deadline, "the supervisor did not register"
        time.sleep(0.05)
    return entry.pid


def _trainer_pid(client: SupervisorClient) -> int:
    deadline = time.monotonic() + 120
    while (pid := client.call("status")["trainer_pid"]) is None:
        assert time.monotonic() < deadline, "no trainer was launched"
        time.sleep(0.1)
    return pid


@pytest.mark.slow
def test_a_retried_stop_after_a_supervisor_kill_is_answered_once_and_damaged_records_do_not_stop_a_start(
    tmp_path: Path,
) -> None:
    # No cycle prepared and no preparer: the trainer checkpoints update 0 and waits for data, alive.
    line = make_line(tmp_path, make_data_line(tmp_path, prepare=0))
    supervisor = start_supervisor(tmp_path, line, run_preparer=False)
    trainer = None
    try:
        _wait_registered(line, supervisor)
        with SupervisorClient(line / "supervisor.sock", timeout=60) as client:
            trainer = _trainer_pid(client)
            first = client.call("stop", request_id="stop-at-cycle-7", at_cycle_end=7)
            # Before the reply left, supervisor.json held the request (no other state change came).
            kept = json.loads((line / "supervisor.json").read_text())["requests"]
            assert [record["request_id"] for record in kept] == ["stop-at-cycle-7"]
        os.kill(supervisor.pid, signal.SIGKILL)
        supervisor.wait()
        psutil.Process(trainer).wait(timeout=60)  # it saw its supervisor die and stopped
    finally:
        for pid in (supervisor.pid, trainer):
            if pid is not None and not gone(pid):
                os.kill(pid, signal.SIGKILL)

    # Damaged by hand meanwhile: a record with a non-integer error code, a queued branch into a
    # path with a non-UTF-8 byte (as `os.fsdecode` gives it: a lone surrogate).
    document = json.loads((line / "supervisor.json").read_text())
    document["requests"].append({"request_id": "odd", "digest": "x", "error": {"code": "eleven", "message": "m"}})
    document["requests"].append({"request_id": "odder", "digest": "x", "error": {"code": None}})
    branch = os.fsdecode(os.fsencode(str(tmp_path)) + b"/branch-\xff")
    document["queued_forks"] = [{"path": branch, "at_cycle": 40, "plan": "long:1000", "data": str(tmp_path / "data"),
                                 "long_seq_len": None, "requested": time.time()}]
    (line / "supervisor.json").write_text(json.dumps(document))

    again = start_supervisor(tmp_path, line, run_preparer=False)
    try:
        _wait_registered(line, again)
        with SupervisorClient(line / "supervisor.sock", timeout=60) as client:
            retried = client.call("stop", request_id="stop-at-cycle-7", at_cycle_end=7)
            assert retried == first  # answered from the record: the same request, not a second one
            status = client.call("status")
            assert [fork["path"] for fork in status["queued_forks"]] == [branch]
            assert client.call("status")["state"] in ("starting", "training")  # not wedged
        shown = subprocess.run([sys.executable, "-m", "nsconsole", "status", str(line)], capture_output=True,
                               timeout=120)
        assert shown.returncode == 0, shown.stderr.decode(errors="replace")
        with SupervisorClient(line / "supervisor.sock", timeout=60) as client:
            client.call("stop", request_id="stop-now", at_cycle_end=None)
        assert again.wait(timeout=120) == 0
    finally:
        if again.poll() is None:
            again.kill()
    assert json.loads((line / "supervisor.json").read_text())["state"] == "stopped"


@pytest.mark.slow
def test_a_supervisor_json_that_does_not_read_is_replaced_with_a_word_in_run_log(tmp_path: Path) -> None:
    # Before, the start replaced it without a word: the requests, queued branches and crash count it
    # held were gone, and nothing said so.
    line = make_line(tmp_path, make_data_line(tmp_path, prepare=0))
    (line / "supervisor.json").write_text("{garbage")
    supervisor = start_supervisor(tmp_path, line, run_preparer=False)
    try:
        _wait_registered(line, supervisor)
        log = (line / "run.log").read_text()
        assert f"{line / 'supervisor.json'}: not JSON (" in log
        assert "; replaced by this supervisor's record (the requests, queued branches and crash count" in log
        with SupervisorClient(line / "supervisor.sock", timeout=60) as client:
            client.call("stop", request_id="stop-now", at_cycle_end=None)
        assert supervisor.wait(timeout=120) == 0
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.wait()
    assert json.loads((line / "supervisor.json").read_text())["state"] == "stopped"
