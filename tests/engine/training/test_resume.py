"""Exact resume: a line killed (SIGKILL) at random points and resumed equals an uninterrupted one."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPOSITORY
from helpers.lines import (
    SEQ_LEN,
    assert_same_state,
    copy_data_line,
    data_template_fixture,
    make_line,
)

from engine.checkpoints.format import read_latest, verify_line_checkpoints
from engine.checkpoints.tensors import load_checkpoint
from engine.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread


data_template = data_template_fixture()


def count_rows(line: Path) -> int:
    try:
        return (line / "rows.jsonl").read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def trainer_process(line: Path) -> subprocess.Popen:
    environment = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(REPOSITORY))
    return subprocess.Popen(
        [sys.executable, "-m", "nsconsole", "run", str(line), "--no-supervisor"],
        cwd=REPOSITORY,
        env=environment,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


STATEFUL_CHANGES = {
    "ema": {"horizon_tokens": 256, "from_tokens": 128},
    "validation.long_seq_len": 2 * SEQ_LEN,  # ns-tiny reads 512 tokens; the test rows are this long
}
"""run.json changes that give every family state beyond weights and moments (EMA, long probes)."""


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["transformer-tiny", "pssa-tiny", "ns-tiny"])
def test_sigkill_at_random_points_then_resume_is_bit_identical(
    tmp_path: Path, data_template: Path, preset: str
) -> None:
    changes = {} if preset == "transformer-tiny" else {"model.preset": preset, **STATEFUL_CHANGES}
    reference_data = copy_data_line(data_template, tmp_path / "reference")
    reference = make_line(tmp_path / "reference", reference_data, **changes)
    assert Trainer(reference, echo=None).run() == 0
    total = count_rows(reference)

    line = make_line(tmp_path / "killed", copy_data_line(data_template, tmp_path / "killed"), **changes)
    chooser = random.Random(1234)
    kills = 0
    target = chooser.randint(2, 12)
    while kills < 4 and target < total - 2:
        process = trainer_process(line)
        while count_rows(line) < target and process.poll() is None:
            time.sleep(0.002)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
        assert process.returncode in (-signal.SIGKILL, 0), process.stderr.read().decode()
        kills += process.returncode == -signal.SIGKILL
        target = count_rows(line) + chooser.randint(3, 15)
    assert kills >= 2

    final = trainer_process(line)
    _, errors = final.communicate(timeout=300)
    assert final.returncode == 0, errors.decode()
    assert verify_line_checkpoints(line) == []
    assert_same_state(line, reference)
    assert not [path for path in (line / "checkpoints").iterdir() if path.name.endswith(".partial")]


@pytest.mark.parametrize("preset", ["pssa-tiny", "ns-tiny"])
def test_stateful_models_resume_exactly(tmp_path: Path, data_template: Path, preset: str) -> None:
    """Memory banks (PSSA), the EMA slot and the RNG state survive a stop and resume."""
    changes = {"model.preset": preset, **STATEFUL_CHANGES}
    reference_data = copy_data_line(data_template, tmp_path / "reference")
    reference = make_line(tmp_path / "reference", reference_data, **changes)
    assert Trainer(reference, stop_at=6, echo=None).run() == 0
    line = make_line(tmp_path / "resumed", copy_data_line(data_template, tmp_path / "resumed"), **changes)
    assert Trainer(line, stop_at=3, echo=None).run() == 0
    assert Trainer(line, stop_at=6, echo=None).run() == 0
    assert_same_state(line, reference)
    latest = load_checkpoint(line / "checkpoints" / read_latest(line / "checkpoints"))
    assert "ema" in latest.optimizer and latest.state["ema_started"]
    if preset == "pssa-tiny":
        assert any(key.startswith("model/") for key in latest.extra)


def test_pssa_follows_the_trainer_s_clock_and_consolidates_at_cycle_ends_resumably(
    tmp_path: Path, data_template: Path
) -> None:
    """The trainer tells PSSA the update count (its memory write rule's clock) before every update
    and lets it consolidate at each cycle end, before the kept checkpoint; a line stopped before
    a cycle end and resumed past it ends in the uninterrupted line's state."""
    changes = {"model.preset": "pssa-tiny"}
    reference = make_line(tmp_path / "reference", copy_data_line(data_template, tmp_path / "reference"), **changes)
    assert Trainer(reference, stop_at=14, echo=None).run() == 0
    checkpoints = reference / "checkpoints"
    kept = {load_checkpoint(path).state["kept"]: load_checkpoint(path) for path in checkpoints.iterdir()
            if path.is_dir() and load_checkpoint(path).state["kept"]}  # fmt: skip
    cycle_end = kept["cycle-end 0"]
    assert 7 < cycle_end.update < 14
    start = kept["line-start"] if "line-start" in kept else load_checkpoint(checkpoints / "u00000000")
    assert not start.extra["model/blocks.0.consolidated_up"].any()
    assert cycle_end.extra["model/blocks.0.consolidated_up"].any()  # consolidated before the checkpoint
    latest = load_checkpoint(checkpoints / read_latest(checkpoints))
    assert int(latest.extra["model/update"]) == latest.update - 1  # the clock set before the last update

    line = make_line(tmp_path / "resumed", copy_data_line(data_template, tmp_path / "resumed"), **changes)
    assert Trainer(line, stop_at=7, echo=None).run() == 0
    assert Trainer(line, stop_at=14, echo=None).run() == 0
    assert_same_state(line, reference)
