"""`nsconsole status LINE` when the line's data preparer stopped for good: the report says why and
what to do; the exit status is 3 (needs its operator) once the trainer waits for the data that no
preparer will make, 0 while it still trains the cycles prepared, or when a preparer runs again."""

from __future__ import annotations

import json
import time
from pathlib import Path

import psutil
import pytest
from helpers.supervise import this_process_as_trainer

from datalines.service import PREPARING, PreparerLock
from engine.process_start import started_since_boot
from engine.protocol.facts import StatusExitCode
from nsconsole.cli import main

pytestmark = pytest.mark.usefixtures("private_host")

REASON = "/corpus/part3.jsonl: source text file is gone since init"
FIX = "restore /corpus/part3.jsonl as `data init` pinned it (1,234 bytes, sha256 0123456789ab...)"


def beat(line: Path, stage: str, **extra: object) -> None:
    (line / "heartbeat").write_text(json.dumps({"time": time.time(), "update": 40, "stage": stage,
                                                **this_process_as_trainer(), **extra}))  # fmt: skip


def test_a_line_waiting_for_data_that_will_not_come_needs_its_operator(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line, data = tmp_path / "line", tmp_path / "line" / "d"
    data.mkdir(parents=True)
    (line / "run.json").write_text(json.dumps({"model": {"preset": "transformer-tiny"}, "data": {"line": "d"}}))
    me = psutil.Process()
    (line / "supervisor.json").write_text(json.dumps({"state": "training", "pid": me.pid,
                                                      "boot_start": started_since_boot(me)}))  # fmt: skip
    (data / "preparer.json").write_text(json.dumps({"state": "failed", "pid": 4242, "last_error": REASON, "fix": FIX,
                                                    "message": f"{REASON}; {FIX}"}))  # fmt: skip
    problem = f"problem: data preparer of {data} stopped for good (pid 4242): {REASON}; {FIX}"

    beat(line, "training", cycle=2)  # the cycles prepared before it: the line trains on
    assert main(["status", str(line)]) == StatusExitCode.OK
    assert f"{problem}\n" in capsys.readouterr().out

    beat(line, "waiting-data", cycle=3)
    assert main(["status", str(line)]) == StatusExitCode.NEEDS_OPERATOR
    assert f"{problem}; the trainer waits for data cycle 3, which no preparer will make\n" in capsys.readouterr().out

    with PreparerLock(data, PREPARING):  # a preparer runs again (started by hand): it prepares cycle 3
        assert main(["status", str(line)]) == StatusExitCode.OK
        assert "stopped for good" not in capsys.readouterr().out
