"""One trainer per line: a second trainer, or a supervisor-less trainer beside a supervisor, is refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers.lines import copy_data_line, data_template_fixture, make_line

from engine.errors import LineError
from engine.layout import LineLayout
from engine.supervisor.reads import lock_line
from engine.training.line_lock import hold_trainer_lock
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
    supervisor_hold = lock_line(LineLayout(line))  # as a running supervisor holds the line
    try:
        assert main(["run", str(line), "--no-supervisor", "--stop-at", "2"]) == 2
    finally:
        os.close(supervisor_hold)
    assert "its supervisor is running" in capsys.readouterr().err
    assert not (line / "rows.jsonl").exists()
    assert main(["run", str(line), "--no-supervisor", "--stop-at", "2"]) == 0
