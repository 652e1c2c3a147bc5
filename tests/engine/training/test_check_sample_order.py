"""`nsconsole check` refuses what the trainer's resume refuses: a sample order changed under a
checkpoint inside a cycle (`seeds.data` changed with `allow_changes`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nsconsole.cli import main
from tests.helpers.lines import copy_data_line, data_template_fixture, make_line, one_torch_thread

data_template = data_template_fixture()


def test_check_fails_where_the_start_refuses_a_changed_sample_order(
    tmp_path: Path, data_template: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = make_line(tmp_path, copy_data_line(data_template, tmp_path))
    with one_torch_thread():
        assert main(["run", str(line), "--no-supervisor", "--stop-at", "7"]) == 0  # inside cycle 0
    assert main(["check", str(line)]) == 0
    document = json.loads((line / "run.json").read_text())
    document["seeds"]["data"] = 1
    document["allow_changes"] = ["seeds.data"]
    (line / "run.json").write_text(json.dumps(document))
    capsys.readouterr()
    assert main(["check", str(line)]) == 1
    out = capsys.readouterr().out
    assert "FAIL: current data cycle: 0's sample order at seq_len 32 differs" in out, out
    with one_torch_thread():
        assert main(["run", str(line), "--no-supervisor", "--stop-at", "9"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "sample order at seq_len 32 differs" in error, error
