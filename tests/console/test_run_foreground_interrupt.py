"""Ctrl-C in the terminal of `nsconsole run LINE --foreground`, for a line at parallel.degree 2 (two
gloo ranks under torchrun): the line stops with a checkpoint, and run.log (echoed to the terminal)
says so and nothing else.

Found in a walkthrough of a degree-2 line: the SIGINT the terminal sends its whole foreground
process group reached the data preparer, which exited 130 as the line stopped, and the supervisor
told of a failed preparer, "restarting in 5 s", that it never restarted; and torchrun, ended by the
signal and then by the supervisor's SIGTERM, printed two chained tracebacks of its SignalException,
read as a crash where nothing had failed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.lines import copy_data_line, data_template_fixture, make_line

from engine.checkpoints.format import read_latest

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("private_host")]

data_template = data_template_fixture()


def test_ctrl_c_stops_a_degree_2_line_in_the_foreground_with_nothing_reported_failed(
    tmp_path: Path, data_template: Path
) -> None:
    line = make_line(tmp_path, copy_data_line(data_template, tmp_path), **{"parallel.degree": 2})
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with open(tmp_path / "terminal.txt", "wb") as terminal:
        # A session of its own, as a shell's job: the test sends its process group what a terminal sends.
        run = subprocess.Popen(
            [sys.executable, "-m", "nsconsole", "run", str(line), "--foreground"],
            stdin=subprocess.DEVNULL, stdout=terminal, stderr=subprocess.STDOUT, env=environment,
            start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (line / "rows.jsonl").exists() or (line / "rows.jsonl").read_bytes().count(b"\n") < 3:
            assert run.poll() is None and time.monotonic() < deadline, (tmp_path / "terminal.txt").read_text()
            time.sleep(0.05)
        os.killpg(run.pid, signal.SIGINT)  # Ctrl-C
        assert run.wait(timeout=120) == 0
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    state = json.loads((line / "supervisor.json").read_text())
    assert state["state"] == "stopped" and state["crashes"] == 0
    log = (line / "run.log").read_text()
    assert "data preparer exited" not in log and "restarting in" not in log
    assert "Traceback" not in log and "SignalException" not in log
    assert "data preparer stopped" in log
    updates = [json.loads(row)["update"] for row in (line / "rows.jsonl").read_text().splitlines()]
    assert updates == list(range(1, len(updates) + 1))
    assert read_latest(line / "checkpoints") == f"u{updates[-1]:08d}"  # stopped with a checkpoint
