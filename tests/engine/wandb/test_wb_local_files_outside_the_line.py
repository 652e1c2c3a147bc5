"""A directory that wandb_run.json's `local_files` lists outside `<line>/wandb/` is never removed by
a start, through the user's commands on a real tiny line.

A README walk listed `/.../precious` (a directory of the user's, no W&B log in it) in a line's
wandb_run.json, as a damaged or hand-edited file may: the next `nsconsole run` deleted it whole
(`remove_finished_local_files` takes a listed offline directory without a log for an empty session's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPOSITORY
from helpers.lines import copy_data_line, data_template_fixture, make_line

from engine.layout import LineLayout
from engine.wandb.state import WandbRunState

pytestmark = pytest.mark.usefixtures("offline_wandb")  # conftest: a temporary, offline wandb home

data_template = data_template_fixture()


def train(line: Path, stop_at: int) -> None:
    environment = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(REPOSITORY))
    result = subprocess.run(
        [sys.executable, "-m", "nsconsole", "run", str(line), "--no-supervisor", "--stop-at", str(stop_at)],
        cwd=REPOSITORY, env=environment, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("offline", [True, False])
def test_a_start_never_removes_a_listed_directory_outside_the_line_s_wandb_dir(
    tmp_path: Path, data_template: Path, offline: bool
) -> None:
    line = make_line(tmp_path, copy_data_line(data_template, tmp_path), **{"wandb.project": "nsconsole-tests"})
    train(line, stop_at=3)
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("the user's\n")
    state_file = LineLayout(line).wandb_run_json
    document = json.loads(state_file.read_text())
    # Offline: a listed directory without a W&B log goes as an empty session's; online: a finished one goes.
    listed = {"path": str(precious), "run_id": document["run_id"], "offline": offline, "finished": True}
    document["local_files"].append(listed)
    state_file.write_text(json.dumps(document))

    train(line, stop_at=5)
    assert (precious / "notes.txt").read_text() == "the user's\n"
    state = WandbRunState.load(state_file)
    assert all(Path(entry.path).parent == line / "wandb" for entry in state.local_files)
    assert len(state.local_files) == 2  # the line's own two sessions, still listed
