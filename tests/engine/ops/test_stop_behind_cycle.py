"""`--at-cycle-end N` for a cycle the line has left behind is refused: the trainer took it as a stop
at the next update, mid-cycle (found in a walkthrough of an unattended line). The trainer's beats
name the cycle it trains, which the refusal reads: each update's beat and, since a validation or a
checkpoint is the line's last beat for minutes, each phase's beat too."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from helpers.lines import copy_data_line, data_template_fixture, make_data_line, make_line, one_torch_thread

from engine.checkpoints.format import read_latest
from engine.errors import LineError
from engine.ops.stop import request_stop
from engine.protocol.facts import Stage
from engine.rows import Heartbeat
from engine.supervisor.reads import read_json
from engine.training import data_cycles
from engine.training.optim import FlatAdamW
from engine.training.trainer import Trainer
from engine.training.validation import Validator

data_template = data_template_fixture(prepare=3)


@dataclass
class TrainedLine:
    """A line trained past two cycle ends, with every beat its trainer wrote and the stops tried
    from inside its validations and checkpoints."""

    root: Path
    cycles: dict[int, int]
    """Each update's cycle, as its row says; update 0 (the line's start, no row) in cycle 0."""
    beats: list[tuple[int, str, dict[str, Any]]] = field(default_factory=list)
    """(update, stage, details) of every beat."""
    tried: list[tuple[str, int, int]] = field(default_factory=list)
    """(stage, update, cycle) of the phase beat that was the line's last when stops were tried."""


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, data_template: Path) -> Iterator[TrainedLine]:
    root = tmp_path_factory.mktemp("trained")
    line = make_line(root, copy_data_line(data_template, root), **{"validation.every_updates": 4})
    trained = TrainedLine(line, {})

    def try_stops() -> None:
        """In the trainer's own thread, inside a phase: the phase's beat is the line's last."""
        beat = json.loads((line / "heartbeat").read_text())
        if beat["cycle"] >= 1:
            with pytest.raises(LineError, match=f"cycle {beat['cycle'] - 1} has ended"):
                request_stop(line, at_cycle_end=beat["cycle"] - 1)
            assert not (line / "STOP").exists()
        # The end of the cycle it names is ahead, or where it stands: taken (and taken back: it goes on).
        assert request_stop(line, at_cycle_end=beat["cycle"]).at_cycle_end == beat["cycle"]
        (line / "STOP").unlink()
        trained.tried.append((beat["stage"], beat["update"], beat["cycle"]))

    def recorded(self: Heartbeat, update: int, stage: str, **details: Any) -> None:
        trained.beats.append((update, stage, details))
        real_beat(self, update, stage, **details)

    def validating(self: Validator, *args: Any, **kwargs: Any) -> Any:
        try_stops()
        return validate(self, *args, **kwargs)

    def checkpointing(self: FlatAdamW) -> Any:
        try_stops()
        return host_state(self)

    real_beat, validate, host_state = Heartbeat.beat, Validator.run, FlatAdamW.host_state
    with pytest.MonkeyPatch.context() as patch, one_torch_thread():
        patch.setattr(Heartbeat, "beat", recorded)
        patch.setattr(Validator, "run", validating)
        patch.setattr(FlatAdamW, "host_state", checkpointing)
        assert Trainer(line, stop_at=25, echo=None).run() == 0
    rows = map(json.loads, (line / "rows.jsonl").read_text().splitlines())
    trained.cycles = {0: 0} | {row["update"]: row["cycle"] for row in rows}
    assert len(set(trained.cycles.values())) >= 3  # two cycle ends passed
    yield trained


def test_every_beat_names_the_cycle_of_its_update(trained: TrainedLine) -> None:
    # Updates', phases' and the `training` beat after a phase alike; a wait for data names the cycle
    # it waits for, and the last beat (stopped) none.
    named = [(update, stage, details) for update, stage, details in trained.beats
             if stage not in (Stage.WAITING_DATA, Stage.STOPPED)]  # fmt: skip
    assert {stage for _, stage, _ in named} >= {Stage.TRAINING, Stage.VALIDATING, Stage.CHECKPOINTING}
    assert [details["cycle"] for _, _, details in named] == [trained.cycles[update] for update, _, _ in named]
    assert trained.beats[-1][1] == Stage.STOPPED and "cycle" not in trained.beats[-1][2]


def test_a_stop_for_a_passed_cycle_is_refused_while_a_validation_or_a_checkpoint_beats(
    trained: TrainedLine,
) -> None:
    # (try_stops, inside each phase: the cycle before the one the beat names refused, that one taken.)
    past_the_first = {stage for stage, _, cycle in trained.tried if cycle >= 1}
    assert past_the_first >= {Stage.VALIDATING, Stage.CHECKPOINTING}
    # A cycle's end checkpoint, taken after the line moved to the next cycle, still names the cycle
    # that ended: a stop at its end, asked now, stops the line exactly there and is not refused.
    cycles = trained.cycles
    ends = {update: cycle for update, cycle in cycles.items() if cycles.get(update + 1, cycle) > cycle}
    assert len(ends) >= 2
    assert all((Stage.CHECKPOINTING, update, cycle) in trained.tried for update, cycle in ends.items())


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
    # Waiting for cycle 2's data, the line stands at cycle 1's end: that end is taken, and the refusal
    # of cycle 0's says so (it said "the line trains cycle 2" and offered only cycle 2's end).
    Heartbeat(line / "heartbeat").beat(21, Stage.WAITING_DATA, cycle=2)
    with pytest.raises(LineError) as refused:
        request_stop(line, at_cycle_end=0)
    assert str(refused.value) == (
        f"{line}: cycle 0 has ended (the line waits for data of cycle 2, at the end of cycle 1); no STOP written: "
        "`--at-cycle-end 1` or no --at-cycle-end stops it there, `--at-cycle-end 2` at the end of the cycle it waits for"
    )
    assert request_stop(line, at_cycle_end=1).at_cycle_end == 1
    # A beat naming no cycle (an older trainer's, or one waiting with none yet) refuses nothing.
    Heartbeat(line / "heartbeat").beat(21, Stage.VALIDATING, phase_began=0.0)
    assert request_stop(line, at_cycle_end=0).at_cycle_end == 0


def test_a_line_waiting_for_the_next_cycle_stops_at_the_end_of_the_one_it_finished(tmp_path: Path) -> None:
    """Waiting for cycle 1 (the beat names it), the line stands at cycle 0's end: `--at-cycle-end 0`
    is taken, not refused, and stops it there, with nothing of cycle 1 trained."""
    line = make_line(tmp_path, make_data_line(tmp_path, prepare=1))
    outcome: list[int] = []
    with pytest.MonkeyPatch.context() as patch, one_torch_thread():
        patch.setattr(data_cycles, "WAIT_POLL_SECONDS", 0.05)
        thread = threading.Thread(target=lambda: outcome.append(Trainer(line, echo=None).run()))
        thread.start()
        deadline = time.monotonic() + 120
        while (beat := read_json(line / "heartbeat") or {}).get("stage") != Stage.WAITING_DATA:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.02)
        assert beat["cycle"] == 1
        with pytest.raises(LineError, match="cycle -1|must be a cycle index"):
            request_stop(line, at_cycle_end=-1)
        assert request_stop(line, at_cycle_end=0).at_cycle_end == 0
        thread.join(timeout=60)
    assert outcome == [0] and not (line / "STOP").exists()
    rows = [json.loads(row) for row in (line / "rows.jsonl").read_text().splitlines()]
    assert {row["cycle"] for row in rows} == {0}
    assert read_latest(line / "checkpoints") == f"u{rows[-1]['update']:08d}"
    log = (line / "run.log").read_text().splitlines()
    assert "stopped" in log[-1]
    # Nothing prepares cycle 1 (no supervisor, no preparer): the wait says what would.
    data = tmp_path / "data"
    [waiting] = [text for text in log if "waiting for data cycle" in text]
    assert "trainer: waiting for data cycle 1 (" in waiting and waiting.endswith(
        f"; no data preparer runs on {data} now: `nsconsole data run-preparer --work {data}` makes it (a line "
        "run under its supervisor has one)"
    )
