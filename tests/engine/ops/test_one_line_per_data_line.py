"""One training line per data line, from the command line: the first line that starts on a data
line trains on it alone. A second line made on it (before or after) is refused by `check`, by its
trainer's start (with or without a supervisor) and by `new` while the first is still in its first
cycle, when no cycle is consumed yet; a line whose directory was deleted gives the data line up.

(Before, two lines trained on cycle 0 at once: the guard saw only cycles marked consumed at their end.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers.lines import SEQ_LEN, TOKENS_PER_UPDATE, copy_data_line, data_template_fixture, make_line
from helpers.supervise import kill_line_processes

from datalines.dataline import CONSUMED_MARK, TRAINING_LINE_RECORD
from engine.supervisor import registry
from engine.training.trainer import Trainer
from nsconsole.cli import main

pytestmark = pytest.mark.usefixtures("one_thread", "private_host")

data_template = data_template_fixture(prepare=1)
"""Cycle 0 prepared (5,000 tokens, about 10 updates): the lines here stay inside it."""


@pytest.fixture
def lines(tmp_path: Path, data_template: Path) -> tuple[Path, Path, Path]:
    """(data line D, line A, line B): both lines made on D while it was fresh."""
    data = copy_data_line(data_template, tmp_path)
    return data, make_line(tmp_path / "a", data), make_line(tmp_path / "b", data)


def new(tmp_path: Path, data: Path) -> int:
    """`nsconsole new tmp_path/c --data DATA`."""
    return main(["new", str(tmp_path / "c"), "--model", "transformer-tiny", "--data", str(data),
                 "--seq-len", str(SEQ_LEN), "--tokens-per-update", str(TOKENS_PER_UPDATE)])  # fmt: skip


def trained_by(data: Path) -> str:
    return json.loads((data / TRAINING_LINE_RECORD).read_text())["line"]


def refusal(data: Path, owner: Path, what: str) -> str:
    return (
        f"{data}: trained by {owner}, the first line that started on it; a data line is trained by one line, "
        f"so {what} cannot train on it; make an identical data line with "
        f"`nsconsole data init --work DIR --like {data}` and train on DIR"
    )


def test_a_second_line_is_refused_while_the_first_trains_its_first_cycle(
    tmp_path: Path, lines: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    data, a, b = lines
    assert main(["check", str(b)]) == 0  # before A starts, B could take D as well
    assert Trainer(a, stop_at=2, echo=None).run() == 0
    assert trained_by(data) == str(a.absolute())
    assert not list(data.glob(f"cycles/*/{CONSUMED_MARK}"))  # A is in cycle 0: nothing consumed yet
    capsys.readouterr()

    assert main(["check", str(b)]) == 1
    failed = [text for text in capsys.readouterr().out.splitlines() if not text.startswith(("ok: ", "warn: "))]
    assert failed == [f"FAIL: {refusal(data, a.absolute(), str(b.absolute()))}"]

    # The trainer's own start refuses it (without a supervisor nothing else checks first) ...
    assert main(["run", str(b), "--no-supervisor"]) == 2
    assert capsys.readouterr().err == f"nsconsole: {refusal(data, a.absolute(), str(b.absolute()))}\n"
    # ... and so does `run`'s start check, before a supervisor is started.
    try:
        assert main(["run", str(b)]) == 2
    finally:
        kill_line_processes(tmp_path)
    error = capsys.readouterr().err
    assert error.startswith(f"nsconsole: {b}: not started, a start check fails: ") and error.count("\n") == 1
    assert refusal(data, a.absolute(), str(b.absolute())) in error
    assert registry.find_supervisor(b) is None
    assert not (b / "rows.jsonl").exists()
    assert list((b / "checkpoints").iterdir()) == []

    assert new(tmp_path, data) == 2
    assert capsys.readouterr().err == f"nsconsole: {refusal(data, a.absolute(), 'a new line')}\n"
    assert not (tmp_path / "c").exists()
    assert trained_by(data) == str(a.absolute())

    # A itself goes on (a resume of the line that owns D).
    assert main(["run", str(a), "--no-supervisor", "--stop-at", "4"]) == 0
    assert main(["check", str(a)]) == 0
    assert f"ok: data owner: this line trains on {data}" in capsys.readouterr().out


def test_a_line_takes_over_the_data_line_of_a_deleted_line(
    tmp_path: Path, lines: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    data, a, b = lines
    assert Trainer(a, stop_at=2, echo=None).run() == 0
    shutil.rmtree(a)  # its user deletes line A
    capsys.readouterr()
    assert main(["check", str(b)]) == 0
    gone = f"{a.absolute()}, the line that trained on {data}, no longer does; this line's start takes it over"
    assert f"ok: data owner: {gone}" in capsys.readouterr().out
    assert main(["run", str(b), "--no-supervisor", "--stop-at", "2"]) == 0
    assert trained_by(data) == str(b.absolute())
    taken_over = (
        f"{data}: {a.absolute()}, the line that trained on it, no longer does (deleted, or its run.json names "
        "another data line); this line takes it over"
    )
    assert taken_over in (b / "run.log").read_text()
    capsys.readouterr()
    assert new(tmp_path, data) == 2  # D is B's now
    assert capsys.readouterr().err == f"nsconsole: {refusal(data, b.absolute(), 'a new line')}\n"


def test_the_cycles_a_deleted_line_consumed_stay_refused(
    tmp_path: Path, lines: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    data, a, b = lines
    (a / "STOP").write_text(json.dumps({"requested": "now", "at_cycle_end": 0}))
    assert Trainer(a, echo=None).run() == 0
    shutil.rmtree(a)
    capsys.readouterr()
    assert main(["check", str(b)]) == 1
    [failed] = [text for text in capsys.readouterr().out.splitlines() if text.startswith("FAIL: ")]
    assert failed.startswith(f"FAIL: {data}: cycle 0 already consumed by {a.absolute()}; ")
    assert new(tmp_path, data) == 2
    assert f"{data}: cycle 0 already consumed by {a.absolute()}; " in capsys.readouterr().err
    assert main(["run", str(b), "--no-supervisor"]) == 2
    assert f"{data}: cycle 0 already consumed by {a.absolute()}; " in capsys.readouterr().err
