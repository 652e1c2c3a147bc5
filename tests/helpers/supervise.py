"""Running real supervisors in the tests: a runner script, waiting for notifications, stopping."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

from engine.supervisor import registry
from nsconsole.client import SupervisorClient

RUNNER = r'''
import json, sys
from engine.supervisor.supervisor import Supervisor, SupervisorSettings
raise SystemExit(Supervisor(sys.argv[1], SupervisorSettings(**json.loads(sys.argv[2]))).run())
'''


def start_supervisor(root: Path, line: Path, run_preparer: bool = True) -> subprocess.Popen[bytes]:
    """A real supervisor of `line` in a child process (RUNNER), polling fast; `run_preparer=False`
    leaves the data line's unprepared cycles unprepared (the trainer waits for them, alive)."""
    runner = root / "runner.py"
    runner.write_text(RUNNER)
    settings = {"poll_seconds": 0.1, "relaunch_delay_seconds": 0.05, "run_preparer": run_preparer}
    return subprocess.Popen([sys.executable, str(runner), str(line), json.dumps(settings)])


def wait_for(client: SupervisorClient, kind: str, accept, timeout: float = 120) -> dict:
    """The data of the next notification of `kind` that `accept` takes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        notification = client.next_notification(timeout=1)
        if notification is not None and notification.kind == kind and accept(notification.data):
            return notification.data
    raise AssertionError(f"no {kind} notification came that the test accepts")



def stop_supervisor(line: Path, timeout: float = 120.0) -> None:
    """Stop the supervisor running `line` (a branch's: started by its trunk's) over its socket and
    wait for its exit."""
    entry = registry.find_supervisor(line)  # a branch's registered before `branched` was published
    assert entry is not None, f"no supervisor runs {line}"
    with SupervisorClient(line / "supervisor.sock", timeout=timeout) as client:
        client.call("stop", request_id="stop-by-test", at_cycle_end=None)
    deadline = time.monotonic() + timeout
    while not gone(entry.pid):
        assert time.monotonic() < deadline, f"the supervisor of {line} (pid {entry.pid}) did not exit"
        time.sleep(0.1)
    assert json.loads((line / "supervisor.json").read_text())["state"] == "stopped"


def kill_line_processes(root: Path) -> list[str]:
    """Kill every live supervisor, trainer or preparer of a line under `root`; their command lines."""
    killed = []
    for process in psutil.process_iter(["cmdline", "status"]):
        cmdline = process.info["cmdline"] or []
        ours = any(part.startswith("engine.supervisor.supervisor") or part == "engine.supervisor.children" for part in cmdline)
        if ours and any(str(root) in part for part in cmdline) and process.info["status"] != psutil.STATUS_ZOMBIE:
            killed.append(" ".join(cmdline))
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
    return killed


def gone(pid: int) -> bool:
    """The process has exited (a zombie too: its parent collects it at its next look)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def this_process_as_trainer() -> dict[str, float | int]:
    """The heartbeat fields that name this very process as the line's trainer (pid and start since
    boot, as a trainer's beat records them): a test process standing for a running trainer."""
    from engine.process_start import started_since_boot

    return {"pid": os.getpid(), "pid_boot_start": started_since_boot(psutil.Process())}


def end_line_processes(runners: list[subprocess.Popen[bytes]], root: Path) -> list[str]:
    """A test's cleanup: kill each supervisor runner still running (and collect it), then every
    process of a line under `root` (`kill_line_processes`, whose list it returns: a test asserts it empty)."""
    for runner in runners:
        if runner.poll() is None:
            runner.kill()
        runner.wait()
    return kill_line_processes(root)
