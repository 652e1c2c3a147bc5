"""`nsconsole status LINE` for an operator back after days away: why a running line waits or was
restarted (its last event), and a trainer's pid that another process took after a reboot not shown as
the trainer alive beside "supervisor lost" (found in a walkthrough of unattended lines)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import psutil
import test_status_state
from test_status_state import dead_pid, printed, write_supervisor

from engine.process_start import started_since_boot

line = test_status_state.line  # its fixture: a line directory with a minimal run.json

PREPARER_FAILING = "the data preparer exited with a failure 3 times in a row: /data/c/part19.jsonl: gone since init"


def test_a_running_line_says_its_last_event_and_how_long_ago(line: Path) -> None:
    me = psutil.Process()
    event = {"event": "preparer_failing", "message": PREPARER_FAILING, "time": time.time() - 600, "update": 100}
    write_supervisor(line, state="training", pid=me.pid, boot_start=started_since_boot(me), last_event=event)
    shown = printed(line)
    assert shown[1] == f"state: training (supervisor pid {me.pid})"
    assert shown[2] == f"last event: preparer_failing 10 min ago: {PREPARER_FAILING}"


def test_a_lost_line_says_its_last_event_and_an_ended_one_does_not(line: Path) -> None:
    event = {"event": "data_wait", "message": "the trainer has waited for data cycle 10 longer than the watchdog "
             "interval", "time": time.time() - 7200 * 3}  # fmt: skip
    write_supervisor(line, state="training", pid=dead_pid(), last_event=event)
    assert printed(line)[2] == f"last event: data_wait 6.0 h ago: {event['message']}"
    write_supervisor(line, state="stopped", pid=dead_pid(), last_event=event)
    assert not any(text.startswith("last event:") for text in printed(line))


def test_a_heartbeat_pid_another_process_took_is_not_running(line: Path) -> None:
    me = psutil.Process()
    write_supervisor(line, state="training", pid=dead_pid())
    beat = {"time": time.time() - 30, "update": 16, "stage": "training", "pid": me.pid}
    # After a reboot: the pid the trainer had now names a process that started at another time since boot.
    (line / "heartbeat").write_text(json.dumps({**beat, "pid_boot_start": started_since_boot(me) - 3600}))
    shown = printed(line)
    assert shown[1] == "state: supervisor lost (it was training; its process runs no more)"
    assert f"heartbeat: 30 s ago, update 16, stage training, pid {me.pid} (not running)" in shown
    (line / "heartbeat").write_text(json.dumps({**beat, "pid_boot_start": started_since_boot(me)}))  # the very one
    assert f"heartbeat: 30 s ago, update 16, stage training, pid {me.pid} (alive)" in printed(line)
