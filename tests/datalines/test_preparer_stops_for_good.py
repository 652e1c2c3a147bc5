"""`nsconsole data run-preparer` on a failure that does not pass by itself (a pinned file changed, a
dataline.json that no longer parses): exit 78 with its reason and fix in one line, the same in
preparer.json and `data status`; once the cause is fixed, the next run goes on. Failures that may
pass are not such failures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.lines import make_data_line, make_line

from datalines import open_data_line
from datalines.errors import DataLineError, InputChanged, SourceExhausted, SourceUnavailable
from datalines.service import NoDataLine, PreparerLockHeld, stops_for_good
from datalines.status import read_status
from engine.protocol.facts import PreparerExitCode
from nsconsole.cli import main


def run_preparer(data: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "nsconsole", "data", "run-preparer", "--work", str(data), "--ahead", "2", "--once"]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def test_a_changed_pinned_file_stops_the_preparer_for_good_until_it_is_restored(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = make_data_line(tmp_path, prepare=1, validation=())
    originals = {path: path.read_bytes() for path in sorted((tmp_path / "corpus").glob("*.jsonl"))}
    for path, content in originals.items():  # the same size, other bytes: only the sha256 tells
        path.write_bytes(content.replace(b"the", b"THE", 1))

    result = run_preparer(data)
    assert result.returncode == PreparerExitCode.STOPPED_FOR_GOOD == 78, result.stderr
    [message] = result.stderr.splitlines()
    assert message.startswith(f"nsconsole: {tmp_path / 'corpus'}/part") and "changed since init" in message
    assert "; restore " in message and "as `data init` pinned it" in message
    status = read_status(data)[0]
    assert status["state"] == "failed" and "changed since init" in status["last_error"]
    assert status["fix"].startswith(f"restore {tmp_path / 'corpus'}/part")
    assert main(["data", "status", "--work", str(data)]) == 3  # the operator must act
    shown = capsys.readouterr().out
    assert f"preparer: stopped for good (pid {status['pid']}), not retried: {status['last_error']}; " in shown
    assert f"to go on: {status['fix']}; then the supervisor of the line that trains on it starts it again" in shown
    assert main(["data", "status", "--work", str(data), "--json"]) == 3
    assert json.loads(capsys.readouterr().out)["preparer"]["fix"] == status["fix"]

    for path, content in originals.items():
        path.write_bytes(content)
    result = run_preparer(data)
    assert result.returncode == 0, result.stderr
    assert read_status(data)[0]["state"] == "ready" and open_data_line(data).cycle_ready(1)


def test_check_warns_of_a_cycle_that_a_preparer_stopped_for_good_does_not_make(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `check` said "ok: current data cycle: 0 not prepared yet (the preparer makes it)", while
    # `data status` exited 3: no preparer makes it until the operator acts.
    data = make_data_line(tmp_path, prepare=0)
    line = make_line(tmp_path, data)
    capsys.readouterr()
    assert main(["check", str(line)]) == 0
    assert "ok: current data cycle: 0 not prepared yet (the preparer makes it)" in capsys.readouterr().out.splitlines()

    part = tmp_path / "corpus" / "part0.jsonl"
    original = part.read_bytes()
    part.write_bytes(original.replace(b"the", b"THE", 1))
    assert run_preparer(data).returncode == PreparerExitCode.STOPPED_FOR_GOOD
    status = read_status(data)[0]
    assert main(["check", str(line)]) == 1  # the changed file fails its own check; the cycle is a warning
    assert (
        f"warn: current data cycle: 0 not prepared yet, and the data preparer stopped for good: {status['last_error']}; "
        f"to go on: {status['fix']} (the line waits for the cycle until then)"
    ) in capsys.readouterr().out.splitlines()


def test_a_dataline_json_that_no_longer_parses_is_recorded_and_stops_the_preparer(tmp_path: Path) -> None:
    data = make_data_line(tmp_path, prepare=1, validation=())
    config = data / "dataline.json"
    original = config.read_bytes()
    config.write_bytes(original.replace(b'"schedule"', b'"schedule_"', 1))  # a recipe without its schedule

    result = run_preparer(data)
    assert result.returncode == 78, result.stderr
    [message] = result.stderr.splitlines()
    assert message.startswith(f"nsconsole: {config}: ") and f"; restore {config} as it was" in message
    status = read_status(data)[0]  # recorded although the line did not open
    assert status["state"] == "failed" and status["last_error"].startswith(f"{config}: ")
    assert status["fix"].startswith(f"restore {config} as it was")

    config.write_bytes(original)
    assert run_preparer(data).returncode == 0
    assert read_status(data)[0]["state"] == "ready"


def test_a_directory_that_is_no_data_line_is_refused_without_a_status(tmp_path: Path) -> None:
    result = run_preparer(tmp_path)
    assert result.returncode == 2 and "dataline.json: no such file" in result.stderr
    assert not (tmp_path / "preparer.json").exists()


def test_which_failures_stop_the_preparer_for_good() -> None:
    assert stops_for_good(SourceExhausted("source web has no untrained documents left for cycle 3"))
    assert stops_for_good(InputChanged("a.jsonl: source web file is gone since init", "restore a.jsonl"))
    assert stops_for_good(DataLineError("dataline.json: not valid JSON"))
    assert not stops_for_good(SourceUnavailable("source web: the hub is unreachable"))  # retried with backoff
    assert not stops_for_good(PreparerLockHeld("preparer.lock: another preparer runs", "preparer"))
    assert not stops_for_good(NoDataLine("lines/x/dataline.json: no such file"))  # a disk not mounted yet
    assert not stops_for_good(OSError(28, "No space left on device"))  # a full disk: retried
