"""A second training line on a data line another line consumed is refused at once (it used to wait
for cycle 0 forever), and `nsconsole data init --like` makes the identical data line it needs.

The data line's record of the line that trains on it refuses a second line first, while the first
is still there (tests/engine/ops/test_one_line_per_data_line.py); the consumed marks alone refuse
it on a data line without that record (one trained by an older nsconsole), as here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.lines import SEQ_LEN, TOKENS_PER_UPDATE, copy_data_line, data_template_fixture, make_line

from datalines import open_data_line
from datalines.consumption import consumer_of
from datalines.dataline import TRAINING_LINE_RECORD
from datalines.errors import DataLineError
from datalines.preparer import prepare_cycle
from datalines.validation import build_validation
from engine.errors import LineError
from engine.ops.check import check_line
from engine.ops.new import NewLineOptions, new_line
from engine.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

data_template = data_template_fixture()


@pytest.fixture
def consumed(tmp_path: Path, data_template: Path) -> tuple[Path, Path]:
    """(data line, the line that trained through its cycle 0 and stopped there)."""
    data = copy_data_line(data_template, tmp_path)
    first = make_line(tmp_path, data)
    (first / "STOP").write_text(json.dumps({"requested": "now", "at_cycle_end": 0}))
    assert Trainer(first, echo=None).run() == 0
    return data, first


def test_the_consumed_mark_names_the_line(consumed: tuple[Path, Path]) -> None:
    data, first = consumed
    consumer = consumer_of(data, 0)
    assert consumer is not None and consumer.line == str(first.absolute())
    assert consumer_of(data, 1) is None


def test_new_refuses_a_consumed_data_line_naming_cycles_line_and_command(
    tmp_path: Path, consumed: tuple[Path, Path]
) -> None:
    data, first = consumed
    (data / TRAINING_LINE_RECORD).unlink()  # trained by an older nsconsole: its consumed marks alone
    with pytest.raises(LineError) as info:
        new_line(tmp_path / "second", NewLineOptions(preset="transformer-tiny", data=data, seq_len=SEQ_LEN))
    message = str(info.value)
    assert "\n" not in message
    assert f"{data}: cycle 0 already consumed by {first.absolute()}" in message
    assert f"nsconsole data init --work DIR --like {data}" in message
    assert not (tmp_path / "second" / "run.json").exists()


def test_the_trainer_and_check_refuse_a_line_whose_data_was_consumed_after_new(
    tmp_path: Path, data_template: Path
) -> None:
    data = copy_data_line(data_template, tmp_path)
    second_root = tmp_path / "b"
    second_root.mkdir()
    second = make_line(second_root, data)  # made while the data line was fresh
    first = make_line(tmp_path, data)
    (first / "STOP").write_text(json.dumps({"requested": "now", "at_cycle_end": 0}))
    assert Trainer(first, echo=None).run() == 0
    (data / TRAINING_LINE_RECORD).unlink()  # trained by an older nsconsole: its consumed marks alone
    _, results = check_line(second, verify_checkpoints=False)
    failed = [result.message for result in results if not result.ok]
    assert any("cycle 0 already consumed by" in message for message in failed), failed
    with pytest.raises(DataLineError, match=r"cycle 0 already consumed by .*--like"):
        Trainer(second, echo=None).run()
    assert not (second / "checkpoints" / "u00000000").exists()  # refused before its first checkpoint
    # From the command line: one line on stderr, exit 2, at once (no "waiting for data cycle 0").
    done = subprocess.run(
        [sys.executable, "-m", "nsconsole", "run", str(second), "--no-supervisor"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "already consumed by" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_an_identical_data_line_trains_the_same_samples(tmp_path: Path, consumed: tuple[Path, Path]) -> None:
    data, first = consumed
    twin = tmp_path / "twin"
    done = subprocess.run(
        [sys.executable, "-m", "nsconsole", "data", "init", "--work", str(twin), "--like", str(data)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    original, copy = open_data_line(data), open_data_line(twin)
    assert copy.config == original.config and copy.tokenizer_json == original.tokenizer_json
    prepare_cycle(copy, 0)
    # The manifest (shard hashes, plan, sample-order digests) stays after consumption: byte for byte.
    manifest = Path("cycles", "c0000", "manifest.json")
    assert (twin / manifest).read_bytes() == (data / manifest).read_bytes()
    build_validation(copy, [SEQ_LEN])
    for name, rows in original.validation_rows(SEQ_LEN).items():
        assert copy.validation_rows(SEQ_LEN)[name].tobytes() == rows.tobytes()
    second = tmp_path / "second"
    new_line(second, NewLineOptions(preset="transformer-tiny", data=twin, seq_len=SEQ_LEN,
                                    tokens_per_update=TOKENS_PER_UPDATE))  # fmt: skip
    refused = subprocess.run(
        [sys.executable, "-m", "nsconsole", "data", "init", "--work", str(tmp_path / "x"), "--like", str(data),
         "--eos-id", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert refused.returncode == 2 and "drop --eos-id" in refused.stderr
