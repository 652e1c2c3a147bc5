"""The disk fills between two checkpoints (issue 25, item 12) on a real small disk (a tmpfs of a
few MiB): the trainer stops with the disk-full status after one line instead of a traceback, the
supervisor records `disk-full` with its event in supervisor.json (its reserve gives it the room),
does not relaunch, and nothing saved is lost: once space is freed the line resumes from its newest
checkpoint and its record equals an uninterrupted line's, bit for bit."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.lines import copy_data_line, make_data_line, make_line, one_torch_thread, rows_without_wall_clock
from helpers.supervise import start_supervisor, wait_for

from datalines import open_data_line
from datalines.preparer import prepare_cycle
from engine.checkpoints.format import read_latest, verify_line_checkpoints
from engine.errors import DiskFull
from engine.protocol.facts import EventKind, LineState, SupervisorExitCode
from engine.supervisor import registry
from engine.supervisor.reserve import RESERVE_NAME
from engine.training.trainer import Trainer
from nsconsole.client import SupervisorClient

pytestmark = pytest.mark.usefixtures("private_host")  # conftest: an empty host.json, a private runtime dir

DISK_MIB = 48
INODES = 400


@contextlib.contextmanager
def _tmpfs(disk: Path, options: str) -> Iterator[Path]:
    """A real tmpfs mounted on `disk` (mounting needs root, else the test is skipped)."""
    disk.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(disk)], capture_output=True
    ).returncode == 0
    if not mounted:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real filesystem of DISK_MIB MiB."""
    with _tmpfs(tmp_path / "disk", f"size={DISK_MIB}m") as disk:
        yield disk


@pytest.fixture
def few_inodes_disk(tmp_path: Path) -> Iterator[Path]:
    """A real filesystem of DISK_MIB MiB and INODES files and directories."""
    with _tmpfs(tmp_path / "disk", f"size={DISK_MIB}m,nr_inodes={INODES}") as disk:
        yield disk


@pytest.fixture(scope="module")
def data_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Cycle 0 prepared only: the trainer trains it, then waits for cycle 1, alive, on any machine speed.
    return make_data_line(tmp_path_factory.mktemp("template"), prepare=1)


def _fill(disk: Path) -> Path:
    """Write until the disk is full; the filler file (remove it to free the space)."""
    filler = disk / "filler"
    block = b"\0" * (1 << 16)
    with open(filler, "wb", buffering=0) as handle, contextlib.suppress(OSError):
        while True:
            handle.write(block)
    with open(filler, "ab", buffering=0) as handle, contextlib.suppress(OSError):  # the last partial blocks
        while True:
            handle.write(b"\0" * 512)
    with pytest.raises(OSError) as full:
        (disk / "probe").write_bytes(b"\0" * 8192)
    assert full.value.errno == errno.ENOSPC
    return filler


def _prepare_the_rest(data: Path) -> None:
    line = open_data_line(data)
    index = 1
    while line.last_cycle() is None or index <= line.last_cycle():
        prepare_cycle(line, index)
        index += 1


@pytest.mark.slow
def test_a_disk_full_between_checkpoints_ends_the_line_disk_full_and_loses_nothing(
    tmp_path: Path, small_disk: Path, data_template: Path
) -> None:
    data = copy_data_line(data_template, tmp_path)  # the data line lives on the big disk
    line = make_line(small_disk, data)
    supervisor = start_supervisor(tmp_path, line, run_preparer=False)
    try:
        deadline = time.monotonic() + 60
        while registry.find_supervisor(line) is None:
            assert time.monotonic() < deadline and supervisor.poll() is None, "the supervisor did not start"
            time.sleep(0.05)
        assert (line / RESERVE_NAME).stat().st_size > 0
        with SupervisorClient(line / "supervisor.sock", timeout=60) as client:
            client.subscribe(since_seq=0)
            wait_for(client, "heartbeat", lambda beat: beat["stage"] == "waiting-data")  # cycle 0 done
            checkpoint = read_latest(line / "checkpoints")
            filler = _fill(small_disk)
            _prepare_the_rest(data)  # the trainer goes on, into a full disk
            assert supervisor.wait(timeout=120) == SupervisorExitCode.FAILED
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
    state = json.loads((line / "supervisor.json").read_text())
    assert state["state"] == LineState.DISK_FULL
    assert state["last_event"]["event"] == EventKind.DISK_FULL
    assert state["launches"] == 1 and state["last_exit"]["code"] == 74  # stopped, not relaunched in a loop
    assert "Traceback" not in (line / "run.log").read_text(errors="replace")
    assert read_latest(line / "checkpoints") == checkpoint  # the newest checkpoint stands, intact
    assert verify_line_checkpoints(line) == []

    filler.unlink()  # the operator frees space; the line resumes where it was saved
    stop_at = int(checkpoint[1:]) + 6
    with one_torch_thread():
        assert Trainer(line, stop_at=stop_at, echo=None).run() == 0
        (tmp_path / "reference").mkdir()
        reference_data = copy_data_line(data_template, tmp_path / "reference")
        _prepare_the_rest(reference_data)
        reference = make_line(tmp_path / "reference", reference_data)
        assert Trainer(reference, stop_at=stop_at, echo=None).run() == 0
    assert rows_without_wall_clock(line / "rows.jsonl") == rows_without_wall_clock(reference / "rows.jsonl")


def test_a_checkpoint_write_out_of_inodes_stops_the_line_disk_full_and_loses_nothing(
    tmp_path: Path, few_inodes_disk: Path, data_template: Path
) -> None:
    """The disk's inodes run out while a checkpoint is written, tens of MiB free: safetensors says so
    only in its error's text (`No space left on device (os error 28)`), and the line was `failed` with
    that text (a checkpoint error: exit 2). It stops disk-full, saying what ran out; once files are
    removed it resumes from its newest checkpoint and its record equals an uninterrupted line's."""
    data = copy_data_line(data_template, tmp_path)
    _prepare_the_rest(data)
    line = make_line(few_inodes_disk, data, **{"wandb.mode": "disabled"})
    filler = few_inodes_disk / "filler"
    filler.mkdir()
    with one_torch_thread():
        assert Trainer(line, stop_at=3, echo=None).run() == 0
        free_inodes = os.statvfs(few_inodes_disk).f_favail
        for index in range(free_inodes - 4):  # a heartbeat's rename and little more: no checkpoint's files
            (filler / str(index)).touch()
        with pytest.raises(DiskFull, match=r"the disk filled while checkpoint u00000005 was written \(.* GiB free, "
                                           r"enough for its .* GiB: its inodes or a quota ran out; \[Errno 28\] "
                                           r"No space left on device: .*; the newest complete one is u00000003"):
            Trainer(line, stop_at=10, echo=None).run()
        assert read_latest(line / "checkpoints") == "u00000003"
        assert not list((line / "checkpoints").glob("*.partial"))
        shutil.rmtree(filler)  # the operator frees files; the line resumes where it was saved
        assert Trainer(line, stop_at=10, echo=None).run() == 0
        (tmp_path / "reference").mkdir()
        reference_data = copy_data_line(data_template, tmp_path / "reference")
        _prepare_the_rest(reference_data)
        reference = make_line(tmp_path / "reference", reference_data, **{"wandb.mode": "disabled"})
        assert Trainer(reference, stop_at=10, echo=None).run() == 0
    assert verify_line_checkpoints(line) == []
    assert rows_without_wall_clock(line / "rows.jsonl") == rows_without_wall_clock(reference / "rows.jsonl")
