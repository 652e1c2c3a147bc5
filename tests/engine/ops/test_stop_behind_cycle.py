"""`--at-cycle-end N` for a cycle the line has left behind is refused: the trainer took it as a stop
at the next update, mid-cycle (found in a walkthrough of an unattended line). The trainer's beats
name the cycle it trains, which the refusal reads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers.lines import copy_data_line, data_template_fixture, make_line

from engine.errors import LineError
from engine.ops.stop import request_stop
from engine.protocol.facts import Stage
from engine.rows import Heartbeat
from engine.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

data_template = data_template_fixture(prepare=3)


def test_the_trainers_beats_name_the_cycle_it_trains(
    tmp_path: Path, data_template: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    beats: list[tuple[int, str, dict[str, Any]]] = []
    real_beat = Heartbeat.beat

    def recorded(self: Heartbeat, update: int, stage: str, **details: Any) -> None:
        beats.append((update, stage, details))
        real_beat(self, update, stage, **details)

    monkeypatch.setattr(Heartbeat, "beat", recorded)
    line = make_line(tmp_path, copy_data_line(data_template, tmp_path))
    assert Trainer(line, stop_at=25, echo=None).run() == 0
    rows = {row["update"]: row["cycle"] for row in map(json.loads, (line / "rows.jsonl").read_text().splitlines())}
    # Each update's own beat names its cycle (a phase's end beats `training` again without one).
    training = {update: details["cycle"] for update, stage, details in beats if stage == Stage.TRAINING and details}
    assert training == rows and len(set(rows.values())) >= 2


def test_a_stop_at_the_end_of_a_cycle_behind_the_line_is_refused(tmp_path: Path, data_template: Path) -> None:
    line = make_line(tmp_path, copy_data_line(data_template, tmp_path))
    Heartbeat(line / "heartbeat").beat(21, Stage.TRAINING, cycle=2)
    with pytest.raises(LineError) as refused:
        request_stop(line, at_cycle_end=1)
    assert str(refused.value) == (
        f"{line}: cycle 1 has ended (the line trains cycle 2); no STOP written: `--at-cycle-end 2` stops at the end "
        "of the cycle it trains, no --at-cycle-end at the next update"
    )
    assert not (line / "STOP").exists()
    assert request_stop(line, at_cycle_end=2).at_cycle_end == 2 and (line / "STOP").exists()
    assert request_stop(line).at_cycle_end is None
