"""`nsconsole status LINE`'s exit status tells a script or a cron job a line that needs its operator
(failed, stuck, disk full, its supervisor lost: 3) from one that does not (running, finished,
stopped on request, never run: 0), as `systemctl status` does, without reading the report; an
invalid run.json stays 1 and a refusal 2. Each is run as the command a cron job runs, on a real
line in that state, and the report it prints is the report whatever the status."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from helpers.lines import data_template_fixture, make_line
from test_status_state import dead_pid, write_supervisor

from engine.ops.status import line_status
from engine.process_start import started_since_boot
from engine.protocol.facts import FAULT_LINE_STATES, FINAL_LINE_STATES, LineState, StatusExitCode
from engine.rows import Heartbeat
from nsconsole.commands.status import DESCRIPTION, format_status

pytestmark = pytest.mark.usefixtures("private_host")  # conftest: an empty host.json of the test's own

data_template = data_template_fixture(prepare=0)


@pytest.fixture
def line(tmp_path: Path, data_template: Path) -> Path:
    """A real training line (status only reads, so the shared data line serves every test)."""
    return make_line(tmp_path, data_template)


def status_exit(line: Path) -> int:
    """`nsconsole status LINE` in a process of its own: its exit status, once its stdout is checked
    to be the report (the status changes nothing the command prints)."""
    shown = subprocess.run([sys.executable, "-m", "nsconsole", "status", str(line)],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert shown.stderr == ""
    report = "".join(text + "\n" for text in format_status(line_status(line)))
    assert without_moving_figures(shown.stdout) == without_moving_figures(report)
    return shown.returncode


def without_moving_figures(report: str) -> str:
    """The report with the figures that move between the two reads left out: the disk's free space
    (other tests write to that disk; CI saw 76.0 and 76.1 GiB) and the heartbeat's age (CI saw the
    command's read "0 s ago" and the test's, a second later, "1 s ago")."""
    report = re.sub(r"[\d.]+ [KMGT]?i?B free on its disk", "N free on its disk", report)
    return re.sub(r"\b\d+ s ago", "N s ago", report)


def running_supervisor(line: Path, state: str) -> None:
    """supervisor.json in `state`, naming a supervisor that runs (this test's process)."""
    me = psutil.Process()
    write_supervisor(line, state=state, pid=me.pid, boot_start=started_since_boot(me))


def test_a_line_never_run_is_fine(line: Path) -> None:
    assert status_exit(line) == StatusExitCode.OK


def test_a_running_line_is_fine_whatever_it_does_or_waits_for(line: Path) -> None:
    for state in LineState:
        if state not in FINAL_LINE_STATES:
            running_supervisor(line, state)
            assert status_exit(line) == StatusExitCode.OK, state


def test_a_line_ended_as_asked_is_fine(line: Path) -> None:
    for state in (LineState.FINISHED, LineState.STOPPED):
        write_supervisor(line, state=state, pid=dead_pid())
        assert status_exit(line) == StatusExitCode.OK, state


def test_a_failed_stuck_or_disk_full_line_needs_its_operator(line: Path) -> None:
    for state in FAULT_LINE_STATES:
        event = {"event": str(state), "message": "it ended"}
        write_supervisor(line, state=state, pid=dead_pid(), last_event=event)
        assert status_exit(line) == StatusExitCode.NEEDS_OPERATOR, state
    # Its supervisor still runs for a moment after saving the state: the line has failed all the same.
    running_supervisor(line, LineState.FAILED)
    assert status_exit(line) == StatusExitCode.NEEDS_OPERATOR


def test_a_line_whose_supervisor_is_lost_needs_its_operator(line: Path) -> None:
    write_supervisor(line, state=LineState.TRAINING, pid=dead_pid())  # killed, or the host rebooted
    assert status_exit(line) == StatusExitCode.NEEDS_OPERATOR


def test_a_line_a_trainer_runs_without_a_supervisor_is_fine(line: Path) -> None:
    # This process beats as the trainer (`run --no-supervisor`, or an orphan finishing its checkpoint).
    Heartbeat(line / "heartbeat").beat(16, "training", cycle=0)
    for state in (LineState.TRAINING, LineState.FAILED):  # its supervisor lost, or a failed line run again
        write_supervisor(line, state=state, pid=dead_pid())
        assert status_exit(line) == StatusExitCode.OK, state
    # Once that trainer has said it stopped, the lost supervisor's line needs its operator again.
    Heartbeat(line / "heartbeat").beat(16, "stopped", reason="stop requested")
    write_supervisor(line, state=LineState.TRAINING, pid=dead_pid())
    assert status_exit(line) == StatusExitCode.NEEDS_OPERATOR


def test_an_invalid_run_json_is_1_whatever_the_state_and_no_line_is_2(line: Path, tmp_path: Path) -> None:
    (line / "run.json").write_text('{"model": {"preset": "no-such-preset"}}')
    assert status_exit(line) == StatusExitCode.INVALID_RUN_JSON
    running_supervisor(line, LineState.TRAINING)
    assert status_exit(line) == StatusExitCode.INVALID_RUN_JSON
    write_supervisor(line, state=LineState.FAILED, pid=dead_pid())
    assert status_exit(line) == StatusExitCode.INVALID_RUN_JSON
    refused = subprocess.run([sys.executable, "-m", "nsconsole", "status", str(tmp_path / "none")],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert refused.returncode == StatusExitCode.USER_ERROR and refused.stdout == ""
    assert refused.stderr == f"nsconsole: {tmp_path / 'none'}: no such training line directory\n"


def test_the_help_lists_every_exit_status() -> None:
    assert all(f"\n  {code.value}  " in DESCRIPTION for code in StatusExitCode)
