"""A rollback keeps the rows it sets aside, not a copy of the whole rows.jsonl.

Before, each rollback copied rows.jsonl whole to rows.rolledback-<time>.jsonl: on a line of months,
gigabytes per rollback, nearly all of them rows that stay in rows.jsonl. Now the file holds rows.jsonl
past the checkpoint's rows, byte for byte. What reads these files reads the time in their names
(the console's history, a supervisor's `status`), so an older, whole copy on disk reads as before.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.lines import copy_data_line, data_template_fixture, make_line

from engine.checkpoints.format import read_checkpoint_state
from engine.layout import LineLayout
from engine.ops.rollback import rollback_line
from engine.ops.rollback_records import ROLLED_BACK_ROWS_PREFIX, rollback_times
from engine.training.trainer import Trainer
from nsconsole.cli import main as cli_main
from nsconsole.history import read_at_rest
from nsconsole.state import LineView

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread

data_template = data_template_fixture(files=2)

OLD_COPY = f"{ROLLED_BACK_ROWS_PREFIX}20240101T000000Z.jsonl"
"""A whole copy of rows.jsonl, as a rollback made it before."""


@pytest.fixture(scope="module")
def trained(data_template: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("line")
    line = make_line(root, copy_data_line(data_template, root), **{"wandb.mode": "disabled"})
    assert Trainer(line, echo=None).run() == 0  # its one cycle: 17 updates, checkpoints every 5
    return root


@pytest.fixture
def line(trained: Path, tmp_path: Path) -> Path:
    shutil.copytree(trained, tmp_path / "copy", symlinks=True)
    line = tmp_path / "copy" / "line"
    for name in ("run.json", "accepted_run.json"):  # the copy's own data line
        document = json.loads((line / name).read_text())
        document["data"]["line"] = str(tmp_path / "copy" / "data")
        (line / name).write_text(json.dumps(document))
    return line


def test_a_rollback_keeps_only_the_rows_it_sets_aside_and_every_reader_reads_as_before(
    line: Path, capsys: pytest.CaptureFixture
) -> None:
    layout = LineLayout(line)
    original = layout.rows_jsonl.read_bytes()
    (line / OLD_COPY).write_bytes(original)  # an earlier rollback's whole copy, already on disk
    at_10 = int((read_checkpoint_state(layout.checkpoint(10)) or {})["rows_bytes"])
    at_5 = int((read_checkpoint_state(layout.checkpoint(5)) or {})["rows_bytes"])

    result = rollback_line(line, 10)
    assert result.rows_kept is not None and result.rows_kept.name.startswith(ROLLED_BACK_ROWS_PREFIX)
    kept = result.rows_kept.read_bytes()
    assert kept == original[at_10:] and len(kept) == len(original) - at_10  # the rows after update 10 only
    updates = [json.loads(text)["update"] for text in original.splitlines()]
    assert [json.loads(text)["update"] for text in kept.splitlines()] == [update for update in updates if update > 10]
    assert layout.rows_jsonl.read_bytes() + kept == original  # nothing is lost
    assert not list(line.glob(f".{ROLLED_BACK_ROWS_PREFIX}*"))  # no partial copy left

    # From the command line, further back: this copy holds what rows.jsonl had past update 5.
    assert cli_main(["rollback", str(line), "--to", "5"]) == 0
    [newest] = sorted(set(line.glob(f"{ROLLED_BACK_ROWS_PREFIX}*.jsonl")) - {line / OLD_COPY, result.rows_kept})
    assert newest.read_bytes() == original[at_5:at_10]
    assert f"the rows set aside (those after update 5): {newest}" in capsys.readouterr().out
    assert layout.rows_jsonl.read_bytes() + newest.read_bytes() + kept == original
    assert (line / OLD_COPY).read_bytes() == original  # untouched

    # The readers: the times in the names, the old copy's and the new ones' alike.
    times = rollback_times(layout)
    assert len(times) == 3 and times[0] == 1704067200.0
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (line / "supervisor.json").write_text(json.dumps({"pid": int(dead.stdout), "state": "stopped"}))
    resting = read_at_rest(line)
    assert resting is not None and resting.supervisor["rollbacks"] == times
    view = LineView("line", line)
    view.apply_rest(resting.supervisor, resting.heartbeat, resting.rows, times[-1] + 60)
    named = [event.message.split("kept in ")[1].rstrip(")") for event in view.events if event.kind == "rolled_back"]
    assert len(named) == 3 and all((line / name).is_file() for name in named)
