"""`nsconsole run LINE --no-supervisor` on a data line whose next cycle is not prepared, with no
data preparer running: its trainer waits for the cycle forever. The run says so at once, on
stderr, with the command that serves the wait (found in the walkthrough of using a model: a
fresh line run without its supervisor sat at 'waiting for data cycle 0' with no hint)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

from helpers import REPOSITORY
from helpers.lines import make_data_line, make_line

from datalines.service import LOCK_NAME
from engine.ops.cycle_check import start_without_preparer


def test_a_run_without_supervisor_or_preparer_says_its_cycle_is_not_coming(tmp_path: Path) -> None:
    data = make_data_line(tmp_path, prepare=0)
    line = make_line(tmp_path, data)
    expected = (f"{line}: data cycle 0 is not prepared yet and no data preparer runs on {data}: the trainer waits "
                f"until one makes it (`nsconsole data run-preparer --work {data}`")  # fmt: skip
    assert (start_without_preparer(line) or "").startswith(expected)
    environment = dict(os.environ, PYTHONPATH=str(REPOSITORY), OMP_NUM_THREADS="1")
    process = subprocess.Popen([sys.executable, "-m", "nsconsole", "run", str(line), "--no-supervisor"],
                               cwd=REPOSITORY, env=environment, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert process.stderr is not None
        first = process.stderr.readline()  # the warning comes before the trainer loads torch's models
        assert first.startswith(f"nsconsole: warning: {expected}"), first
        time.sleep(1.0)
        assert process.poll() is None  # not a refusal: a preparer started by hand serves the wait
    finally:
        process.kill()
        process.wait(timeout=60)

    with open(data / LOCK_NAME, "a+") as held:  # a preparer holds its data line's lock for its life
        fcntl.flock(held, fcntl.LOCK_EX)
        assert start_without_preparer(line) is None
    prepared = make_data_line(tmp_path / "prepared", prepare=1)
    assert start_without_preparer(make_line(tmp_path / "prepared", prepared)) is None
