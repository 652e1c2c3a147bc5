"""Samples at every validation (issue 23 item 5): recorded in the validation's row as text, taken
from held-out prompts, the same after a resume, and leaving the training state untouched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.lines import (
    SEQ_LEN,
    copy_data_line,
    data_template_fixture,
    make_line,
    rows_without_wall_clock,
)

from datalines import open_data_line
from engine.checkpoints.format import read_latest
from engine.checkpoints.tensors import load_checkpoint
from engine.config.run import SAMPLES_KEY, DataConfig, ModelConfig, RunConfig
from engine.errors import ConfigError
from engine.ops.lines import inspect_data_line
from engine.training.samples import sample_prompts
from engine.training.trainer import Trainer
from engine.wandb.rows import row_values

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread

data_template = data_template_fixture(prepare=1)


def pssa_line(root: Path, template: Path, **changes: object) -> Path:
    """A pssa-tiny line (memory banks, EMA: the most state a sample could disturb) validating every
    2 updates."""
    facts = inspect_data_line(template)
    settings = {
        "model": {"preset": "pssa-tiny", "overrides": {"vocab_size": facts.vocab_size}},
        "validation.every_updates": 2,
        "validation.rows_per_source": 2,
        "ema": {"horizon_tokens": 1024, "from_tokens": 0},
        "checkpoints.every_updates": 100,
        "wandb.mode": "disabled",
        **changes,
    }
    return make_line(root, copy_data_line(template, root), **settings)


def rows(line: Path) -> list[dict]:
    return [json.loads(text) for text in (line / "rows.jsonl").read_text().splitlines()]


def latest_checkpoint(line: Path):
    return load_checkpoint(line / "checkpoints" / read_latest(line / "checkpoints"))


def test_each_validation_records_samples_from_held_out_prompts_and_leaves_training_untouched(
    tmp_path: Path, data_template: Path
) -> None:
    sampled = pssa_line(tmp_path / "sampled", data_template)
    unsampled = pssa_line(tmp_path / "unsampled", data_template, **{"validation.samples": {"prompts": 0}})
    for line in (sampled, unsampled):
        assert Trainer(line, stop_at=4, echo=None).run() == 0

    heldout = open_data_line(sampled.parent / "data")
    first_rows = heldout.validation_rows(SEQ_LEN)["text"][:2]
    validating = [row for row in rows(sampled) if row["update"] % 2 == 0]
    assert [row["update"] for row in validating] == [2, 4]
    for row in validating:
        samples = row[SAMPLES_KEY]
        # The default: 2 prompts of 32 tokens, the first held-out rows of the line's one source.
        assert [sample["source"] for sample in samples] == ["text", "text"]
        assert [sample["prompt"] for sample in samples] == [heldout.tokenizer.decode(ids[:32]) for ids in first_rows]
        assert all(sample["text"] for sample in samples)
    assert [row[SAMPLES_KEY] for row in validating][0] != [row[SAMPLES_KEY] for row in validating][1]
    assert all(SAMPLES_KEY not in row for row in rows(sampled) if row["update"] % 2)
    assert all(SAMPLES_KEY not in row for row in rows(unsampled))

    # The samples change nothing else: the same rows, weights, moments, average, banks and RNG states.
    without_samples = [{k: v for k, v in row.items() if k != SAMPLES_KEY} for row in rows_without_wall_clock(sampled / "rows.jsonl")]
    assert without_samples == rows_without_wall_clock(unsampled / "rows.jsonl")
    mine, theirs = latest_checkpoint(sampled), latest_checkpoint(unsampled)
    assert mine.update == theirs.update == 4
    for part in ("weights", "optimizer", "extra"):
        mine_part, their_part = getattr(mine, part), getattr(theirs, part)
        assert sorted(mine_part) == sorted(their_part), part
        for key, tensor in their_part.items():
            assert torch.equal(mine_part[key], tensor), f"{part}/{key}"


def test_a_resumed_line_writes_the_same_samples_as_an_uninterrupted_one(tmp_path: Path, data_template: Path) -> None:
    reference = pssa_line(tmp_path / "reference", data_template)
    assert Trainer(reference, stop_at=4, echo=None).run() == 0
    resumed = pssa_line(tmp_path / "resumed", data_template)
    assert Trainer(resumed, stop_at=2, echo=None).run() == 0  # stops with a checkpoint after validating
    assert Trainer(resumed, stop_at=4, echo=None).run() == 0  # a fresh trainer: update 4 samples anew
    assert rows_without_wall_clock(resumed / "rows.jsonl") == rows_without_wall_clock(reference / "rows.jsonl")
    assert SAMPLES_KEY in rows(resumed)[-1]


def test_greedy_samples_follow_the_settings(tmp_path: Path, data_template: Path) -> None:
    settings = {"prompts": 3, "prompt_tokens": 5, "new_tokens": 4, "temperature": 0.0, "top_p": 1.0}
    line = pssa_line(tmp_path, data_template, **{"validation.samples": settings, "validation.rows_per_source": 3})
    assert Trainer(line, stop_at=2, echo=None).run() == 0
    heldout = open_data_line(tmp_path / "data")
    samples = rows(line)[-1][SAMPLES_KEY]
    first_rows = heldout.validation_rows(SEQ_LEN)["text"]
    assert [sample["prompt"] for sample in samples] == [heldout.tokenizer.decode(ids[:5]) for ids in first_rows[:3]]
    for sample in samples:  # at most 4 tokens: no token of this tokenizer is longer than a word
        assert 0 < len(sample["text"].split()) <= 4


def test_prompts_take_the_sources_in_turn() -> None:
    rows_by_source = {
        "web": torch.arange(30).view(3, 10),
        "code": torch.arange(100, 120).view(2, 10),
        "empty": torch.zeros(0, 10, dtype=torch.int64),
    }
    prompts = sample_prompts(rows_by_source, 4, 3)
    assert prompts == [("code", [100, 101, 102]), ("web", [0, 1, 2]), ("code", [110, 111, 112]), ("web", [10, 11, 12])]
    assert len(sample_prompts(rows_by_source, 8, 3)) == 5  # every row once, no more
    assert sample_prompts(rows_by_source, 1, 50) == [("code", list(range(100, 110)))]  # the whole row


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        ({"prompts": -1}, "validation.samples.prompts must be at least 0, got -1"),
        ({"prompts": 9}, "validation.samples.prompts must be at most 8, got 9"),
        ({"prompt_tokens": 0}, "validation.samples.prompt_tokens must be at least 1, got 0"),
        ({"new_tokens": 257}, "validation.samples.new_tokens must be at most 256, got 257"),
        ({"temperature": -0.5}, "validation.samples.temperature must be finite and at least 0 (0: greedy), got -0.5"),
        ({"top_p": 0.0}, "validation.samples.top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "validation.samples.top_p must be in (0, 1], got 1.5"),
    ],
)
def test_bad_sample_settings_are_refused_naming_the_file_and_key(settings: dict, problem: str) -> None:
    document = RunConfig(ModelConfig("transformer-tiny"), DataConfig("data")).to_dict()
    document["validation"]["samples"].update(settings)
    config = RunConfig.from_dict(document, source="line/run.json")
    with pytest.raises(ConfigError) as error:
        config.validate(source="line/run.json")
    assert str(error.value) == f"line/run.json: {problem}"


def test_samples_default_on_and_zero_prompts_turn_them_off() -> None:
    document = RunConfig(ModelConfig("transformer-tiny"), DataConfig("data")).to_dict()
    del document["validation"]["samples"]  # a run.json written before samples existed
    config = RunConfig.from_dict(document)
    assert config.validation.samples.prompts == 2 and config.validation.samples.temperature == 0.8
    document["validation"]["samples"] = {"prompts": 0}
    assert RunConfig.from_dict(document).validation.samples.prompts == 0


def test_w_and_b_gets_no_samples() -> None:
    row = {"update": 4, "loss": 3.5, "val_32/mix": 3.6, SAMPLES_KEY: [{"source": "text", "prompt": "a", "text": "b"}]}
    assert row_values(row) == {"loss": 3.5, "val_32/mix": 3.6}


def test_logits_that_go_non_finite_stop_a_sample_and_training_goes_on(
    tmp_path: Path, data_template: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A diverged model's NaN logits raised torch's multinomial error out of the validation: the
    # trainer died at every validation, and the supervisor restarted it into the same one.
    from engine.generation import sampling, session

    draws = []

    def nan_at_the_third_draw(logits: torch.Tensor, *arguments: object) -> int:
        draws.append(1)
        if len(draws) == 3:
            logits = logits.clone()
            logits[0] = float("nan")
        return sampling.choose_token(logits, *arguments)

    monkeypatch.setattr(session, "choose_token", nan_at_the_third_draw)
    settings = {"prompts": 2, "prompt_tokens": 5, "new_tokens": 4, "temperature": 1.0, "top_p": 1.0}
    line = pssa_line(tmp_path, data_template, **{"validation.samples": settings})
    assert Trainer(line, stop_at=4, echo=None).run() == 0
    first, second = [row[SAMPLES_KEY] for row in rows(line) if SAMPLES_KEY in row]
    assert first[0]["stopped"] == "the model's next-token logits hold 1 NaN or infinite values of 300 after 2 tokens"
    assert first[0]["text"] and "stopped" not in first[1] and first[1]["text"]
    assert all("stopped" not in sample for sample in second)
