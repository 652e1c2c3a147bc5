"""A checkpoint that ends a plan stage and a data cycle at one update keeps both meanings.

Before, the trainer wrote the stage end's checkpoint and then the cycle end's over it: its `kept`
was `cycle-end N` alone, so `checkpoints.keep_cycle_ends` removed the checkpoint that ends a stage
(kept for good) once N more cycles had ended. Now one checkpoint is written, kept as both
(`["stage-end trunk", "cycle-end 0"]`): retention keeps it as the stage's end, and whatever looks
for the cycle's end (a branch, the supervisor's fork queue, the console) still finds it there.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.lines import SEQ_LEN, copy_data_line, data_template_fixture, make_line

from datalines import open_data_line
from engine.checkpoints.format import (
    apply_retention,
    checkpoint_name,
    cycle_of_kept,
    kept_reasons,
    kept_text,
    list_checkpoints,
    read_checkpoint_state,
    write_latest,
)
from engine.config.run import RunConfig
from engine.layout import LineLayout
from engine.ops.branch import BranchRequest, branch_line, find_cycle_end
from engine.ops.fork_point import kept_cycle_ends
from engine.supervisor.forks import cycle_end_checkpoint
from engine.training.trainer import Trainer
from nsconsole.widgets.checkpoint_list import read_checkpoints

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread

data_template = data_template_fixture(files=4)  # cycles 0, 1 and 2


def test_a_stage_ending_on_a_cycle_end_outlives_keep_cycle_ends_and_is_still_a_fork_point(
    data_template: Path, tmp_path: Path
) -> None:
    data = copy_data_line(data_template, tmp_path)
    cycle_zero = open_data_line(data).cycle(0).num_samples(SEQ_LEN, 0) * SEQ_LEN  # its tokens, whole rows
    plan = [{"name": "trunk", "seq_len": SEQ_LEN, "tokens": cycle_zero}, {"name": "rest", "seq_len": SEQ_LEN, "tokens": None}]
    line = make_line(tmp_path, data, plan=plan, **{"checkpoints.keep_cycle_ends": 1, "wandb.mode": "disabled"})
    assert Trainer(line, echo=None).run() == 0  # to the data line's end: cycles 1 and 2 end after it
    layout = LineLayout(line)

    states = {directory.name: read_checkpoint_state(directory) or {} for directory in list_checkpoints(layout.checkpoints)}
    [fork] = [name for name, state in states.items() if cycle_of_kept(state.get("kept")) == 0]
    assert states[fork]["kept"] == ["stage-end trunk", "cycle-end 0"]  # one checkpoint, both reasons
    assert states[fork]["position"]["stage"] == 1 and states[fork]["position"]["cycle"] == 1
    # keep_cycle_ends 1: of the cycle ends alone only the newest stays; the stage's end stays too.
    assert sorted(cycle_of_kept(state.get("kept")) for state in states.values() if cycle_of_kept(state.get("kept")) is not None) == [0, 2]
    keep_last = RunConfig.load(layout.run_json).checkpoints.keep_last
    assert apply_retention(layout.checkpoints, keep_last=keep_last, keep_cycle_ends=1) == []  # and stays

    # Everything that looks for cycle 0's end finds it.
    assert find_cycle_end(layout, 0) == layout.checkpoints / fork
    assert cycle_end_checkpoint(layout, 0) == layout.checkpoints / fork
    assert kept_cycle_ends(layout).startswith("it keeps the ends of cycles 0, 2 ")
    shown = {info.name: info.kept for info in read_checkpoints(line)}
    assert shown[fork] == "stage-end trunk, cycle-end 0"

    # A branch at cycle 0 forks there and trains.
    request = BranchRequest(tmp_path / "b", line, 0, "decay:1024", copy_data_line(data_template, tmp_path / "bdata"))
    result = branch_line(request)
    assert checkpoint_name(result.fork_update) == fork
    assert Trainer(tmp_path / "b", stop_at=result.fork_update + 2, echo=None).run() == 0
    rows = [json.loads(text) for text in (tmp_path / "b" / "rows.jsonl").read_text().splitlines()]
    assert [row["update"] for row in rows] == [result.fork_update + 1, result.fork_update + 2]


def test_retention_reads_one_reason_or_several(tmp_path: Path) -> None:
    """Checkpoints written before (`kept` one string) read as they did; a stage and cycle end (a list)
    is kept for good; a `kept` of neither shape is kept too (nothing is removed for a value not
    understood)."""
    checkpoints = tmp_path / "checkpoints"
    kepts = {1: "line-start", 2: "cycle-end 0", 3: ["stage-end trunk", "cycle-end 1"], 4: "cycle-end 2",
             5: {"odd": 1}, 6: None, 7: "cycle-end 3", 8: None}  # fmt: skip
    for update, kept in kepts.items():
        directory = checkpoints / checkpoint_name(update)
        directory.mkdir(parents=True)
        (directory / "state.json").write_text(json.dumps({"update": update, "kept": kept}))
    write_latest(checkpoints, checkpoint_name(8))
    assert sorted(apply_retention(checkpoints, keep_last=1, keep_cycle_ends=1)) == ["u00000002", "u00000004", "u00000006"]
    assert [cycle_of_kept(kepts[update]) for update in (1, 2, 3, 5, 6)] == [None, 0, 1, None, None]
    assert kept_reasons("cycle-end 2") == ("cycle-end 2",) and kept_reasons(["a", 3]) == ()
    assert kept_text(kepts[3]) == "stage-end trunk, cycle-end 1" and kept_text(None) is None
