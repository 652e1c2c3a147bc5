"""The metric set is versioned: a line whose run.json `metrics` differs from the code's refuses to start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.lines import make_data_line, make_line

from engine.errors import ConfigError
from engine.metrics import METRICS_VERSION
from engine.training.trainer import Trainer
from nsconsole.cli import main as cli_main


def test_a_metrics_version_mismatch_refuses_the_start(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    version = METRICS_VERSION + 1  # a line started by a newer trainer (older versions: the same check)
    line = make_line(tmp_path, make_data_line(tmp_path, files=2, prepare=1))
    document = json.loads((line / "run.json").read_text())
    document["metrics"] = version
    (line / "run.json").write_text(json.dumps(document))
    expected = f"metrics is version {version} but this code computes version {METRICS_VERSION}"
    with pytest.raises(ConfigError, match=expected):
        Trainer(line, echo=None).run()
    assert not (line / "rows.jsonl").exists() and not list((line / "checkpoints").iterdir())
    assert cli_main(["run", str(line), "--no-supervisor"]) == 2
    error = capsys.readouterr().err
    assert expected in error and f"set run.json's metrics to {METRICS_VERSION}" in error
    # The way on it names: the line goes on with this code's set.
    document["metrics"] = METRICS_VERSION
    (line / "run.json").write_text(json.dumps(document))
    assert Trainer(line, stop_at=1, echo=None).run() == 0
