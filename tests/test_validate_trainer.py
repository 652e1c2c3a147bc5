"""Validation inside the trainer: rows carry the readings, run.log prints them, training is untouched."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_trainer_lines import SEQ_LEN, copy_data_line, make_data_line, make_line, one_torch_thread

from datalines import open_data_line
from datalines.validation import build_validation
from engine.ckpt import load_checkpoint, read_latest
from engine.trainer import Trainer

VALIDATION_PREFIXES = ("val_", "ema/", "opt/")
WALL_CLOCK_FIELDS = ("time", "tokens_per_s")


@pytest.fixture(autouse=True)
def single_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def data_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_data_line(tmp_path_factory.mktemp("template"), prepare=1)
    build_validation(open_data_line(path), [SEQ_LEN])
    return path


def trained(root: Path, data_template: Path, every: int) -> Path:
    changes = {
        "validation.every_updates": every,
        "print_every": 100,
        "ema": {"horizon_tokens": 1024, "from_tokens": 0},
    }
    line = make_line(root, copy_data_line(data_template, root), **changes)
    assert Trainer(line, stop_at=6, echo=None).run() == 0
    return line


def rows_of(line: Path) -> list[dict]:
    return [json.loads(text) for text in (line / "rows.jsonl").read_text().splitlines()]


def test_a_validating_line_trains_bit_identically_to_one_that_never_validates(
    tmp_path: Path, data_template: Path
) -> None:
    validating = trained(tmp_path / "validating", data_template, every=2)
    plain = trained(tmp_path / "plain", data_template, every=10**9)

    rows, plain_rows = rows_of(validating), rows_of(plain)
    assert [row["update"] for row in rows] == [1, 2, 3, 4, 5, 6]
    for row, plain_row in zip(rows, plain_rows):
        readings = {key for key in row if key.startswith(VALIDATION_PREFIXES)}
        assert bool(readings) == (row["update"] % 2 == 0)
        training = {k: v for k, v in row.items() if k not in readings and k not in WALL_CLOCK_FIELDS}
        assert training == {k: v for k, v in plain_row.items() if k not in WALL_CLOCK_FIELDS}
    names = ("text", "mix", "mean", "docpos/tokens_frac", "docpos/bin0")
    expected = [f"val_{SEQ_LEN}/{name}" for name in names]
    expected += [f"ema/val_{SEQ_LEN}/mix", "opt/decay/update_ratio", "opt/layer00/param_norm"]
    expected += ["train/grad_norm/layer00"]  # on every row: the fused pass's per-layer norms
    for key in expected:
        assert key in rows[1], key

    # The same weights, moments, moving average and RNG state, bit for bit.
    mine = load_checkpoint(validating / "checkpoints" / read_latest(validating / "checkpoints"))
    theirs = load_checkpoint(plain / "checkpoints" / read_latest(plain / "checkpoints"))
    assert mine.update == theirs.update == 6 and "ema" in mine.optimizer
    for name, tensor in theirs.weights.items():
        assert torch.equal(mine.weights[name], tensor), name
    for key in ("exp_avg", "exp_avg_sq", "step", "ema"):
        assert torch.equal(mine.optimizer[key], theirs.optimizer[key]), key
    assert torch.equal(mine.extra["rng/cpu"], theirs.extra["rng/cpu"])

    # Validating updates are printed although print_every is 100.
    log = (validating / "run.log").read_text()
    for update in (2, 4, 6):
        assert f"update {update:>7}" in log and f"validation at update {update}: " in log
    assert f"update {3:>7}" not in log and "warning" not in log


def test_a_line_without_held_out_rows_is_warned_at_its_start(tmp_path: Path) -> None:
    line = make_line(tmp_path, make_data_line(tmp_path, files=2, prepare=1))
    assert Trainer(line, stop_at=1, echo=None).run() == 0
    log = (line / "run.log").read_text()
    assert "warning: " in log and f"no held-out rows of length {SEQ_LEN}; validation will fail until" in log
