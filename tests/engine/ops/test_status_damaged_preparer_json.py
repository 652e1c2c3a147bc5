"""A damaged preparer.json (not JSON, or JSON that is no preparer's status) under `nsconsole status
LINE` and the supervisor's preparer keeper: named in one line, never taken for "no preparer has
run". JSON that was no object was skipped without a word by both."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers.lines import make_data_line, make_line

from engine.protocol.facts import StatusExitCode
from engine.supervisor.preparer import PreparerKeeper
from nsconsole.cli import main

pytestmark = pytest.mark.usefixtures("private_host")

DAMAGES = {
    "cut short": ('{"state": "rea', "not valid JSON (Unterminated string"),
    "a JSON array": ("[1, 2]", "not a preparer status (not a JSON object)"),
    "an object without a state": ('{"pid": 12}', "not a preparer status (no `state`)"),
}


@pytest.fixture(scope="module")
def data_line(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_data_line(tmp_path_factory.mktemp("data"), prepare=1, validation=())


@pytest.mark.parametrize("damage", DAMAGES)
def test_status_names_a_damaged_preparer_json_and_shows_the_rest(
    tmp_path: Path, data_line: Path, damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = make_line(tmp_path, data_line)
    text, reason = DAMAGES[damage]
    (data_line / "preparer.json").write_text(text)
    try:
        assert main(["status", str(line)]) == StatusExitCode.OK  # nothing runs the line: it rests
    finally:
        (data_line / "preparer.json").unlink()
    out = capsys.readouterr().out.splitlines()
    assert f"data: {data_line}" in out and "checkpoints: none yet" in out
    problems = [text for text in out if text.startswith("problem: data preparer")]
    assert len(problems) == 1 and problems[0].startswith(
        f"problem: data preparer: {data_line / 'preparer.json'}: {reason}"
    ), out


def test_the_supervisor_says_a_damaged_preparer_json_once_and_relays_it(tmp_path: Path, data_line: Path) -> None:
    said: list[str] = []
    sleeper = tmp_path / "preparer.py"  # a preparer's stand-in that runs and writes nothing
    sleeper.write_text("import time\ntime.sleep(60)\n")
    keeper = PreparerKeeper(data_line, say=said.append, notify_failing=said.append,
                            command=[sys.executable, str(sleeper)])  # fmt: skip
    status_file = data_line / "preparer.json"
    status_file.write_text("[1, 2]")
    problem = f"{status_file}: not a preparer status (not a JSON object)"
    try:
        for _ in range(3):  # its start, then two looks at the running preparer's status
            keeper.tick()
        assert said.count(f"the data preparer's state is unknown: {problem}") == 1, said
        snapshot = keeper.snapshot()
        assert snapshot["status"] is None and snapshot["status_problem"] == problem

        status_file.write_text('{"state": "ready", "pid": 1, "message": "cycles ready"}')
        assert keeper.snapshot()["status_problem"] is None
        assert keeper.snapshot()["status"]["state"] == "ready"
    finally:
        keeper.stop(timeout=5)
        status_file.unlink()


@pytest.fixture(scope="module")
def unprepared_data_line(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_data_line(tmp_path_factory.mktemp("unprepared"), prepare=0)


@pytest.mark.parametrize("damage", DAMAGES)
def test_check_reads_a_damaged_preparer_json_as_no_stop(
    tmp_path: Path, unprepared_data_line: Path, damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`nsconsole check` asks preparer.json whether the preparer stopped for good when the line's
    cycle is not prepared yet: not JSON was an error, a JSON array a traceback."""
    line = make_line(tmp_path, unprepared_data_line)
    (unprepared_data_line / "preparer.json").write_text(DAMAGES[damage][0])
    try:
        status = main(["check", str(line)])
    finally:
        (unprepared_data_line / "preparer.json").unlink()
    out = capsys.readouterr().out
    assert "current data cycle: 0 not prepared yet (the preparer makes it)" in out, out
    assert status == 0, out
