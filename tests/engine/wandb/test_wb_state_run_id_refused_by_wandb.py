"""A wandb_run.json whose run id W&B refuses (`bad/id`: wandb's `Run ID cannot contain the
characters: :;,#?/'`) is a damaged file, through the user's commands on a real tiny line.

A README walk found such a file read as sound: `nsconsole status` showed `W&B: run bad/id`, and every
start retried `wandb.init` with it for the whole session (`W&B failed (UsageError: Run ID cannot
contain ...); retrying in the background`), so the line's run got nothing more. Damaged, it is set
aside and the run the checkpoints record continues, as for any other damage.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.environment import nsconsole_process as nsconsole
from helpers.lines import copy_data_line, data_template_fixture, make_line

from engine.layout import LineLayout
from engine.wandb.state import WandbRunState
from engine.wandb.txlog import TransactionLogReader, transaction_log_of

pytestmark = pytest.mark.usefixtures("offline_wandb")  # conftest: a temporary, offline wandb home

data_template = data_template_fixture()


def logged_steps(line: Path) -> list[int]:
    """Every step the line's offline directories hold, in start order."""
    steps: list[int] = []
    for files in WandbRunState.load(LineLayout(line).wandb_run_json).local_files:
        log = transaction_log_of(Path(files.path))
        assert log is not None, f"{files.path} holds no transaction log"
        steps += [row.step for row in TransactionLogReader(log).read_history()]
    return steps


def test_a_run_id_wandb_refuses_is_set_aside_and_the_recorded_run_continues(
    tmp_path: Path, data_template: Path
) -> None:
    line = make_line(tmp_path, copy_data_line(data_template, tmp_path), **{"wandb.project": "nsconsole-tests"})
    # The second start's checkpoints record the run (the first start's may come before it began).
    for stop_at in ("3", "5"):
        started = nsconsole("run", str(line), "--no-supervisor", "--stop-at", stop_at)
        assert started.returncode == 0, started.stderr
    state_file = LineLayout(line).wandb_run_json
    document = json.loads(state_file.read_text())
    run_id = document["run_id"]
    document["run_id"] = "bad/id"
    damaged = json.dumps(document)
    state_file.write_text(damaged)

    status = nsconsole("status", str(line))
    assert "W&B: wandb_run.json unreadable (below)" in status.stdout, status.stdout
    [problem] = [text for text in status.stdout.splitlines() if text.startswith("problem: wandb_run.json")]
    assert problem.startswith("problem: wandb_run.json: run_id must be a W&B run id, got \"bad/id\"")
    assert f"continues run {run_id} from checkpoint u00000005" in problem

    recovered = nsconsole("run", str(line), "--no-supervisor", "--stop-at", "7")
    assert recovered.returncode == 0, recovered.stderr
    log = (line / "run.log").read_text()
    assert "W&B failed" not in log
    [said] = [text for text in log.splitlines() if "W&B: wandb_run.json" in text]
    assert "run_id must be a W&B run id" in said and f"continuing run {run_id}" in said
    [aside] = line.glob("wandb_run.json.bad-*")
    assert aside.read_text() == damaged  # nothing saved is lost
    assert WandbRunState.load(state_file).run_id == run_id
    steps = logged_steps(line)
    assert sorted(set(steps)) == list(range(1, 8)) and steps[-2:] == [6, 7]  # the run got every update
