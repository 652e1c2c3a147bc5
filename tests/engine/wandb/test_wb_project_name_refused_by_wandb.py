"""A run.json `wandb.project` that W&B refuses is bad input: one line naming run.json, exit 2.

A README walk found `"project": "a/b"` accepted by `nsconsole check` and `run`; the trainer then
trained a whole session with `W&B failed (UsageError: Invalid project name 'a/b': ...); retrying in
the background` and never mirrored a row, though run.json alone was at fault.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.environment import nsconsole_process as nsconsole
from helpers.lines import copy_data_line, data_template_fixture, make_line

pytestmark = pytest.mark.usefixtures("offline_wandb")  # conftest: a temporary, offline wandb home

data_template = data_template_fixture()


@pytest.mark.parametrize(
    ("project", "problem"),
    [
        ("a/b", "must not hold any of / \\ # ? % : (W&B refuses them), got \"a/b\""),
        ("p" * 129, "must be at most 128 characters (W&B refuses longer), got 129"),
    ],
)
def test_check_and_run_refuse_a_project_name_wandb_refuses(
    tmp_path: Path, data_template: Path, project: str, problem: str
) -> None:
    line = make_line(tmp_path, copy_data_line(data_template, tmp_path), **{"wandb.project": "nsconsole-tests"})
    before = (line / "run.json").read_text()
    # make_line writes accepted_run.json too: the lifelong project is this line's from its start.
    for name in ("run.json", "accepted_run.json"):
        (line / name).write_text(before.replace('"nsconsole-tests"', f'"{project}"'))
    for command in (("check", str(line)), ("run", str(line), "--no-supervisor", "--stop-at", "2")):
        result = nsconsole(*command)
        assert result.returncode == 2, (command, result.stdout, result.stderr)
        assert result.stderr == f"nsconsole: {line / 'run.json'}: wandb.project {problem}\n", command
    assert not (line / "rows.jsonl").exists() and not (line / "wandb").exists()
