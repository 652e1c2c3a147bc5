"""The host's cores shared among CPU training lines (engine.training.cpu_share): seats counted
across processes, dead ones dropped, a trainer's threads following them, and no bit of a line
changed by a thread count that changes under it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers.lines import copy_data_line, data_template_fixture, make_line, rows_without_wall_clock

import engine.training.trainer as trainer_module
from engine.checkpoints.format import read_latest
from engine.checkpoints.tensors import load_checkpoint
from engine.training import cpu_share
from engine.training.cpu_share import CpuSeat, seats_directory
from engine.training.trainer import Trainer

REPOSITORY = Path(__file__).resolve().parents[3]

data_template = data_template_fixture(prepare=1)

SEAT_HOLDER = """
import sys, time
from pathlib import Path
from engine.training.cpu_share import CpuSeat
CpuSeat(Path(sys.argv[1]))
print("seated", flush=True)
time.sleep(600)
"""


@pytest.fixture
def restore_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def hold_a_seat(directory: Path) -> subprocess.Popen[str]:
    """Another process holding a seat in `directory` (until it is killed)."""
    holder = subprocess.Popen([sys.executable, "-c", SEAT_HOLDER, str(directory)], cwd=REPOSITORY,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert holder.stdout is not None and holder.stdout.readline().strip() == "seated"
    return holder


def test_seats_are_counted_across_processes_and_a_dead_ones_removed(tmp_path: Path, restore_threads: None) -> None:
    mine = CpuSeat(tmp_path)
    mine.cores = 4
    torch.set_num_threads(1)
    (tmp_path / "999999999.lock").write_text("")  # a seat file nobody holds: a trainer that died
    holder = hold_a_seat(tmp_path)
    try:
        assert mine.seats() == 2
        assert not (tmp_path / "999999999.lock").exists()
        assert mine.share() == "CPU threads 1 -> 2: 2 CPU processes of nsconsole share this host's 4 cores"
        assert torch.get_num_threads() == 2
    finally:
        holder.kill()
        holder.wait()
    assert (tmp_path / f"{holder.pid}.lock").exists()  # the kernel released its lock, the file stays
    mine._checked = None  # count again now, not CHECK_SECONDS later
    assert mine.share() == "CPU threads 2 -> 4: the only CPU process of nsconsole on this host's 4 cores"
    assert torch.get_num_threads() == 4
    assert not (tmp_path / f"{holder.pid}.lock").exists()
    mine.release()
    assert list(tmp_path.iterdir()) == []


def test_a_seat_is_counted_again_only_every_check_seconds(tmp_path: Path, restore_threads: None) -> None:
    now = [0.0]
    mine = CpuSeat(tmp_path, clock=lambda: now[0])
    mine.cores = 2
    torch.set_num_threads(2)
    assert mine.share() is None  # alone: 2 threads, as it runs
    holder = hold_a_seat(tmp_path)
    try:
        now[0] = cpu_share.CHECK_SECONDS / 2
        assert mine.share() is None and torch.get_num_threads() == 2  # not counted yet
        now[0] = cpu_share.CHECK_SECONDS
        assert mine.share() == "CPU threads 2 -> 1: 2 CPU processes of nsconsole share this host's 2 cores"
    finally:
        holder.kill()
        holder.wait()
        mine.release()


class FlippingSeat:
    """A seat whose share() alternates the thread count between 1 and 2 at every update."""

    def share(self) -> str:
        torch.set_num_threads(1 if torch.get_num_threads() == 2 else 2)
        return f"CPU threads -> {torch.get_num_threads()}"

    def release(self) -> None:
        pass


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 cores to change the thread count")
def test_a_thread_count_that_changes_every_update_changes_no_bit_of_the_line(
    tmp_path: Path, data_template: Path, monkeypatch: pytest.MonkeyPatch, restore_threads: None
) -> None:
    monkeypatch.setattr(trainer_module, "keep_freed_memory", lambda: True)  # no process-wide malloc change here
    torch.set_num_threads(2)
    plain = make_line(tmp_path / "plain", copy_data_line(data_template, tmp_path / "plain"))
    assert Trainer(plain, stop_at=6, echo=None).run() == 0

    monkeypatch.setattr(CpuSeat, "take", classmethod(lambda cls: FlippingSeat()))
    shared = make_line(tmp_path / "shared", copy_data_line(data_template, tmp_path / "shared"))
    assert Trainer(shared, stop_at=6, echo=None, owns_process=True).run() == 0
    assert (shared / "run.log").read_text().count("CPU threads -> ") == 6

    assert rows_without_wall_clock(shared / "rows.jsonl") == rows_without_wall_clock(plain / "rows.jsonl")
    mine = load_checkpoint(shared / "checkpoints" / read_latest(shared / "checkpoints"))
    theirs = load_checkpoint(plain / "checkpoints" / read_latest(plain / "checkpoints"))
    assert mine.update == theirs.update == 6
    for name, tensor in theirs.weights.items():
        assert torch.equal(mine.weights[name], tensor), name
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(mine.optimizer[key], theirs.optimizer[key]), key


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 cores to share")
def test_a_cpu_line_run_beside_another_runs_half_the_threads(tmp_path: Path, data_template: Path) -> None:
    # The user's path: `nsconsole run LINE --no-supervisor` while another CPU line trains on this
    # host (here: a process holding a seat in the same run directory, $NSCONSOLE_RUN).
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    cores = int(probe.stdout)  # the team a fresh process gets
    if cores < 2:
        pytest.skip("torch runs one thread here: nothing to share")
    line = make_line(tmp_path, copy_data_line(data_template, tmp_path))
    holder = hold_a_seat(seats_directory())
    try:
        run = subprocess.run([sys.executable, "-m", "nsconsole", "run", str(line), "--no-supervisor", "--stop-at", "3"],
                             cwd=REPOSITORY, capture_output=True, text=True, timeout=300)  # fmt: skip
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert run.returncode == 0, run.stderr
    log = (line / "run.log").read_text()
    assert f"CPU threads {cores} -> {cores // 2}: 2 CPU processes of nsconsole share this host's {cores} cores" in log
    # The run gave its seat up; the killed holder's file stays until a counter finds it dead.
    assert [path.name for path in seats_directory().glob("*.lock")] == [f"{holder.pid}.lock"]
