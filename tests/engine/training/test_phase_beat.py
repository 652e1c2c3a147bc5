"""Heartbeats through long phases: a slowed validation keeps beating `validating`, nested phases, the
limit, the cycle each beat names."""

from __future__ import annotations

import functools
import json
import threading
import time
from pathlib import Path

import pytest
from helpers.lines import copy_data_line, data_template_fixture, make_line

from engine.rows import Heartbeat
from engine.training import trainer as trainer_module
from engine.training.phase_beat import PhaseBeats
from engine.training.trainer import Trainer
from engine.training.validation import Validator

pytestmark = pytest.mark.usefixtures("one_thread")

data_template = data_template_fixture()


class HeartbeatWatch:
    """Reads the heartbeat file every few ms from a thread; keeps every distinct beat seen."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seen: list[dict] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._done.is_set():
            try:
                beat = json.loads(self.path.read_text())
            except (OSError, ValueError):
                beat = None
            if beat is not None and (not self.seen or beat != self.seen[-1]):
                self.seen.append(beat)
            time.sleep(0.005)

    def __enter__(self) -> HeartbeatWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    def stages(self) -> list[str]:
        return [beat["stage"] for beat in self.seen]


def test_a_phase_beats_until_it_ends_and_nested_phases_beat_the_innermost(tmp_path: Path) -> None:
    cycle = [2]
    beats = PhaseBeats(Heartbeat(tmp_path / "heartbeat"), "training", lambda: cycle[0], interval_s=0.02)
    with HeartbeatWatch(tmp_path / "heartbeat") as watch:
        with beats.phase("capturing", 7, seq_len=64):
            time.sleep(0.15)
            with beats.phase("probing", 7):
                time.sleep(0.15)
            time.sleep(0.1)
            cycle[0] = 3  # (the trainer's position moved on under the phase)
            time.sleep(0.1)
        time.sleep(0.1)
    stages = watch.stages()
    assert stages.count("capturing") >= 4 and stages.count("probing") >= 4
    first_probe = stages.index("probing")
    last_probe = len(stages) - 1 - stages[::-1].index("probing")
    assert set(stages[first_probe : last_probe + 1]) == {"probing"}  # the outer phase is silent meanwhile
    assert stages[last_probe + 1] == "capturing"  # and says so at once when the inner one ends
    assert stages[-1] == "training"  # and the outermost's end at once: no stage outlives its phase
    assert all(beat["update"] == 7 for beat in watch.seen)
    assert len({beat["phase_began"] for beat in watch.seen if beat["stage"] == "capturing"}) == 1
    assert watch.seen[0]["seq_len"] == 64
    # Every beat names the cycle as it is when it beats (`nsconsole stop --at-cycle-end` reads it).
    cycles = [beat["cycle"] for beat in watch.seen]
    assert cycles[0] == 2 and cycles[-1] == 3 and cycles == sorted(cycles)


def test_a_phase_past_its_limit_stops_beating(tmp_path: Path) -> None:
    beats = PhaseBeats(Heartbeat(tmp_path / "heartbeat"), "training", lambda: 0, interval_s=0.02, limit_s=0.1)
    with beats.phase("validating", 3):
        time.sleep(0.4)
        last = json.loads((tmp_path / "heartbeat").read_text())["time"]
        assert time.time() - last >= 0.2  # hung for the watchdog to see


def test_a_slow_validation_keeps_the_heartbeat_fresh(
    tmp_path: Path, data_template: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    line = make_line(tmp_path, copy_data_line(data_template, tmp_path), **{"validation.every_updates": 2})
    monkeypatch.setattr(trainer_module, "PhaseBeats", functools.partial(PhaseBeats, interval_s=0.05))
    validate = Validator.run

    def slow_validation(self: Validator, *args: object, **kwargs: object) -> dict[str, float]:
        time.sleep(1.0)  # a 2B line's long rows, in miniature
        return validate(self, *args, **kwargs)

    monkeypatch.setattr(Validator, "run", slow_validation)
    with HeartbeatWatch(line / "heartbeat") as watch:
        assert Trainer(line, stop_at=2, echo=None).run() == 0
    validating = [beat for beat in watch.seen if beat["stage"] == "validating"]
    assert len(validating) >= 5  # one beat at its start was all there was: silent for its whole length
    assert watch.stages()[-1] == "stopped"
