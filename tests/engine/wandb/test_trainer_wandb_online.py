"""The trainer's W&B mirror online: real tiny lines, the real wandb 0.31 client, a local W&B server.

The server is tests/helpers/wandb_server.py (no real W&B server can run here). What W&B holds is
read off that server: each run's history rows in the order they arrived, and the rows it dropped
because their step was not above the run's last one (W&B's rule), which must stay empty.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import REPOSITORY
from helpers.lines import copy_data_line, data_template_fixture, make_line
from helpers.wandb_fakes import wait_for
from helpers.wandb_server import FakeWandbServer, online_wandb

from engine.checkpoints.format import checkpoint_name, read_latest, write_latest
from engine.checkpoints.tensors import load_checkpoint
from engine.layout import LineLayout
from engine.training.trainer import Trainer
from engine.wandb.replay import CIRCUMSTANTIAL_KEYS
from engine.wandb.rows import row_values
from engine.wandb.state import WandbRunState

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread

data_template = data_template_fixture()


@pytest.fixture
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeWandbServer]:
    with online_wandb(tmp_path_factory.mktemp("wandb_home")) as fake:
        yield fake


def online_line(root: Path, data_template: Path) -> Path:
    """A tiny line mirrored online, a rolling checkpoint every 5 updates."""
    data = copy_data_line(data_template, root)
    return make_line(root, data, **{"wandb.mode": "online", "wandb.project": "nsconsole-tests"})


def train(line: Path, stop_at: int) -> None:
    assert Trainer(line, stop_at=stop_at, echo=None).run() == 0


def line_rows(line: Path) -> list[dict[str, Any]]:
    return [json.loads(text) for text in (line / "rows.jsonl").read_text().splitlines()]


def wandb_state(line: Path) -> WandbRunState:
    return WandbRunState.load(LineLayout(line).wandb_run_json)


def computed(row: dict[str, Any]) -> dict[str, Any]:
    """What an update computed, as W&B gets it (`row_values`: no `update`, no samples' text),
    without the keys that say how it ran."""
    return {key: value for key, value in row_values(row).items() if key not in CIRCUMSTANTIAL_KEYS}


def assert_server_mirrors_rows(server: FakeWandbServer, line: Path) -> None:
    """The line's run on the server holds every row of rows.jsonl once, with rows.jsonl's values."""
    run = server.run(wandb_state(line).run_id)
    rows = line_rows(line)
    assert run.steps() == [row["update"] for row in rows]
    assert run.dropped == []
    for row, held in zip(rows, run.rows(), strict=True):
        assert {key: held[key] for key in computed(row)} == computed(row), f"update {row['update']}"


def forget_checkpoints_after(line: Path, update: int) -> None:
    """As if the trainer was killed before writing any checkpoint after `update`."""
    checkpoints = LineLayout(line).checkpoints
    for directory in checkpoints.iterdir():
        if directory.is_dir() and directory.name > checkpoint_name(update):
            shutil.rmtree(directory)
    write_latest(checkpoints, checkpoint_name(update))


def test_a_line_is_mirrored_online_and_each_checkpoint_names_its_run(
    tmp_path: Path, data_template: Path, server: FakeWandbServer
) -> None:
    line = online_line(tmp_path, data_template)
    train(line, stop_at=6)
    state = wandb_state(line)
    assert (state.start, state.acknowledged_step) == ("new", 6)
    assert_server_mirrors_rows(server, line)
    assert server.run(state.run_id).exit_code == 0
    train(line, stop_at=12)
    assert_server_mirrors_rows(server, line)
    assert [row["update"] for row in line_rows(line)] == list(range(1, 13))
    # The resumed session's checkpoints (u10, u12) name the line's run and the step the server
    # had acknowledged by then (at least the first session's 6).
    checkpoints = LineLayout(line).checkpoints
    for update in (10, 12):
        record = load_checkpoint(checkpoints / checkpoint_name(update)).state["wandb"]
        assert record["run_id"] == state.run_id and 6 <= record["acknowledged_step"] <= update


def test_replayed_updates_are_compared_with_the_server_and_a_difference_reaches_run_log(
    tmp_path: Path, data_template: Path, server: FakeWandbServer
) -> None:
    line = online_line(tmp_path, data_template)
    train(line, stop_at=8)
    run_id = wandb_state(line).run_id
    # The server's row of update 7 differs from what the line trains (say, stored corrupted).
    stored = server.run(run_id)
    seventh = json.loads(stored.history[6])
    assert seventh["_step"] == 7
    stored.history[6] = json.dumps({**seventh, "loss": seventh["loss"] + 1.0})
    # Killed after W&B got update 8 and before its checkpoint: updates 6-8 are trained again.
    forget_checkpoints_after(line, 5)
    train(line, stop_at=10)
    state = wandb_state(line)
    # Updates 6 and 8 (and every other value of 7) matched the server: the replay is exact.
    assert [(item.update, item.metric) for item in state.replay_mismatches] == [(7, "loss")]
    assert state.replay_mismatch_count == 1
    run_log = (line / "run.log").read_text()
    [reported] = [text for text in run_log.splitlines() if "replayed update" in text]
    assert f"replayed update 7 differs from run {run_id}'s copy on the server: loss" in reported
    run = server.run(run_id)
    assert run.steps() == list(range(1, 11)) and run.dropped == []  # updates 6-8 not sent again


def test_training_never_waits_on_a_down_wandb_and_the_next_start_sends_everything(
    tmp_path: Path, data_template: Path, server: FakeWandbServer
) -> None:
    line = online_line(tmp_path, data_template)
    server.stop()  # W&B is down for the whole first session
    # A trainer process of its own, as in production: it must train, close W&B within its bound
    # (1 s here) and exit although its W&B client is still trying to reach the server.
    script = (
        "import sys, torch; torch.set_num_threads(1)\n"
        "from engine.training import trainer\n"
        "trainer.WANDB_CLOSE_SECONDS = 1.0\n"
        f"sys.exit(trainer.Trainer({str(line)!r}, stop_at=6, echo=None).run())\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPOSITORY, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr
    assert [row["update"] for row in line_rows(line)] == list(range(1, 7))
    assert "W&B took more than 1 s to close" in (line / "run.log").read_text()
    assert wandb_state(line).acknowledged_step is None  # nothing reached W&B
    server.start()
    train(line, stop_at=8)
    assert_server_mirrors_rows(server, line)
    assert wandb_state(line).acknowledged_step == 8


def trainer_process(line: Path) -> subprocess.Popen:
    environment = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(REPOSITORY))
    return subprocess.Popen(
        [sys.executable, "-m", "nsconsole", "run", str(line), "--no-supervisor"],
        cwd=REPOSITORY,
        env=environment,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


@pytest.mark.slow
def test_a_killed_trainer_resumes_its_run_and_the_server_gets_every_update_once(
    tmp_path: Path, data_template: Path, server: FakeWandbServer
) -> None:
    line = online_line(tmp_path, data_template)
    server.history_capacity = 5  # W&B struggles: it takes updates 1-5 and refuses the rest for now
    process = trainer_process(line)
    try:
        wait_for(lambda: any(len(run.history) == 5 for run in list(server.runs.values())), timeout_s=120.0)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL, process.stderr.read().decode()
    [run_id] = server.runs
    checkpoints = LineLayout(line).checkpoints
    latest = load_checkpoint(checkpoints / read_latest(checkpoints))
    assert latest.state["wandb"]["run_id"] in (run_id, None)  # None: taken before the run began
    server.history_capacity = None
    assert Trainer(line, echo=None).run() == 0  # resumed; trains on to the end of its data
    state = wandb_state(line)
    assert (state.run_id, state.start) == (run_id, "resume")
    # The server's count (5) decided what was sent again: every update is on it once.
    assert_server_mirrors_rows(server, line)
    assert state.replay_mismatch_count == 0
    updates = [row["update"] for row in line_rows(line)]
    assert updates == list(range(1, len(updates) + 1)) and updates[-1] > 5
