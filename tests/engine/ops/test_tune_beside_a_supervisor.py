"""`nsconsole tune LINE` is refused while a supervisor runs the line, not only while its trainer
does. Between two launches (a relaunch's backoff after a crash, a wait for the GPU) no trainer runs,
and the tune measured and rewrote run.json while the supervisor launched a trainer beside it (a kill
-9 of the trainer, then `nsconsole tune` within the 5 s backoff: `written to LINE/run.json`, exit 0).
A running line is tuned by its supervisor, between two launches of its own (the console's t)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.lines import copy_data_line, data_template_fixture, make_line

from nsconsole.cli import main

data_template = data_template_fixture(prepare=1)

SUPERVISOR_BETWEEN_LAUNCHES = """
import fcntl, json, os, sys
import psutil
line = sys.argv[1]
fd = os.open(line, os.O_RDONLY | os.O_DIRECTORY)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a supervisor holds its line
me = psutil.Process()
record = {"pid": me.pid, "boot_start": me.create_time() - psutil.boot_time(), "started": me.create_time(),
          "state": "relaunching", "trainer_pid": None, "engine": "auto", "stop_at": None}
with open(os.path.join(line, "supervisor.json"), "w") as file:
    json.dump(record, file)
print(me.pid, flush=True)
sys.stdin.read()  # until the test lets go
"""


def test_tune_is_refused_while_a_supervisor_runs_the_line_between_two_launches(
    tmp_path: Path, data_template: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = make_line(tmp_path, copy_data_line(data_template, tmp_path))
    run_json = hashlib.sha256((line / "run.json").read_bytes()).hexdigest()
    supervisor = subprocess.Popen([sys.executable, "-c", SUPERVISOR_BETWEEN_LAUNCHES, str(line)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert supervisor.stdout is not None
        pid = int(supervisor.stdout.readline())
        status = main(["tune", str(line), "--max-rows", "1"])
    finally:
        supervisor.communicate("")  # stdin closed: it exits
    captured = capsys.readouterr()
    assert captured.err == (f"nsconsole: {line}: a supervisor already runs this line (pid {pid}); tune it from the "
                            "console (t), or stop the line first\n")
    assert (status, captured.out) == (2, "")
    assert hashlib.sha256((line / "run.json").read_bytes()).hexdigest() == run_json
