"""Disk messages give their numbers to the same precision at every size and state the margin: `check`
(and `new`, `run`) said `0.0 GiB free` with 21 MiB free beside a checkpoint of `0.0173 GiB`, and the
trainer's mid-run stop said `0.03 GiB free ..., too little for the next checkpoint (about 0.02 GiB)`
without the 1.5x margin the start refusal and the README state (found in a fault walkthrough; that
stop's wording is held by tests/engine/training/test_trainer_disk.py, beside the stop itself)."""

from __future__ import annotations

import shutil
from collections import namedtuple
from pathlib import Path

import pytest
from helpers.lines import copy_data_line, data_template_fixture, make_line

from engine.checkpoints.disk_budget import gib_text
from engine.units import GIB
from nsconsole.cli import main

DiskUsage = namedtuple("DiskUsage", "total used free")
MIB = 2**20

pytestmark = pytest.mark.usefixtures("one_thread", "private_host")

data_template = data_template_fixture()


def test_sizes_read_to_three_significant_digits_at_every_size() -> None:
    assert gib_text(21 * MIB) == "0.0205 GiB"
    assert gib_text(0.0173 * GIB) == "0.0173 GiB"
    assert gib_text(77.8 * GIB) == "77.8 GiB"
    assert gib_text(1862.4 * GIB) == "1,862 GiB"  # not 1.86e+03


@pytest.mark.parametrize(
    ("free", "shown"),
    [(21 * MIB, "ok: disk: 0.0205 GiB free (minimum 0.01; a checkpoint about "),
     (5 * MIB, "FAIL: disk: 0.00488 GiB free at {line}, below guards.min_free_disk_gb 0.01: ")],
)  # fmt: skip
def test_check_shows_a_small_free_disk_as_precisely_as_the_checkpoint(
    free: int, shown: str, tmp_path: Path, data_template: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    line = make_line(tmp_path, copy_data_line(data_template, tmp_path))
    monkeypatch.setattr(shutil, "disk_usage", lambda path: DiskUsage(10**12, 10**12 - free, free))
    main(["check", str(line)])
    disk = [text for text in capsys.readouterr().out.splitlines() if ": disk: " in text]
    assert len(disk) == 1 and disk[0].startswith(shown.format(line=line)), disk
