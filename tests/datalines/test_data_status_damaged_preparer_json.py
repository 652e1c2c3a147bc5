"""`nsconsole data status` of a data line whose preparer.json is damaged (cut short, not JSON, JSON
that is no preparer's status): it still shows the cycles and validation rows, and names the file
and its damage in one line. It refused the whole report (exit 2) for a file that was not JSON, and
crashed with a traceback on one that was JSON but no object."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.lines import make_data_line

from datalines import open_data_line
from datalines.service import run_preparer
from nsconsole.cli import main


@pytest.fixture(scope="module")
def data_line(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data line with its validation rows and a preparer.json its preparer wrote (`--once`: it exited)."""
    path = make_data_line(tmp_path_factory.mktemp("data"), prepare=1)
    assert run_preparer(open_data_line(path), ahead=1, once=True).state == "ready"
    return path


def cut_short(text: str) -> str:
    """The file cut within its state's value (a write that stopped there)."""
    return text[: text.index('"ready"') + 3]


DAMAGES = {
    "cut short": (cut_short, "not valid JSON (Unterminated string"),
    "not JSON": (lambda text: "preparer status\n", "not valid JSON (Expecting value: line 1 column 1 (char 0))"),
    "a JSON array": (lambda text: "[1, 2]", "not a preparer status (not a JSON object)"),
    "an object without a state": (lambda text: "{}", "not a preparer status (no `state`)"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_preparer_json_is_named_and_the_rest_shown(
    data_line: Path, damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status_file = data_line / "preparer.json"
    written = status_file.read_text()
    damaged, reason = DAMAGES[damage]
    status_file.write_text(damaged(written))
    try:
        assert main(["data", "status", "--work", str(data_line)]) == 0  # no cycle is damaged
        captured = capsys.readouterr()
        assert captured.err == ""
        out = captured.out.splitlines()
        assert "  cycle    0  ready" in out
        assert "validation rows: T32, T64" in out
        [preparer] = [text for text in out if text.startswith("preparer:")]
        assert preparer.startswith(f"preparer: state unknown: {status_file}: {reason}")
        assert preparer.endswith("; no preparer runs now")

        assert main(["data", "status", "--work", str(data_line), "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["cycles"]["0"] == "ready"
        assert report["preparer"] is None
        assert report["preparer_problem"].startswith(f"{status_file}: {reason}")
        assert status_file.read_text() == damaged(written)  # only read: left as it was found
    finally:
        status_file.write_text(written)
