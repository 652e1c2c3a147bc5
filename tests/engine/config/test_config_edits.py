"""run.json edited by hand over a line's life: what a refusal says and what it lets through.

Found by walking a line for weeks (train, stop, edit, resume): a key written twice, a seed torch
or numpy refuses, a nesting the decoder cannot follow, a schedule or ramp grown from a point the
line had already trained past, and a single tokens_per_update changed in place.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine.config.run import RunConfig, TrainedSoFar, check_changes
from engine.errors import ConfigError

MINIMAL = '{"model": {"preset": "transformer-tiny"}, "data": {"line": "/data/d"}}'


def load_text(tmp_path: Path, text: str) -> str:
    path = tmp_path / "run.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        RunConfig.load(path)
    message = str(info.value)
    assert "\n" not in message
    return message.removeprefix(f"{path}: ")


def loaded(document: dict[str, Any]) -> RunConfig:
    config = RunConfig.from_dict(document)
    config.validate()
    return config


def edited(config: RunConfig, **changes: Any) -> RunConfig:
    document = config.to_dict()
    document.update(json.loads(json.dumps(changes)))
    return loaded(document)


def test_a_key_written_twice_is_refused_naming_it(tmp_path: Path) -> None:
    # A user adds allow_changes at the top of a run.json that has `"allow_changes": []` further
    # down: JSON keeps the last, and the listing would be silently ignored.
    text = MINIMAL[:-1] + ', "allow_changes": ["seeds"], "seeds": {"data": 1}, "allow_changes": []}'
    assert load_text(tmp_path, text) == "key allow_changes appears twice (JSON would keep only the last)"
    nested = MINIMAL[:-1] + ', "optimizer": {"clip": 1, "eps": 1e-8, "clip": 0.5}}'
    assert load_text(tmp_path, nested) == "key optimizer.clip appears twice (JSON would keep only the last)"
    overrides = '{"model": {"preset": "transformer-tiny", "overrides": {"depth": 1, "depth": 2}}, "data": {"line": "/d"}}'
    assert load_text(tmp_path, overrides) == "key model.overrides.depth appears twice (JSON would keep only the last)"


def test_a_nesting_too_deep_for_the_decoder_is_one_line(tmp_path: Path) -> None:
    assert load_text(tmp_path, "[" * 100_000) == "cannot be parsed (lists or objects nested too deeply)"


@pytest.mark.parametrize(("key", "value"), [("model", -1), ("data", -1), ("model", 2**64), ("data", 1e30)])
def test_a_seed_torch_or_numpy_refuses_is_refused_here(tmp_path: Path, key: str, value: float) -> None:
    # torch.manual_seed takes 0..2**64-1, numpy's SeedSequence no negative number: either crashed
    # the trainer's start after `check` had passed.
    text = MINIMAL[:-1] + f', "seeds": {{"{key}": {json.dumps(value)}}}}}'
    assert load_text(tmp_path, text).startswith(f"seeds.{key} must be an integer in 0..18446744073709551615")


def test_a_number_changed_in_place_says_how_to_grow_it() -> None:
    accepted = loaded(json.loads(MINIMAL) | {"tokens_per_update": 1024, "lengths": [{"seq_len": 64}],
                                                 "plan": [{"name": "trunk", "seq_len": 64}]})
    (message,) = check_changes(accepted, edited(accepted, tokens_per_update=2048))
    assert message.startswith("tokens_per_update changed from 1024 to 2048 (the batch may only grow at its end")
    assert '"tokens": 1024}, {"from": <that count>, "to": null, "tokens": 2048}' in message


def test_a_schedule_may_not_grow_from_a_point_already_trained() -> None:
    accepted = loaded(json.loads(MINIMAL) | {"lengths": [{"seq_len": 64}], "plan": [{"name": "trunk", "seq_len": 64}],
                                             "tokens_per_update": [{"from": 0, "to": None, "tokens": 1024}]})
    trained = TrainedSoFar(tokens=46_080, data_tokens=50_000)
    past = edited(
        accepted,
        tokens_per_update=[{"from": 0, "to": 20480, "tokens": 1024}, {"from": 20480, "to": None, "tokens": 2048}],
        lr={"peak": 3e-4, "pieces": [{"kind": "warmup", "until": 2e8}]},  # closes nothing: a past piece edited
    )
    assert check_changes(accepted, past, trained) == [
        "tokens_per_update piece 0 closed at 20,480, before the 50,000 tokens of the data line this line has "
        "read: only there or later (the ramp may only grow at its end)",
        "lr.pieces lost pieces: 2 accepted, 1 now (the schedule may only grow at its end)",
    ]
    closed_early = edited(accepted, lr={"peak": 3e-4, "pieces": [
        {"kind": "warmup", "until": 2e8}, {"kind": "constant", "until": 3e8}, {"kind": "decay", "until": 4e8}]})
    later = TrainedSoFar(tokens=3.5e8, data_tokens=3.5e8)
    assert check_changes(accepted, closed_early, later) == [
        "lr.pieces piece 1 closed at 300,000,000, before the 350,000,000 tokens this line has trained: only there or "
        "later (the schedule may only grow at its end)"
    ]
    # The same edits from where the line stands, or with no position known, are growth.
    assert check_changes(accepted, past, TrainedSoFar(tokens=0, data_tokens=20480)) == [
        "lr.pieces lost pieces: 2 accepted, 1 now (the schedule may only grow at its end)"
    ]
    assert check_changes(accepted, closed_early, TrainedSoFar(tokens=3e8, data_tokens=0)) == []
    assert check_changes(accepted, closed_early) == []


def test_appending_after_a_closed_last_piece_starts_where_it_ended() -> None:
    accepted = loaded(json.loads(MINIMAL) | {"lr": {"pieces": [{"kind": "warmup", "until": 1e8},
                                                               {"kind": "decay", "until": 2e8, "to": 0.1}]}})
    appended = edited(accepted, lr={"peak": 3e-4, "pieces": [
        {"kind": "warmup", "until": 1e8}, {"kind": "decay", "until": 2e8, "to": 0.1},
        {"kind": "constant", "until": None, "to": 0.1}]})
    # The line held 0.1 from 2e8 to 2.5e8: a piece beginning at 2e8 rewrites those updates' rate.
    (message,) = check_changes(accepted, appended, TrainedSoFar(tokens=2.5e8, data_tokens=2.5e8))
    assert message.startswith("lr.pieces piece 2 starts at 200,000,000, before the 250,000,000 tokens this line has trained")
    assert check_changes(accepted, appended, TrainedSoFar(tokens=2e8, data_tokens=2e8)) == []
