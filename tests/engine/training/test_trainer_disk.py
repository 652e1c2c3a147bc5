"""The disk guard: below guards.min_free_disk_gb the trainer checkpoints while there is room and
stops for the operator; with no room for a checkpoint it stops without writing one, and `latest`
still names a complete checkpoint."""

from __future__ import annotations

import errno
import json
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
from helpers.lines import (
    copy_data_line,
    data_template_fixture,
    make_line,
)

from engine.checkpoints import tensors as ckpt_module
from engine.checkpoints.format import read_latest, verify_line_checkpoints
from engine.config.run import RunConfig
from engine.errors import CheckpointError, DiskFull
from engine.training import checkpointing as checkpointing_module
from engine.training.trainer import Trainer
from engine.units import GIB

DiskUsage = namedtuple("DiskUsage", "total used free")


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread


data_template = data_template_fixture()


def _set_disk_floor(line: Path, gib: float) -> None:
    config = RunConfig.load(line / "run.json")
    config.guards.min_free_disk_gb = gib
    config.save(line / "run.json")
    config.save(line / "accepted_run.json")


def test_low_disk_checkpoints_then_stops_for_the_operator(tmp_path: Path, data_template: Path) -> None:
    line = make_line(tmp_path, copy_data_line(data_template, tmp_path))
    assert Trainer(line, stop_at=3, echo=None).run() == 0
    _set_disk_floor(line, 1e9)  # more than any disk: "full" from the next update on
    with pytest.raises(DiskFull, match=r"below guards.min_free_disk_gb = 1e\+09; update 3 is checkpointed"):
        Trainer(line, stop_at=10, echo=None).run()
    assert read_latest(line / "checkpoints") == "u00000003"
    heartbeat = json.loads((line / "heartbeat").read_text())
    assert heartbeat["stage"] == "stopped" and heartbeat["reason"] == "disk full"
    assert verify_line_checkpoints(line) == []


def test_no_room_for_a_checkpoint_writes_none(
    tmp_path: Path, data_template: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    line = make_line(tmp_path, copy_data_line(data_template, tmp_path))
    assert Trainer(line, stop_at=2, echo=None).run() == 0
    real_usage = shutil.disk_usage
    trainer = Trainer(line, stop_at=10, echo=None)
    updates_seen = []

    def usage_after_one_update(path: str | Path) -> DiskUsage:
        # Plenty of room for the start (its room check runs before the position is restored) and
        # the resumed line's first update, then a few bytes: too little to hold another checkpoint.
        position = getattr(trainer, "position", None)
        if position is None:
            return real_usage(path)
        updates_seen.append(position.update)
        if position.update <= 2:
            return real_usage(path)
        return DiskUsage(total=10**12, used=10**12 - 1000, free=1000)

    monkeypatch.setattr(checkpointing_module.shutil, "disk_usage", usage_after_one_update)
    with pytest.raises(DiskFull, match="no room for another checkpoint: the newest is update 2"):
        trainer.run()
    assert 3 in updates_seen
    assert read_latest(line / "checkpoints") == "u00000002"
    assert not list((line / "checkpoints").glob("*.partial"))
    assert verify_line_checkpoints(line) == []


def _checkpointed_at_update_2_with_no_floor(tmp_path: Path, data_template: Path) -> Path:
    line = make_line(tmp_path, copy_data_line(data_template, tmp_path))
    _set_disk_floor(line, 0.0)
    assert Trainer(line, stop_at=2, echo=None).run() == 0
    return line


def test_a_checkpoint_larger_than_the_free_disk_is_not_started(
    tmp_path: Path, data_template: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The guard's floor (0 here) is below the checkpoint's size: the trainer must not begin a
    # write the disk cannot hold, whatever the floor says.
    line = _checkpointed_at_update_2_with_no_floor(tmp_path, data_template)
    newest = line / "checkpoints" / "u00000002"
    size = sum(path.stat().st_size for path in newest.iterdir())
    real_usage = shutil.disk_usage
    trainer = Trainer(line, stop_at=10, echo=None)

    def usage(path: str | Path) -> DiskUsage:
        # Room at the start (its own check is test_a_start_without_room_for_a_checkpoint_...), then
        # less than 1.5 checkpoints from the first update on.
        if getattr(trainer, "position", None) is None:
            return real_usage(path)
        return DiskUsage(10**12, 10**12 - size, size * 6 // 5)

    monkeypatch.setattr(checkpointing_module.shutil, "disk_usage", usage)
    with pytest.raises(DiskFull, match=r"too little for the next checkpoint .*; the newest is update 2") as stop:
        trainer.run()  # the rolling checkpoint at 5
    assert "not started" not in str(stop.value)  # stopped before the write, not at the start
    # Its size to three significant digits and the margin asked for (tests/engine/ops/test_disk_messages.py).
    assert f"too little for the next checkpoint (about {size / GIB:.3g} GiB; 1.5x needed); the newest is update 2" in (
        str(stop.value)
    )
    assert read_latest(line / "checkpoints") == "u00000002"
    assert sorted(path.name for path in (line / "checkpoints").iterdir()) == [
        "latest",
        "u00000000",
        "u00000002",
    ]
    assert verify_line_checkpoints(line) == []


def test_a_write_that_fills_the_disk_is_removed_and_stops_the_line(
    tmp_path: Path, data_template: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another process fills the disk while a checkpoint is written: the half-written directory
    # goes at once, `latest` stays, and the line stops for the operator (DiskFull, not a crash).
    line = _checkpointed_at_update_2_with_no_floor(tmp_path, data_template)
    real_usage, real_save = shutil.disk_usage, ckpt_module.save_file
    filled = []

    def save_then_fill(tensors: dict, path: Path) -> None:
        real_save(tensors, path)
        if path.name == ckpt_module.OPTIMIZER_FILE:
            filled.append(path)
            raise OSError(errno.ENOSPC, "No space left on device", str(path))

    def usage(path: str | Path) -> DiskUsage:
        return DiskUsage(10**12, 10**12 - 1000, 1000) if filled else real_usage(path)

    monkeypatch.setattr(ckpt_module, "save_file", save_then_fill)
    monkeypatch.setattr(checkpointing_module.shutil, "disk_usage", usage)
    with pytest.raises(
        DiskFull,
        match=r"the disk filled while checkpoint u00000005 was written .* newest complete one is u00000002",
    ):
        Trainer(line, stop_at=10, echo=None).run()
    assert filled and not filled[0].parent.exists()  # the partial directory is gone
    assert read_latest(line / "checkpoints") == "u00000002"
    assert verify_line_checkpoints(line) == []


def test_a_new_line_without_room_for_its_first_checkpoint_writes_nothing(
    tmp_path: Path, data_template: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before any checkpoint the size is estimated: fp32 weights, two moments and an average.
    line = make_line(tmp_path, copy_data_line(data_template, tmp_path))
    _set_disk_floor(line, 0.0)
    full = shutil.disk_usage(line)._replace(free=1000)
    monkeypatch.setattr(checkpointing_module.shutil, "disk_usage", lambda path: full)
    with pytest.raises(DiskFull, match=r"too little for the next checkpoint .*; none written yet"):
        Trainer(line, stop_at=10, echo=None).run()
    assert read_latest(line / "checkpoints") is None
    assert not [path for path in (line / "checkpoints").iterdir() if path.is_dir()]
    assert not (line / "rows.jsonl").exists() or (line / "rows.jsonl").read_text() == ""


def test_a_write_that_runs_out_of_inodes_stops_the_line_for_the_operator(
    tmp_path: Path, data_template: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The disk's inodes (or the user's quota) run out while a checkpoint is written: ENOSPC with
    # gigabytes of bytes free. The line stops for the operator (DiskFull: exit 74, `disk-full`), not
    # as a failed line (a plain checkpoint error: exit 2, `failed`); `latest` stays.
    line = _checkpointed_at_update_2_with_no_floor(tmp_path, data_template)
    real_write = ckpt_module.write_bytes_durably

    def no_inode_left(path: Path, data: bytes) -> None:
        if path.name == "state.json":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real_write(path, data)

    monkeypatch.setattr(ckpt_module, "write_bytes_durably", no_inode_left)
    with pytest.raises(DiskFull, match=r"the disk filled while checkpoint u00000005 was written .* "
                                       r"the newest complete one is u00000002"):
        Trainer(line, stop_at=10, echo=None).run()
    assert read_latest(line / "checkpoints") == "u00000002"
    assert not list((line / "checkpoints").glob("*.partial"))
    assert verify_line_checkpoints(line) == []


def test_a_line_whose_checkpoints_were_removed_by_hand_keeps_its_rows(tmp_path: Path, data_template: Path) -> None:
    # Every checkpoint directory removed (to free the disk, say), `latest` left: the start is refused
    # before it writes anything, where it used to start the line over and cut rows.jsonl to nothing.
    line = _checkpointed_at_update_2_with_no_floor(tmp_path, data_template)
    rows = (line / "rows.jsonl").read_bytes()
    assert rows.count(b"\n") == 2
    for directory in (line / "checkpoints").glob("u*"):
        shutil.rmtree(directory)
    with pytest.raises(CheckpointError, match=r"no checkpoint to resume from is left, but the line has trained "
                                              r"\(.*latest names u00000002\)"):
        Trainer(line, stop_at=10, echo=None).run()
    (line / "checkpoints" / "latest").unlink()  # `latest` gone too: rows.jsonl still says the line trained
    with pytest.raises(CheckpointError, match=r"rows.jsonl holds .* bytes of rows"):
        Trainer(line, stop_at=10, echo=None).run()
    assert (line / "rows.jsonl").read_bytes() == rows
    assert not list((line / "checkpoints").iterdir())
