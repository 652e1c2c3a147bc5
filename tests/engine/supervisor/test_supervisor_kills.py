"""SIGKILL of the supervisor and of the data preparer at random points of a real line (issue 25,
item 8), in the style of `tests/engine/training/test_resume.py`: a killed supervisor's trainer
stops at its next update boundary with a checkpoint, and the next supervisor resumes there; a
killed preparer is restarted and remakes the cycle it was making byte for byte. The line, run to
its data end through every kill, equals an uninterrupted one bit for bit: weights, optimizer and
extra state, rows.jsonl, and every cycle's manifest."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from helpers.lines import copy_data_line, make_data_line, make_line, rows_without_wall_clock
from helpers.supervise import RUNNER, gone

from datalines import open_data_line
from datalines.preparer import prepare_cycle
from engine.checkpoints.format import read_latest, verify_line_checkpoints
from engine.checkpoints.tensors import load_checkpoint
from engine.supervisor import registry
from engine.training.trainer import Trainer
from nsconsole.client import SupervisorClient

pytestmark = pytest.mark.usefixtures("private_host")  # conftest: an empty host.json, a private runtime dir


@pytest.fixture(scope="module")
def data_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Cycle 0 only: the preparer makes cycles 1..3 while the line trains, and is killed doing it.
    return make_data_line(tmp_path_factory.mktemp("template"), prepare=1)


def _rows(line: Path) -> int:
    try:
        return (line / "rows.jsonl").read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def _supervise(root: Path, line: Path) -> subprocess.Popen[bytes]:
    (root / "runner.py").write_text(RUNNER)
    settings = {"poll_seconds": 0.1, "relaunch_delay_seconds": 0.05}
    environment = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, str(root / "runner.py"), str(line), json.dumps(settings)], env=environment)


def _status(line: Path) -> dict | None:
    try:
        with SupervisorClient(line / "supervisor.sock", timeout=30) as client:
            return client.call("status")
    except Exception:  # not serving yet (or any more)
        return None


def _prepare_everything(data: Path) -> None:
    line = open_data_line(data)
    index = 0
    while line.last_cycle() is None or index <= line.last_cycle():
        prepare_cycle(line, index)
        index += 1


def _manifests(data: Path) -> dict[str, bytes]:
    return {path.parent.name: path.read_bytes() for path in sorted((data / "cycles").glob("c*/manifest.json"))}


@pytest.mark.slow
def test_sigkill_of_the_supervisor_and_the_preparer_at_random_points_loses_nothing(
    tmp_path: Path, data_template: Path
) -> None:
    (tmp_path / "reference").mkdir()
    reference_data = copy_data_line(data_template, tmp_path / "reference")
    _prepare_everything(reference_data)
    reference = make_line(tmp_path / "reference", reference_data)
    assert Trainer(reference, echo=None).run() == 0
    total = _rows(reference)

    (tmp_path / "killed").mkdir()
    data = copy_data_line(data_template, tmp_path / "killed")
    line = make_line(tmp_path / "killed", data)
    chooser = random.Random(2025)
    kills = {"supervisor": 0, "preparer": 0}
    supervisor = _supervise(tmp_path, line)
    try:
        target = chooser.randint(3, 8)
        while min(kills.values()) < 2 and target < total - 3:
            while _rows(line) < target and supervisor.poll() is None:
                time.sleep(0.005)
            assert supervisor.poll() is None, "the line ended before the kills were done"
            status = _status(line)
            victim = "preparer" if kills["preparer"] <= kills["supervisor"] else "supervisor"
            if victim == "preparer":
                pid = ((status or {}).get("preparer") or {}).get("pid")
                if pid is None:  # between two preparers (or all cycles made): the next target
                    target = _rows(line) + 1
                    continue
                os.kill(pid, signal.SIGKILL)
                kills["preparer"] += 1
            else:
                trainer = (status or {}).get("trainer_pid")
                os.kill(supervisor.pid, signal.SIGKILL)
                supervisor.wait()
                kills["supervisor"] += 1
                if trainer is not None:
                    psutil.Process(trainer).wait(timeout=120)  # it saw its supervisor die
                    heartbeat = json.loads((line / "heartbeat").read_text())
                    assert heartbeat["stage"] == "stopped" and heartbeat["reason"] == "signal SIGTERM"
                    # It stopped at an update boundary with a checkpoint of that update.
                    assert read_latest(line / "checkpoints") == f"u{heartbeat['update']:08d}"
                while registry.find_supervisor(line) is not None:
                    time.sleep(0.05)  # its registry entry is stale now: the next start takes the line
                supervisor = _supervise(tmp_path, line)
            target = _rows(line) + chooser.randint(2, 8)
        assert supervisor.wait(timeout=600) == 0  # through every kill, to the data line's end
    finally:
        if not gone(supervisor.pid):
            supervisor.kill()
    assert kills["supervisor"] >= 2 and kills["preparer"] >= 2, kills
    assert json.loads((line / "supervisor.json").read_text())["state"] == "finished"

    assert verify_line_checkpoints(line) == []
    mine = load_checkpoint(line / "checkpoints" / read_latest(line / "checkpoints"))
    theirs = load_checkpoint(reference / "checkpoints" / read_latest(reference / "checkpoints"))
    assert mine.update == theirs.update and mine.state["position"] == theirs.state["position"]
    for part in ("weights", "optimizer", "extra"):
        for key, tensor in getattr(theirs, part).items():
            assert torch.equal(getattr(mine, part)[key], tensor), f"{part}/{key}"
    assert rows_without_wall_clock(line / "rows.jsonl") == rows_without_wall_clock(reference / "rows.jsonl")
    assert _manifests(data) == _manifests(reference_data)  # the killed preparer's cycles, byte for byte
