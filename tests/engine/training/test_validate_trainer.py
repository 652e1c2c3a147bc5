"""Validation inside the trainer: rows carry the readings, run.log prints them, training is untouched."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from helpers.lines import (
    SEQ_LEN,
    TOKENS_PER_UPDATE,
    WALL_CLOCK_FIELDS,
    copy_data_line,
    data_template_fixture,
    make_data_line,
    make_line,
)

from datalines import open_data_line
from datalines.validation import build_validation
from engine.checkpoints.format import list_checkpoints, read_latest
from engine.checkpoints.tensors import load_checkpoint
from engine.config.run import SAMPLES_KEY
from engine.errors import LineError
from engine.training.trainer import Trainer

VALIDATION_PREFIXES = ("val_", "ema/", "opt/")


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread


data_template = data_template_fixture(prepare=1)


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
        readings = {key for key in row if key.startswith(VALIDATION_PREFIXES) or key == SAMPLES_KEY}
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


def test_a_line_without_held_out_rows_is_refused_at_its_start(tmp_path: Path) -> None:
    data = make_data_line(tmp_path, files=2, prepare=1, validation=())
    line = make_line(tmp_path, data, **{"validation.long_seq_len": 2 * SEQ_LEN})
    where = re.escape(str(data))
    expected = (
        rf"^{where}: no held-out rows of length {SEQ_LEN}, {2 * SEQ_LEN} for this line's validation; "
        rf"build them with `nsconsole data val --work {where} --seq-len {SEQ_LEN} --long-seq-len 0` and "
        rf"`nsconsole data val --work {where} --seq-len {2 * SEQ_LEN} --long-seq-len 0`$"
    )
    with pytest.raises(LineError, match=expected):
        Trainer(line, stop_at=1, echo=None).run()
    assert list_checkpoints(line / "checkpoints") == [] and not (line / "rows.jsonl").exists()

    build_validation(open_data_line(data), [SEQ_LEN, 2 * SEQ_LEN])  # what the message says to run
    assert Trainer(line, stop_at=1, echo=None).run() == 0


def test_probe_rows_before_a_capture_are_logged_and_leave_training_untouched(
    tmp_path: Path, data_template: Path
) -> None:
    changes = {
        "validation.long_seq_len": 2 * SEQ_LEN,  # the long-row probe runs too
        "validation.rows_per_source": 1,  # a validation then reads the rows the probe reads
        "ema": {"horizon_tokens": 1024, "from_tokens": 0},
        "wandb.mode": "disabled",
    }
    line = make_line(tmp_path, copy_data_line(data_template, tmp_path), **changes)
    trainer = Trainer(line, echo=None)
    trainer._start()
    try:
        optimizer = trainer.optimizer
        before = {"params": optimizer.params.clone(), "ema": trainer.average.average.clone()}
        before.update({key: value.clone() for key, value in optimizer.state_tensors().items()})
        rng = torch.get_rng_state()

        trainer._probe_rows_before_capture(SEQ_LEN)

        after = {"params": optimizer.params, "ema": trainer.average.average, **optimizer.state_tensors()}
        for key, value in before.items():
            assert torch.equal(after[key], value), key
        assert torch.equal(torch.get_rng_state(), rng) and trainer.model.training
        readings = trainer.validator.probe_rows(SEQ_LEN)
        validation = trainer.validator.run(SEQ_LEN, at_tokens=0, next_lr=1e-3, next_weight_decay=0.1)
    finally:
        trainer.writer.wait()
        trainer.rows.close()
        trainer.log.close()
    # The same code as a validation's: with one row per source, the same readings.
    for key in (f"val_{SEQ_LEN}/text", f"val_{SEQ_LEN}/docpos/tokens_frac", f"val_{2 * SEQ_LEN}/text",
                f"val_{2 * SEQ_LEN}/pos/seg1"):  # fmt: skip
        assert readings[key] == validation[key], key
    assert {key: validation[key] for key in readings} == readings
    [logged] = [text for text in (line / "run.log").read_text().splitlines() if "probe rows" in text]
    short, long = readings[f"val_{SEQ_LEN}/text"], readings[f"val_{2 * SEQ_LEN}/text"]
    assert logged.endswith(
        f"probe rows before capture at seq_len {SEQ_LEN}: val_{SEQ_LEN}/text {short:.4f}  "
        f"val_{2 * SEQ_LEN}/text {long:.4f}  ({len(readings) - 2} readings, all finite)"
    )


def validated_updates(line: Path) -> list[int]:
    return [row["update"] for row in rows_of(line) if any(key.startswith("val_") for key in row)]


def test_the_last_update_of_a_plan_validates_whatever_every_updates_says(tmp_path: Path, data_template: Path) -> None:
    plan = [{"name": "trunk", "seq_len": SEQ_LEN, "tokens": 5 * TOKENS_PER_UPDATE}]
    line = make_line(tmp_path, copy_data_line(data_template, tmp_path), plan=plan, **{"validation.every_updates": 10**9})
    assert Trainer(line, echo=None).run() == 0
    assert [row["update"] for row in rows_of(line)] == [1, 2, 3, 4, 5]
    assert validated_updates(line) == [5]
    assert "validation at update 5" in (line / "run.log").read_text()


def test_the_last_update_of_the_data_line_validates(tmp_path: Path) -> None:
    data = make_data_line(tmp_path / "template")  # every cycle prepared: the line runs to the data's end
    line = make_line(tmp_path, data, **{"validation.every_updates": 10**9})
    assert Trainer(line, echo=None).run() == 0
    last = rows_of(line)[-1]["update"]
    assert last > 1 and validated_updates(line) == [last]
