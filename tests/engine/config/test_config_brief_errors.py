"""A run.json value of the wrong JSON type is shown in its error only while it is short; a longer one
is named by its type and size: a run.json whose top level was a list used to make a "one line"
error of the whole file, 1.6 KB (found in a fault walkthrough)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.config.json_fields import SHOWN_CHARS, show_briefly
from engine.config.run import RunConfig
from engine.errors import ConfigError


def test_a_run_json_whose_top_level_is_a_list_is_named_by_its_type(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    document = [{"allow_changes": [], "model": {"preset": "transformer-tiny"}, "padding": "x" * 1500}]
    path.write_text(json.dumps(document))
    with pytest.raises(ConfigError) as refused:
        RunConfig.load(path)
    assert str(refused.value) == f"{path}: the top level must be an object, got a list of 1 item"


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ([0.9], "[0.9]"),  # short values as written, as before
        ("4k", '"4k"'),
        (list(range(30)), "a list of 30 items"),
        ({str(key): key for key in range(12)}, "an object of 12 keys"),
        ("y" * 200, f'a string of 200 characters starting "{"y" * SHOWN_CHARS}"'),
    ],
)
def test_a_long_value_is_named_by_its_type_and_size(value: object, shown: str) -> None:
    assert show_briefly(value) == shown


def test_a_nested_long_value_is_capped_too() -> None:
    document = {"model": {"preset": "transformer-tiny"}, "data": {"line": "d"}, "lengths": "z" * 3000}
    with pytest.raises(ConfigError) as refused:
        RunConfig.from_dict(document, source="run.json")
    assert str(refused.value) == f'run.json: lengths must be a list, got a string of 3000 characters starting "{"z" * 40}"'
