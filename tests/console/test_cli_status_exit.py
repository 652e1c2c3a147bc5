"""`nsconsole status LINE` exits 1 when the line's run.json is invalid, as `data status` does when it
reports damage: a script or a cron job sees the problem without parsing the report, which is
printed in full all the same."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nsconsole.cli import main

pytestmark = pytest.mark.usefixtures("private_host")


def test_status_of_a_line_whose_run_json_is_invalid_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    line = tmp_path / "line"
    line.mkdir()
    (line / "run.json").write_text(json.dumps({"model": {"preset": "transformer-tiny"}, "data": {"line": "d"}}))
    assert main(["status", str(line)]) == 0
    capsys.readouterr()
    (line / "run.json").write_text('{"model": ')  # cut short
    assert main(["status", str(line)]) == 1
    out = capsys.readouterr().out.splitlines()
    [invalid] = [text for text in out if text.startswith("run.json: INVALID: ")]
    assert str(line / "run.json") in invalid
    assert out[0] == f"line: {line}" and out[-1].startswith("disk: ")  # the rest of the report is there
