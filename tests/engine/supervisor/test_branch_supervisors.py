"""The trunk's supervisor reaps every branch supervisor it started, one that did not answer in time too."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import pytest

from engine.supervisor import branch_supervisors
from engine.supervisor.branch_supervisors import BranchSupervisors
from engine.supervisor.settings import SupervisorSettings
from engine.supervisor.start import SupervisorSilent


def test_a_branch_supervisor_that_did_not_answer_in_time_is_reaped_when_it_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `start_detached` spawned a real child that then said nothing within the answer wait (a loaded
    # host): the child is this process's all the same. Before, its pid was dropped with the error,
    # and it stayed a zombie for the trunk's life once it exited.
    started: list[int] = []

    def silent_start(line: Path, settings: SupervisorSettings) -> int:
        pid = os.posix_spawn("/bin/sh", ["sh", "-c", "exit 0"], dict(os.environ))
        started.append(pid)
        raise SupervisorSilent(f"{line}/supervisor.out: the supervisor (pid {pid}) has not answered within 60 s", pid)

    monkeypatch.setattr(branch_supervisors, "start_detached", silent_start)
    supervisors = BranchSupervisors(engine="eager")
    why = supervisors.start(tmp_path / "branch")
    assert why is not None and "has not answered" in why
    (pid,) = started
    deadline = time.monotonic() + 30
    while psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the child did not exit"
        time.sleep(0.05)
    supervisors.reap()
    assert not psutil.pid_exists(pid)
