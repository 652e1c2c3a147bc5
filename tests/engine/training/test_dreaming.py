"""PSSA dreaming in training: run.json's `dreaming`, the dream rows, the guard and exact resume."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.lines import (
    copy_data_line,
    data_template_fixture,
    latest_checkpoint,
    make_line,
    rows_without_wall_clock,
)

from engine.checkpoints.tensors import Checkpoint
from engine.config.run import RunConfig
from engine.errors import ConfigError
from engine.gpu.sharing import GpuWatch
from engine.models.pssa.dream import LOSS_TOLERANCE
from engine.protocol.facts import Stage
from engine.training.dreaming import Dreamer
from engine.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread

data_template = data_template_fixture()

DREAMING = {"every_updates": 2, "sequences": 4, "steps": 2, "lr": 0.05, "mode": "both", "length": 6}
"""Dreams that rehearse cached chunks and dreamt sequences, with steps the guard keeps."""
DREAM_FIELDS = ("dream/sequences", "dream/generated_tokens", "dream/steps", "dream/kept",
                "dream/fresh_loss_before", "dream/fresh_loss_after")  # fmt: skip


def pssa_line(root: Path, template: Path, dreaming: dict[str, Any] | None) -> Path:
    return make_line(root, copy_data_line(template, root), **{"model.preset": "pssa-tiny", "dreaming": dreaming})


def rows(line: Path) -> list[dict[str, Any]]:
    return [json.loads(text) for text in (line / "rows.jsonl").read_text().splitlines()]


def assert_same_tensors(mine: Checkpoint, theirs: Checkpoint) -> None:
    """Weights, optimizer state and extra state (banks, dreaming cache, RNG) equal bit for bit."""
    assert mine.update == theirs.update
    for part in ("weights", "optimizer", "extra"):
        mine_part, their_part = getattr(mine, part), getattr(theirs, part)
        assert sorted(mine_part) == sorted(their_part), part
        for key, tensor in their_part.items():
            assert torch.equal(mine_part[key], tensor), f"{part}/{key}"


def pssa_document(dreaming: dict[str, Any], preset: str = "pssa-tiny") -> dict[str, Any]:
    return {"model": {"preset": preset}, "data": {"line": "data"}, "dreaming": dreaming}


@pytest.mark.parametrize(
    ("preset", "dreaming", "message"),
    [
        ("transformer-tiny", {"every_updates": 2},
         "run.json: dreaming is for pssa-\\* models only; transformer-tiny does not dream"),
        ("pssa-tiny", {"every_updates": 0}, "run.json: dreaming.every_updates must be at least 1, got 0"),
        ("pssa-tiny", {"every_updates": 2, "mode": "tokens"},
         "run.json: dreaming.mode must be one of memory, generate, both, got \"tokens\""),
        ("pssa-tiny", {"every_updates": 2, "lr": 0}, "run.json: dreaming.lr must be .*positive"),
        ("pssa-tiny", {"every_updates": 2, "temperature": -1},
         "run.json: dreaming.temperature must be .*positive"),
        ("pssa-tiny", {"every_updates": 2, "length": 0}, "run.json: dreaming.length must be at least 1"),
        ("pssa-tiny", {"every_updates": 2, "when": 3}, "run.json: unknown key dreaming.when"),
        ("pssa-tiny", {"every_updates": 2, "length": 100_000},
         "run.json: dreaming.length must be at most the model's chunk_len 16 \\(a dreamt sequence stands for one chunk\\), got 100000"),
        ("pssa-tiny", {"every_updates": 2, "sequences": 17},
         "run.json: dreaming.sequences must be at most the model's mem_capacity 16 \\("),
    ],
)  # fmt: skip
def test_run_json_dreaming_is_checked_in_one_line(preset: str, dreaming: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=f"^{message}") as caught:
        RunConfig.from_dict(pssa_document(dreaming, preset)).validate()
    assert "\n" not in str(caught.value)


def test_dreaming_defaults_and_round_trip() -> None:
    config = RunConfig.from_dict(pssa_document({"every_updates": 100}))
    config.validate()
    assert config.dreaming is not None and config.dreaming.mode == "memory" and config.dreaming.lr == 6e-3
    assert RunConfig.from_dict(config.to_dict()) == config
    assert RunConfig.from_dict({"model": {"preset": "ns-tiny"}, "data": {"line": "data"}}).dreaming is None


@pytest.mark.slow
def test_a_line_resumed_right_after_a_dream_is_bit_identical(
    tmp_path: Path, data_template: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dreams after every 2nd update land in those rows, the heartbeat reading `dreaming` while
    they run; a line stopped right after the dream of update 4 and resumed ends at update 6 in the
    uninterrupted line's state, bit for bit."""
    reference = pssa_line(tmp_path / "reference", data_template, DREAMING)
    beats: list[tuple[int, str]] = []
    dream_run = Dreamer.run

    def watched(dreamer: Dreamer, windows: torch.Tensor, update: int) -> dict[str, float]:
        beat = json.loads((reference / "heartbeat").read_text())
        beats.append((beat["update"], beat["stage"]))
        return dream_run(dreamer, windows, update)

    monkeypatch.setattr(Dreamer, "run", watched)
    assert Trainer(reference, stop_at=6, echo=None).run() == 0
    monkeypatch.undo()
    assert beats == [(2, Stage.DREAMING), (4, Stage.DREAMING), (6, Stage.DREAMING)]
    written = rows(reference)
    for row in written:
        dreamt = row["update"] % 2 == 0
        assert all((name in row) == dreamt for name in DREAM_FIELDS), row["update"]
        if dreamt:
            assert row["dream/steps"] == 2 * row["dream/sequences"] > 0
            assert row["dream/generated_tokens"] > 0  # `both`: dreamt from the memory values too
            assert row["dream/fresh_loss_after"] <= row["dream/fresh_loss_before"] + LOSS_TOLERANCE
    assert any(row.get("dream/kept", 0) > 0 for row in written)  # the dreams changed the weights
    # run.log says so too: a dream can take minutes, and its line tells the user where they went.
    logged = [text for text in (reference / "run.log").read_text().splitlines() if "dream after update" in text]
    assert [int(text.split("dream after update ")[1].split(":")[0]) for text in logged] == [2, 4, 6]
    assert all("steps kept, fresh loss " in text for text in logged)

    line = pssa_line(tmp_path / "resumed", data_template, DREAMING)
    assert Trainer(line, stop_at=4, echo=None).run() == 0
    stopped = latest_checkpoint(line)
    assert stopped.update == 4 and stopped.extra["model/dream.tokens"].shape[0] > 0  # the cache is saved
    assert Trainer(line, stop_at=6, echo=None).run() == 0
    assert_same_tensors(latest_checkpoint(line), latest_checkpoint(reference))
    assert rows_without_wall_clock(line / "rows.jsonl") == rows_without_wall_clock(reference / "rows.jsonl")


@pytest.mark.slow
def test_the_guard_undoes_every_step_that_would_raise_the_fresh_loss(tmp_path: Path, data_template: Path) -> None:
    """At a huge dream lr no step survives the guard's ten halvings: every dream restores the head
    rows it tried, and the line ends bit for bit where a line without dreaming ends."""
    huge = {"every_updates": 1, "sequences": 4, "lr": 1e9, "mode": "both", "length": 4}
    dreaming = pssa_line(tmp_path / "dreaming", data_template, huge)
    assert Trainer(dreaming, stop_at=4, echo=None).run() == 0
    plain = pssa_line(tmp_path / "plain", data_template, None)
    assert Trainer(plain, stop_at=4, echo=None).run() == 0
    dreamt = rows(dreaming)
    assert [row["dream/kept"] for row in dreamt] == [0, 0, 0, 0]
    assert all(row["dream/steps"] > 0 for row in dreamt)
    assert all(row["dream/fresh_loss_after"] == row["dream/fresh_loss_before"] for row in dreamt)
    assert_same_tensors(latest_checkpoint(dreaming), latest_checkpoint(plain))
    without_dreams = [{k: v for k, v in row.items() if k not in DREAM_FIELDS}
                      for row in rows_without_wall_clock(dreaming / "rows.jsonl")]  # fmt: skip
    assert without_dreams == rows_without_wall_clock(plain / "rows.jsonl")


@pytest.mark.cuda
def test_a_cuda_line_dreams_between_graph_updates_and_resumes(tmp_path: Path, data_template: Path) -> None:
    """On the GPU the dream runs eagerly beside the captured step and writes the head rows the
    graphs read; a line stopped right after a dream resumes to the uninterrupted line's weights
    (to rounding: CUDA kernels need not repeat bit for bit)."""
    alone = partial(GpuWatch.for_line, enabled=False)  # other pytest workers on the GPU are no other jobs
    changes = {"model.preset": "pssa-tiny", "dreaming": DREAMING, "device": "cuda"}
    reference = make_line(tmp_path / "reference", copy_data_line(data_template, tmp_path / "reference"), **changes)
    assert Trainer(reference, stop_at=6, echo=None, gpu_watch=alone).run() == 0
    dreamt = [row for row in rows(reference) if "dream/kept" in row]
    assert [row["update"] for row in dreamt] == [2, 4, 6]
    assert any(row["dream/kept"] > 0 for row in dreamt) and all(row["dream/generated_tokens"] > 0 for row in dreamt)
    assert all(row["dream/fresh_loss_after"] <= row["dream/fresh_loss_before"] + LOSS_TOLERANCE for row in dreamt)
    line = make_line(tmp_path / "resumed", copy_data_line(data_template, tmp_path / "resumed"), **changes)
    assert Trainer(line, stop_at=4, echo=None, gpu_watch=alone).run() == 0
    assert Trainer(line, stop_at=6, echo=None, gpu_watch=alone).run() == 0
    mine, theirs = latest_checkpoint(line), latest_checkpoint(reference)
    assert mine.update == theirs.update == 6
    for key, tensor in theirs.weights.items():
        torch.testing.assert_close(mine.weights[key], tensor, rtol=1e-4, atol=1e-6, msg=key)
