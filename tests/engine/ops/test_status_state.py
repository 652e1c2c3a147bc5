"""`nsconsole status LINE` says the line's state near the top (supervisor.json's state, whether its
supervisor runs now), the branches queued on it and, for a branch, its parent: a failed or
disk-full line no longer looks like one stopped on purpose (found in a fault walkthrough)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import psutil
import pytest
from helpers.lines import make_data_line, make_line, one_torch_thread

from engine.checkpoints.format import BRANCH_START_KEPT
from engine.ops.status import line_status
from engine.process_start import started_since_boot
from engine.protocol.facts import StatusExitCode
from engine.training.trainer import Trainer
from nsconsole.cli import main
from nsconsole.commands.status import format_status

FAILED = "5 failures in a row without progress; the line stops (last exit: killed by SIGKILL)"


@pytest.fixture
def line(tmp_path: Path) -> Path:
    root = tmp_path / "line"
    root.mkdir()
    (root / "run.json").write_text(json.dumps({"model": {"preset": "transformer-tiny"}, "data": {"line": "d"}}))
    return root


def write_supervisor(line: Path, **fields: Any) -> None:
    (line / "supervisor.json").write_text(json.dumps(fields))


def dead_pid() -> int:
    """A pid no process has now (the next ones after ours are not taken yet, most likely)."""
    pid = os.getpid() + 100_000
    while psutil.pid_exists(pid):
        pid += 1
    return pid


def printed(line: Path) -> list[str]:
    return format_status(line_status(line))


def test_a_failed_line_says_failed_with_its_failures_and_last_event(line: Path) -> None:
    write_supervisor(line, state="failed", pid=dead_pid(), failures_in_a_row=5,
                     last_event={"event": "failed", "message": FAILED})  # fmt: skip
    shown = printed(line)
    assert shown[1] == f"state: failed (5 failures in a row; last: {FAILED})"
    write_supervisor(line, state="failed", pid=dead_pid(), failures_in_a_row=1)  # a lifelong key changed, say
    assert printed(line)[1] == "state: failed (1 failure in a row)"


def test_a_disk_full_line_says_so_with_the_trainer_s_line(line: Path) -> None:
    message = f"{line}: 0.03 GiB free on its disk, too little for the next checkpoint"
    write_supervisor(line, state="disk-full", pid=dead_pid(), last_event={"event": "disk_full", "message": message})
    assert printed(line)[1] == f"state: disk-full (last: {message})"


def test_a_clean_stop_and_a_finish_say_only_the_state(line: Path) -> None:
    write_supervisor(line, state="stopped", pid=dead_pid(), last_event={"event": "crashed", "message": "old"})
    assert printed(line)[1] == "state: stopped"
    write_supervisor(line, state="finished", pid=dead_pid())
    assert printed(line)[1] == "state: finished"


def test_a_running_supervisor_is_named_by_its_pid(line: Path) -> None:
    me = psutil.Process()
    write_supervisor(line, state="training", pid=me.pid, boot_start=started_since_boot(me))
    assert printed(line)[1] == f"state: training (supervisor pid {me.pid})"


def test_a_supervisor_gone_without_a_final_state_is_lost(line: Path) -> None:
    write_supervisor(line, state="training", pid=dead_pid())
    assert printed(line)[1] == "state: supervisor lost (it was training; its process runs no more)"
    # A live pid that another process took over (it started at another time) is not the supervisor.
    me = psutil.Process()
    write_supervisor(line, state="training", pid=me.pid, boot_start=started_since_boot(me) - 3600)
    assert printed(line)[1] == "state: supervisor lost (it was training; its process runs no more)"


def test_a_line_no_supervisor_ran_says_so(line: Path) -> None:
    assert printed(line)[1] == "state: no supervisor has run this line (no supervisor.json)"


def test_queued_branches_and_the_parent_are_listed(line: Path, tmp_path: Path) -> None:
    queued = [{"path": str(tmp_path / "b0"), "at_cycle": 0, "plan": "decay:1000", "data": "/d0"},
              {"path": str(tmp_path / "b1"), "at_cycle": 2, "plan": "decay:1000", "data": "/d1"},
              {"not": "a fork"}]  # fmt: skip
    write_supervisor(line, state="stopped", pid=dead_pid(), queued_forks=queued)
    # A branch's first checkpoint records where it was forked from (engine.ops.branch writes it).
    start = line / "checkpoints" / "u00000244"
    start.mkdir(parents=True)
    (start / "state.json").write_text(json.dumps({"kept": BRANCH_START_KEPT, "branched_from": {"line": "/trunk"}}))
    status = line_status(line)
    assert status.parent == "/trunk"
    assert [fork["path"] for fork in status.queued_forks] == [str(tmp_path / "b0"), str(tmp_path / "b1")]
    shown = format_status(status)
    assert shown[1:4] == [
        "state: stopped",
        "branch of: /trunk",
        f"queued branches: {tmp_path / 'b0'} at the end of cycle 0, {tmp_path / 'b1'} at the end of cycle 2",
    ]


def test_the_branches_forked_from_a_line_are_listed(line: Path, tmp_path: Path) -> None:
    # Found in a branch walkthrough: status showed queued branches and the parent, not the
    # branches already forked. A branch deleted since is not listed.
    for name in ("b1", "b2"):
        (tmp_path / name).mkdir()
    (tmp_path / "b1" / "run.json").write_text("{}")
    records = [{"line": str(tmp_path / "b1"), "at_cycle": 1, "at_update": 24},
               {"line": str(tmp_path / "b2"), "at_cycle": 2, "at_update": 48}]  # fmt: skip
    (line / "branches.json").write_text(json.dumps({"branches": records}))
    write_supervisor(line, state="stopped", pid=dead_pid())
    assert format_status(line_status(line))[1:3] == [
        "state: stopped", f"branches: {tmp_path / 'b1'} (cycle 1, update 24)",
    ]


@pytest.mark.usefixtures("private_host")
def test_the_command_prints_the_state_second(line: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_supervisor(line, state="failed", pid=dead_pid(), failures_in_a_row=5,
                     last_event={"event": "failed", "message": FAILED})  # fmt: skip
    assert main(["status", str(line)]) == StatusExitCode.NEEDS_OPERATOR  # a failed line (test_status_exit)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"line: {line}" and out[1].startswith("state: failed (5 failures in a row; ")


@pytest.mark.parametrize(("text", "words"), [("{garbage\n", "not JSON ("), ("[1]\n", "not a JSON object")])
def test_a_damaged_supervisor_json_leaves_the_state_unknown_and_is_named(
    line: Path, capsys: pytest.CaptureFixture[str], text: str, words: str
) -> None:
    # Before: "state: no supervisor has run this line (no supervisor.json)", exit 0 (and for `[1]` no problem).
    (line / "supervisor.json").write_text(text)
    assert main(["status", str(line)]) == StatusExitCode.NEEDS_OPERATOR  # its operator must mend it
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "state: unknown"
    problems = [shown for shown in out if shown.startswith("problem: ")]
    assert len(problems) == 1 and problems[0].startswith(f"problem: {line}/supervisor.json: {words}")
    assert problems[0].endswith("; the line's state is unknown")
    assert (line / "supervisor.json").read_text() == text


def test_a_line_a_trainer_finished_without_a_supervisor_says_finished(tmp_path: Path) -> None:
    """A line stopped under its supervisor, then trained to its plan's end by `run --no-supervisor`:
    supervisor.json still says stopped (no supervisor saw the end), so status said `stopped`. Its
    latest checkpoint stands at the end: finished, with why and what supervisor.json holds, and
    nothing for the operator (exit 0). A failed record is history the same way."""
    plan = [{"name": "trunk", "seq_len": 32, "tokens": 4 * 512}]
    line = make_line(tmp_path, make_data_line(tmp_path / "making", prepare=1), plan=plan)
    assert printed(line)[1] == "state: no supervisor has run this line (no supervisor.json)"
    with one_torch_thread():
        assert Trainer(line, echo=None).run() == 0  # four updates: the plan's end
    assert printed(line)[1] == (
        "state: finished (the plan is complete; by a trainer without a supervisor, no supervisor.json)"
    )
    for state in ("stopped", "failed"):
        write_supervisor(line, state=state, pid=dead_pid(), failures_in_a_row=2)
        assert printed(line)[1] == (
            f"state: finished (the plan is complete; by a trainer without a supervisor, supervisor.json says {state})"
        )
        assert main(["status", str(line)]) == StatusExitCode.OK
    # A lost supervisor's line stays lost: `nsconsole resume` records its end and sends its notification.
    write_supervisor(line, state="training", pid=dead_pid())
    assert printed(line)[1] == "state: supervisor lost (it was training; its process runs no more)"
