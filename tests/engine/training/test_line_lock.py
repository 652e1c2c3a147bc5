"""One trainer per line: a second trainer, a supervisor-less trainer beside a supervisor, or a
supervisor beside a supervisor-less trainer, is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.lines import copy_data_line, data_template_fixture, make_data_line, make_line
from helpers.supervise import kill_line_processes

from engine.errors import LineError
from engine.layout import LineLayout
from engine.training.line_lock import hold_line, hold_trainer_lock
from engine.training.trainer import Trainer
from nsconsole.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

data_template = data_template_fixture()


@pytest.fixture
def line(tmp_path: Path, data_template: Path) -> Path:
    return make_line(tmp_path, copy_data_line(data_template, tmp_path))


def test_a_second_trainer_of_a_line_is_refused_and_writes_nothing(line: Path) -> None:
    assert Trainer(line, stop_at=2, echo=None).run() == 0
    rows = (line / "rows.jsonl").read_bytes()
    held = hold_trainer_lock(LineLayout(line))  # as the line's running trainer holds it
    try:
        with pytest.raises(LineError, match="another trainer is training this line"):
            Trainer(line, stop_at=4, echo=None).run()
    finally:
        os.close(held)
    assert (line / "rows.jsonl").read_bytes() == rows
    assert Trainer(line, stop_at=4, echo=None).run() == 0  # the lock goes with its holder


def test_no_supervisor_beside_a_running_supervisor_is_refused(
    line: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    supervisor_hold = hold_line(LineLayout(line))  # as a running supervisor holds the line
    (line / "supervisor.json").write_text(json.dumps({"pid": os.getpid(), "state": "training"}))
    try:
        assert main(["run", str(line), "--no-supervisor", "--stop-at", "2"]) == 2
    finally:
        os.close(supervisor_hold)
    assert f"a supervisor already runs this line (pid {os.getpid()})" in capsys.readouterr().err
    supervisor_hold = hold_line(LineLayout(line))  # a rollback goes through a running supervisor
    try:
        assert main(["rollback", str(line), "--to", "0"]) == 2
    finally:
        os.close(supervisor_hold)
    assert capsys.readouterr().err.rstrip().endswith("roll it back from the console (r), or stop the line first")
    assert not (line / "rows.jsonl").exists()
    assert main(["run", str(line), "--no-supervisor", "--stop-at", "2"]) == 0


def test_a_rollback_beside_a_trainer_without_a_supervisor_points_to_no_console(
    line: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The console's r goes through a supervisor: a trainer run without one is stopped first, and
    the refusal says only that (it used to add "roll it back from the console (r)", which cannot)."""
    trainer_hold = hold_line(LineLayout(line))  # as `nsconsole run LINE --no-supervisor` holds it
    (line / "heartbeat").write_text(json.dumps({"pid": os.getpid(), "stage": "training", "update": 3}))
    try:
        assert main(["rollback", str(line), "--to", "0"]) == 2
    finally:
        os.close(trainer_hold)
    error = capsys.readouterr().err
    assert error.count("\n") == 1, error
    assert error.rstrip().endswith(f"is running it (pid {os.getpid()}); stop it first (nsconsole stop {line})")
    assert "from the console" not in error


@pytest.mark.slow
def test_a_supervisor_beside_a_trainer_without_one_is_refused_and_leaves_it_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`nsconsole run LINE` (background or foreground) while `nsconsole run LINE --no-supervisor`
    trains it: refused in one line, and that trainer goes on (it used to be stopped with SIGTERM as
    an orphan, or to make the new supervisor fail and call the line failed)."""
    line = make_line(tmp_path, make_data_line(tmp_path / "data_root", prepare=1))  # it waits after cycle 0
    trainer = subprocess.Popen([sys.executable, "-m", "nsconsole", "run", str(line), "--no-supervisor"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while json.loads((line / "heartbeat").read_text() if (line / "heartbeat").exists() else "{}").get(
                "pid") != trainer.pid:
            assert trainer.poll() is None and time.monotonic() < deadline, trainer.stderr.read().decode()
            time.sleep(0.1)
        for argv in (["run", str(line)], ["run", str(line), "--foreground"], ["--run", str(line)]):
            assert main(argv) == 2
            error = capsys.readouterr().err
            assert error.count("\n") == 1, error
            assert f"a trainer started without a supervisor is running it (pid {trainer.pid}); stop it first" in error
        assert trainer.poll() is None and not (line / "supervisor.json").exists()
        assert main(["status", str(line)]) == 0  # it trains: status says so, not "stopped"
        assert f" with no supervisor (trainer pid {trainer.pid})" in capsys.readouterr().out
        assert main(["stop", str(line)]) == 0
        assert trainer.wait(timeout=120) == 0
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()


@pytest.mark.slow
def test_a_line_finished_after_run_looked_is_not_trained_again_by_the_supervisor(
    tmp_path: Path, private_host: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`nsconsole run LINE` looks whether the line has finished, then runs its start checks (seconds)
    and starts the supervisor. A trainer started without a supervisor that finishes the line in that
    window used to leave it to a supervisor that launched a trainer into a finished line: the
    supervisor decides again under the line's lock, and ends without a trainer or a record."""
    plan = [{"name": "trunk", "seq_len": 32, "tokens": 4 * 512}]
    line = make_line(tmp_path, make_data_line(tmp_path / "making", prepare=1), plan=plan)
    assert Trainer(line, stop_at=3, echo=None).run() == 0  # one update left in the plan

    def finish_the_line_meanwhile(root: Path) -> None:
        # The window between the finished check and the supervisor's lock (the start checks run here):
        # a trainer started without a supervisor, holding the line as it does, trains the last update.
        hold = hold_line(LineLayout(root))
        try:
            assert Trainer(root, echo=None).run() == 0
        finally:
            os.close(hold)

    monkeypatch.setattr("nsconsole.commands.run.refuse_a_failing_start", finish_the_line_meanwhile)
    try:
        assert main(["run", str(line)]) == 2
        rows = (line / "rows.jsonl").read_bytes()
        log = (line / "run.log").read_text()
    finally:
        left_running = kill_line_processes(tmp_path)
    error = capsys.readouterr().err
    assert error.count("\n") == 1, error
    assert "the supervisor did not start" in error and "the line has finished (the plan is complete" in error
    assert left_running == []
    assert rows == (line / "rows.jsonl").read_bytes()
    assert log == (line / "run.log").read_text() and "trainer launched" not in log
    assert not (line / "supervisor.json").exists()  # nothing recorded a supervisor's life
