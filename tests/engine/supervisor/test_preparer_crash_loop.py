"""A preparer that crashes every time after its first status (issue 25, item 12) is backed off and
reported: a new process's first status (no failure yet) is no proof of a good run."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from engine.supervisor.preparer import FAILING_AFTER, PreparerKeeper

CRASHING_PREPARER = r"""
import json, os, sys, time
work = sys.argv[sys.argv.index("--work") + 1]
status = {"state": "preparing", "cycle": 3, "progress": 0.0, "message": "preparing cycle 3",
          "waiting_reason": None, "failures": 0, "consecutive_failures": 0, "last_error": None,
          "ready": [], "prepared": 0, "pid": os.getpid(), "time": time.time()}
with open(os.path.join(work, "preparer.json.tmp"), "w") as handle:
    json.dump(status, handle)
os.replace(os.path.join(work, "preparer.json.tmp"), os.path.join(work, "preparer.json"))
time.sleep(0.3)
print("MemoryError: tokenizing cycle 3", flush=True)
sys.exit(1)
"""


def test_a_crash_looping_preparer_is_backed_off_and_reported(tmp_path: Path) -> None:
    script = tmp_path / "crashing_preparer.py"
    script.write_text(CRASHING_PREPARER)
    said: list[str] = []
    failing: list[str] = []
    keeper = PreparerKeeper(
        tmp_path, say=said.append, notify_failing=failing.append,
        command=[sys.executable, str(script)], restart_delay=0.05,
    )
    deadline = time.monotonic() + 60
    while not failing:
        assert time.monotonic() < deadline, f"never reported as failing: {said}"
        keeper.tick()
        time.sleep(0.02)
    keeper.stop(timeout=5)

    restarts = [line for line in said if "restarting in" in line]
    assert [line.split("restarting in ")[1] for line in restarts] == ["0.05 s", "0.1 s", "0.2 s"]
    assert all("MemoryError: tokenizing cycle 3" in line for line in restarts)  # the log's last line
    assert len(failing) == 1
    assert f"exited with a failure {FAILING_AFTER} times in a row: MemoryError: tokenizing cycle 3" in failing[0]
    assert keeper.snapshot()["exits_in_a_row"] == FAILING_AFTER


def test_a_run_that_prepared_a_cycle_resets_the_count(tmp_path: Path) -> None:
    keeper = PreparerKeeper(tmp_path, say=lambda _: None, notify_failing=lambda _: None, command=["true"])
    base = {"state": "preparing", "consecutive_failures": 0}
    assert not keeper._did_work({**base, "prepared": 0})
    assert keeper._did_work({**base, "prepared": 1})
    assert keeper._did_work({**base, "state": "ready", "prepared": 0})
    assert not keeper._did_work({"state": "retrying", "consecutive_failures": 2, "prepared": 1})
