"""Two `nsconsole resume`s at once (a crontab @reboot line and a systemd unit, say): the one whose
start of a lost line finds it taken by the other's supervisor, after it judged the line lost, leaves
it alone, names who runs it and exits 0. Before, it said `nsconsole: LINE: a supervisor already runs
this line (pid P)` (or, a moment later, `LINE/supervisor.out: the supervisor did not start: ...`) and
exited 1, "0 of 1 lost line(s) resumed", for a line that was running again."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engine.supervisor import lost
from nsconsole.cli import main

pytestmark = pytest.mark.usefixtures("private_host")  # conftest: an empty host.json, a private runtime dir

OTHER_SUPERVISOR = """
import fcntl, json, os, sys
import psutil
line = sys.argv[1]
fd = os.open(line, os.O_RDONLY | os.O_DIRECTORY)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a supervisor holds its line
me = psutil.Process()
record = {"pid": me.pid, "boot_start": me.create_time() - psutil.boot_time(), "started": me.create_time(),
          "state": "training", "engine": "auto", "stop_at": None}
with open(os.path.join(line, "supervisor.json"), "w") as file:
    json.dump(record, file)
print(me.pid, flush=True)
sys.stdin.read()  # until the test lets go
"""


def dead_pid() -> int:
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(finished.stdout)


def test_a_line_the_other_resume_started_meanwhile_is_left_to_it(
    tmp_path: Path, private_host: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    work_root = tmp_path / "lines"
    line = work_root / "trunk"
    line.mkdir(parents=True)
    private_host.write_text(json.dumps({"work_root": str(work_root)}))
    (line / "run.json").write_text("{}")
    (line / "supervisor.json").write_text(json.dumps(
        {"pid": dead_pid(), "started": 1000.0, "state": "training", "engine": "auto", "stop_at": None}))

    others: list[subprocess.Popen[str]] = []
    judge = lost.lost_line

    def judged_then_taken(path: Path | str) -> Any:
        """The race: this resume judges the line lost, then the other resume's supervisor takes it."""
        found = judge(path)
        if found is not None and not others:
            others.append(subprocess.Popen([sys.executable, "-c", OTHER_SUPERVISOR, str(line)],
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
            assert others[0].stdout is not None
            others[0].stdout.readline()  # it holds the line and has written its record
        return found

    monkeypatch.setattr(lost, "lost_line", judged_then_taken)
    try:
        status = main(["resume"])
        other_pid = others[0].pid
        record = json.loads((line / "supervisor.json").read_text())
    finally:
        for process in others:
            process.communicate("")  # stdin closed: it exits
    captured = capsys.readouterr()
    assert captured.err == ""
    assert captured.out.splitlines()[1:] == [
        f"{line}: left alone, another process started it meanwhile: a supervisor already runs this line "
        f"(pid {other_pid})"
    ]
    assert status == 0
    assert record["pid"] == other_pid  # the other supervisor's record, untouched
