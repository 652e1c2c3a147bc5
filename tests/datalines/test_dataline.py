"""The data line's own API for the trainer's and the line operations' marks on its cycles."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.data import make_web_chat_recipe
from helpers.lines import make_data_line

from datalines import open_data_line
from datalines.creation import init_data_line
from datalines.preparer import delete_consumed_shards, prepare_cycle
from nsconsole.cli import main


def test_reopen_clears_the_consumed_mark_and_the_preparer_rebuilds_the_shards(tmp_path: Path) -> None:
    line = open_data_line(make_data_line(tmp_path, prepare=1))
    manifest_sha256 = line.cycle(0).manifest_sha256
    line.mark_consumed(0)
    assert delete_consumed_shards(line) == [0]
    assert line.cycle_state(0) == "consumed"

    assert line.reopen(0) is True
    assert not line.is_consumed(0)
    assert line.cycle_state(0) == "reopened"  # the manifest kept, its shards deleted
    prepare_cycle(line, 0)  # what the preparer does next: rebuild from the permanent manifest
    assert line.cycle_state(0) == "ready" and line.cycle(0).manifest_sha256 == manifest_sha256

    assert line.reopen(0) is False  # not consumed: nothing to reopen
    assert line.cycle_state(0) == "ready"


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("cycle_tokens", "lots", "cycle_tokens must be an integer >= 1, got 'lots'"),
        ("eos_id", -1, "eos_id must be an integer >= 0, got -1"),
        ("cycle_tokens", None, "cycle_tokens is missing"),
        ("pins", [], "pins must be an object, got []"),
        ("tokenizer", {"sha256": "0" * 64, "vocab_size": "300"}, "tokenizer.vocab_size must be an integer >= 1, got '300'"),
    ],
)
def test_a_dataline_json_field_of_the_wrong_type_is_named_with_what_it_must_be(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str, value: object, words: str
) -> None:
    # Before, `"cycle_tokens": "lots"` said "missing or malformed field (invalid literal for int() ...)".
    line = init_data_line(tmp_path / "line", make_web_chat_recipe(tmp_path / "inputs"), 0, 5000, None)
    config_path = line.path / "dataline.json"
    config = json.loads(config_path.read_text())
    if value is None:
        del config[field]
    else:
        config[field] = value
    config_path.write_text(json.dumps(config))
    before = config_path.read_bytes()

    assert main(["data", "status", "--work", str(line.path)]) == 2
    assert capsys.readouterr().err == f"nsconsole: {config_path}: {words}\n"
    assert config_path.read_bytes() == before
