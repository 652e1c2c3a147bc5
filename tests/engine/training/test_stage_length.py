"""A begun stage keeps its `seq_len`: `check` and the trainer's start refuse run.json changing it.

Found in a README walk: README said only the plan's later stages change freely, but `check`
passed a changed length of the stage in progress, and the trainer resumed at the checkpoint's
sample count in the new length's sample order (stopped at sample 48 of cycle 0 at 32, it went on
from sample 48 at 64), training some of the cycle's targets twice and others never, silently.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers.lines import SEQ_LEN, TOKENS_PER_UPDATE, copy_data_line, data_template_fixture, make_line

from engine.checkpoints.format import read_latest
from engine.config.run import RunConfig, stage_length_change
from engine.errors import ConfigError
from engine.ops.check import check_line
from engine.ops.stop import request_stop
from engine.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread

data_template = data_template_fixture()

LONG = 2 * SEQ_LEN
"""A second length the test data lines have held-out rows of."""

LENGTHS = [{"seq_len": SEQ_LEN, "micro_batch_rows": 8}, {"seq_len": LONG, "micro_batch_rows": 4}]


def run(line: Path, stop_at: int | None = None) -> int:
    return Trainer(line, stop_at=stop_at, echo=None).run()


def edit_plan(line: Path, plan: list[dict[str, Any]]) -> None:
    document = json.loads((line / "run.json").read_text())
    document["plan"] = plan
    (line / "run.json").write_text(json.dumps(document))


def lifelong_failures(line: Path) -> list[str]:
    _config, results = check_line(line, verify_checkpoints=False)
    return [result.message for result in results if not result.ok]


def refusal(stage: int, name: str, old: int, new: int) -> str:
    return (f"run.json: plan[{stage}].seq_len changed from {old} to {new}, but the line stands in stage {name}, "
            f"begun at {old} (its checkpoint counts the cycle's samples at that length; a begun stage keeps its "
            f"length): set it back to {old}; to train at {new}, end stage {name} (plan[{stage}].tokens) and add "
            f"a stage at {new} after it, or branch the line (`nsconsole branch`)")  # fmt: skip


def test_the_stage_in_progress_keeps_its_length_mid_cycle(tmp_path: Path, data_template: Path) -> None:
    line = make_line(tmp_path, copy_data_line(data_template, tmp_path), lengths=LENGTHS)
    assert run(line, stop_at=3) == 0  # cycle 0, sample 48 at T32
    rows = (line / "rows.jsonl").read_bytes()
    edit_plan(line, [{"name": "trunk", "seq_len": LONG, "tokens": None}])
    assert lifelong_failures(line) == [refusal(0, "trunk", SEQ_LEN, LONG)]
    with pytest.raises(ConfigError) as refused:
        run(line)
    assert str(refused.value) == refusal(0, "trunk", SEQ_LEN, LONG)
    # Refused before anything trained or was accepted.
    assert (line / "rows.jsonl").read_bytes() == rows and read_latest(line / "checkpoints") == "u00000003"
    assert RunConfig.load(line / "accepted_run.json").plan[0].seq_len == SEQ_LEN
    # The way the refusal names: end the stage and train the new length in a stage after it.
    edit_plan(line, [{"name": "trunk", "seq_len": SEQ_LEN, "tokens": 3 * TOKENS_PER_UPDATE},
                     {"name": "long", "seq_len": LONG, "tokens": None}])  # fmt: skip
    assert lifelong_failures(line) == []
    assert run(line, stop_at=4) == 0
    assert "stage trunk done at update 3" in (line / "run.log").read_text()


def test_a_stage_begun_at_a_cycle_s_end_is_refused_too(tmp_path: Path, data_template: Path) -> None:
    # Nothing of the new cycle is read, but the stage would change its length in its middle,
    # against the plan it was accepted with: only the plan's later stages change freely.
    line = make_line(tmp_path, copy_data_line(data_template, tmp_path), lengths=LENGTHS)
    request_stop(line, at_cycle_end=0)
    assert run(line) == 0
    edit_plan(line, [{"name": "trunk", "seq_len": LONG, "tokens": None}])
    assert lifelong_failures(line) == [refusal(0, "trunk", SEQ_LEN, LONG)]


def test_a_stage_not_begun_changes_freely(tmp_path: Path, data_template: Path) -> None:
    plan = [{"name": "trunk", "seq_len": SEQ_LEN, "tokens": 3 * TOKENS_PER_UPDATE},
            {"name": "long", "seq_len": LONG, "tokens": None}]  # fmt: skip
    line = make_line(tmp_path, copy_data_line(data_template, tmp_path), lengths=LENGTHS, plan=plan)
    assert run(line, stop_at=3) == 0  # the trunk's end: the line stands at the start of stage long
    plan[1]["seq_len"] = SEQ_LEN
    edit_plan(line, plan)
    assert lifelong_failures(line) == []
    assert run(line, stop_at=4) == 0


def test_the_length_compared_is_the_checkpoint_s_record_mid_cycle() -> None:
    document = {"model": {"preset": "transformer-tiny"}, "data": {"line": "d"},
                "lengths": [{"seq_len": 32}, {"seq_len": 64}],
                "plan": [{"name": "trunk", "seq_len": 32, "tokens": 1e6}, {"name": "long", "seq_len": 64}]}  # fmt: skip
    accepted = RunConfig.from_dict(document)
    document["plan"][1]["seq_len"] = 32
    current = RunConfig.from_dict(document)
    # Mid-cycle the checkpoint says what the cycle was read at, accepted_run.json or not.
    assert "plan[1].seq_len changed from 64 to 32" in (stage_length_change(current, None, 1, 640, 20, 64) or "")
    assert stage_length_change(current, None, 1, 640, 20, 32) is None
    # At a cycle's end: accepted_run.json's length of the begun stage.
    assert "changed from 64 to 32" in (stage_length_change(current, accepted, 1, 640, 0, None) or "")
    # Not begun (the trunk's end), or past the plan's end: free.
    assert stage_length_change(current, accepted, 1, 0, 0, 64) is None
    assert stage_length_change(current, accepted, 2, 640, 0, None) is None
    # A stage begun inside a cycle at the same length as the last goes on at its sample count.
    assert "changed from 64 to 32" in (stage_length_change(current, accepted, 1, 0, 30, 64) or "")
