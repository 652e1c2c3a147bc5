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


ROWS_TRAINER = r'''
import json, os, signal, sys, time
line, go = sys.argv[1], sys.argv[2]  # then the supervisor's: LINE --parent PID --engine E
stopping = []
signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
def beat(update, stage):
    with open(os.path.join(line, "heartbeat.tmp"), "w") as handle:
        json.dump({"time": time.time(), "update": update, "stage": stage, "pid": os.getpid()}, handle)
    os.replace(os.path.join(line, "heartbeat.tmp"), os.path.join(line, "heartbeat"))
def row(update):
    return {"update": update, "tokens": update * 512, "loss": 3.0 + 1 / update, "lr": 3e-3, "grad_norm": 1.0,
            "seq_len": 32, "skipped": False, "tokens_per_s": 1000.0, "time": time.time()}
rows = open(os.path.join(line, "rows.jsonl"), "a")
update, written = 0, False
while not stopping:
    if update < 5 or written:
        update += 1
        rows.write(json.dumps(row(update), sort_keys=True) + "\n")
    elif os.path.exists(go):
        # An ns-2b validation: 48 layers' probes, 20 heads each, and its samples.
        validation = {"update": update, "tokens": update * 512, "seq_len": 32, "val_32/mix": 3.25}
        for layer in range(48):
            for head in range(20):
                for name in ("clock_tau", "write", "attn_entropy", "attn_mean_log2", "rope_ext_q"):
                    validation[f"val_32/hippocampal/layer{layer:02d}/{name}_head{head}"] = layer + head / 100
        validation["samples"] = [{"source": "text", "prompt": "the", "text": "a \"quoted\" word " * 200}]
        rows.write(json.dumps(validation, sort_keys=True) + "\n")
        written = True
    rows.flush()
    beat(update, "training")
    time.sleep(0.2)
beat(update, "stopped")
'''
"""A trainer's stand-in for the supervisor: `python ROWS_TRAINER LINE GO` appends rows 1 to 5 to
LINE's rows.jsonl, beating every 0.2 s, and waits for the file GO; then it writes one ns-2b-sized
validation row (48 layers' probes of 20 heads, and its samples: about 350 KB, past the protocol's
64 KiB line) and a row every 0.2 s. It ends on SIGTERM. The supervisor appends its own arguments
(LINE --parent PID --engine E) after these."""

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
