"""A PSSA line whose run.json changes a memory setting after its first checkpoint.

`mem_capacity` and `chunk_len` shape no parameter, so the checkpoint's parameter layout still
matches; only its banks and dreaming cache show the change. The resume must refuse it as it
refuses a changed layout: one line naming the checkpoint and the setting (exit status 2 from the
CLI, no traceback), nothing saved altered.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.lines import copy_data_line, data_template_fixture, make_line

from engine.config.run import RunConfig
from engine.errors import CheckpointError
from engine.ops.check import check_line
from engine.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread

data_template = data_template_fixture()


def trained_pssa_line(root: Path, template: Path) -> Path:
    """A pssa-tiny line (16 slots, chunks of 16) trained to update 2, with its checkpoint."""
    line = make_line(root, copy_data_line(template, root), **{"model.preset": "pssa-tiny"})
    assert Trainer(line, stop_at=2, echo=None).run() == 0
    return line


def change_overrides(line: Path, **overrides: int) -> None:
    config = RunConfig.load(line / "run.json").to_dict()
    config["model"]["overrides"].update(overrides)
    (line / "run.json").write_text(json.dumps(config))


def saved_files(line: Path) -> dict[str, bytes]:
    """Every file a refused start must leave as it was: rows and checkpoints."""
    paths = [line / "rows.jsonl", *sorted((line / "checkpoints").rglob("*"))]
    return {str(path): path.read_bytes() for path in paths if path.is_file()}


@pytest.mark.parametrize(("setting", "value", "saved"), [("mem_capacity", 8, 16), ("chunk_len", 8, 16)])
def test_a_changed_memory_setting_is_refused_in_one_line(
    tmp_path: Path, data_template: Path, setting: str, value: int, saved: int
) -> None:
    line = trained_pssa_line(tmp_path, data_template)
    before = saved_files(line)
    change_overrides(line, **{setting: value})
    with pytest.raises(CheckpointError) as caught:
        Trainer(line, stop_at=4, echo=None).run()
    message = str(caught.value)
    assert message.startswith(str(line / "checkpoints" / "u00000002") + ": ") and "\n" not in message
    assert f"saved with {setting} {saved}" in message and f"set model.overrides.{setting} back to {saved}" in message
    assert saved_files(line) == before


def test_the_cli_refuses_it_with_exit_status_2_and_no_traceback(tmp_path: Path, data_template: Path) -> None:
    line = trained_pssa_line(tmp_path, data_template)
    before = saved_files(line)
    change_overrides(line, mem_capacity=8)
    done = subprocess.run(
        [sys.executable, "-m", "nsconsole", "run", str(line), "--no-supervisor"],
        capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "u00000002" in lines[0] and "mem_capacity cannot change on a line with checkpoints" in lines[0]
    assert saved_files(line) == before


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({}, 'model: pssa-tiny {"vocab_size": 300} loads u00000002'),
        ({"mem_capacity": 8}, "saved with mem_capacity 16, and run.json's model has mem_capacity 8"),
        ({"depth": 3}, 'parameter layout differs from the model run.json builds (pssa-tiny {"depth": 3, "vocab_size": '
                       '300}; the checkpoint\'s model: pssa-tiny {"vocab_size": 300})'),
    ],
)
def test_check_says_whether_the_model_loads_the_latest_checkpoint(
    tmp_path: Path, data_template: Path, overrides: dict[str, int], expected: str
) -> None:
    """`check` runs every start check that needs no GPU: a model that the resume would refuse (a
    changed layout, a changed bank) is a FAIL there, not only when `run` starts the trainer."""
    line = trained_pssa_line(tmp_path, data_template)
    change_overrides(line, **overrides)
    _, results = check_line(line, verify_checkpoints=False)
    found = [result for result in results if result.message.startswith("model: ")]
    assert len(found) == 1 and expected in found[0].message, found
    assert found[0].ok == (not overrides)
