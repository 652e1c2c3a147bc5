"""What the supervisor reads of a line's run.json between launches (engine/supervisor/reads.py):
read as the trainer reads it, so an edit the trainer refuses in one line never crashes the
supervisor that re-reads it (found in a walkthrough of run.json edits)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.config.run import RunConfig
from engine.errors import ConfigError
from engine.layout import LineLayout
from engine.supervisor.reads import reload_config, supervisor_config


@pytest.mark.parametrize(("text", "problem"), [
    ("[" * 100_000, "nested too deeply"),
    ('{"model": {"preset": "ns-tiny"}, "data": {"line": "d"}, "print_every": 5, "print_every": 6}',
     "key print_every appears twice"),
    ('{"model": ', "malformed JSON at line 1"),
])  # fmt: skip
def test_a_run_json_the_trainer_refuses_is_one_config_error(tmp_path: Path, text: str, problem: str) -> None:
    (tmp_path / "run.json").write_text(text)
    with pytest.raises(ConfigError, match=problem):
        supervisor_config(LineLayout(tmp_path))


def test_reload_keeps_the_previous_config_when_run_json_was_broken_meanwhile(tmp_path: Path) -> None:
    (tmp_path / "run.json").write_text(json.dumps({"model": {"preset": "ns-tiny"}, "data": {"line": "d"}}))
    previous = supervisor_config(LineLayout(tmp_path))
    assert isinstance(previous, RunConfig)
    (tmp_path / "run.json").write_text("[" * 100_000)
    assert reload_config(LineLayout(tmp_path), previous) is previous
