"""A trainer meets a damaged shard in the cycle it trains (issue 25, item 12): at a start (a resume
mid-cycle) it waits for the preparer to rebuild the cycle instead of failing every start, and a
shard rewritten in place while the cycle is open is not trained on. Either way the line goes on
once the cycle is rebuilt from its manifest, and its record equals an uninterrupted line's.
`nsconsole check` refuses what no start can train on in that cycle."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from helpers.lines import copy_data_line, data_template_fixture, make_line, rows_without_wall_clock

from datalines import open_data_line
from datalines.cycle import Cycle
from datalines.preparer import rebuild_cycle
from engine.ops.check import CheckResult, check_line
from engine.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread

data_template = data_template_fixture()  # every cycle prepared

STOP_AT = 8


def _damage_in_place(path: Path) -> None:
    with open(path, "r+b") as handle:
        handle.seek(path.stat().st_size // 3)
        byte = handle.read(1)
        handle.seek(-1, 1)
        handle.write(bytes([byte[0] ^ 0xFF]))


def _tokens_file(data: Path, index: int) -> Path:
    return sorted((data / "cycles" / f"c{index:04d}").glob("*.tokens"))[0]


def _run_rebuilding_when_it_waits(trainer: Trainer, data: Path) -> None:
    """Run the trainer in a thread; when it waits for its cycle, rebuild the cycle as the preparer does."""
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(trainer.run()))
    thread.start()
    heartbeat = trainer.layout.heartbeat
    deadline = time.monotonic() + 300
    while True:
        assert thread.is_alive() or result, "the trainer ended with an error"
        assert not result, f"the trainer ended ({result}) without waiting for the damaged cycle"
        assert time.monotonic() < deadline, "the trainer never waited for its cycle"
        try:
            beat = json.loads(heartbeat.read_text())
        except (OSError, ValueError):
            beat = {}
        if beat.get("stage") == "waiting-data" and beat.get("cycle") == 0:
            break
        time.sleep(0.05)
    rebuild_cycle(open_data_line(data), 0)
    thread.join(timeout=300)
    assert result == [0]


def _reference_rows(tmp_path: Path, data_template: Path) -> list[dict]:
    (tmp_path / "reference").mkdir()
    reference = make_line(tmp_path / "reference", copy_data_line(data_template, tmp_path / "reference"))
    assert Trainer(reference, stop_at=STOP_AT, echo=None).run() == 0
    return rows_without_wall_clock(reference / "rows.jsonl")


def test_a_resume_into_a_damaged_cycle_waits_for_its_rebuild(tmp_path: Path, data_template: Path) -> None:
    data = copy_data_line(data_template, tmp_path)
    line = make_line(tmp_path, data)
    assert Trainer(line, stop_at=3, echo=None).run() == 0  # mid-cycle 0: its checkpoint names its manifest
    _damage_in_place(_tokens_file(data, 0))

    _run_rebuilding_when_it_waits(Trainer(line, stop_at=STOP_AT, echo=None), data)
    log = (line / "run.log").read_text()
    assert "waiting for data cycle 0 (" in log and "differs from the manifest (corrupted)" in log
    assert rows_without_wall_clock(line / "rows.jsonl") == _reference_rows(tmp_path, data_template)


def test_a_shard_rewritten_in_place_mid_cycle_is_not_trained_on(
    tmp_path: Path, data_template: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = copy_data_line(data_template, tmp_path)
    line = make_line(tmp_path, data)
    real_samples = Cycle.samples
    calls: list[int] = []

    def samples_damaged_at_the_fourth(self: Cycle, *args: object) -> object:
        calls.append(self.index)
        if len(calls) == 4:  # another writer overwrites the open cycle's shard, just before a read
            _damage_in_place(_tokens_file(data, self.index))
        return real_samples(self, *args)

    monkeypatch.setattr(Cycle, "samples", samples_damaged_at_the_fourth)
    _run_rebuilding_when_it_waits(Trainer(line, stop_at=STOP_AT, echo=None), data)
    monkeypatch.undo()
    log = (line / "run.log").read_text()
    assert "it changed while cycle 0 was open: update 4 not trained" in log
    assert rows_without_wall_clock(line / "rows.jsonl") == _reference_rows(tmp_path, data_template)


def test_check_refuses_what_the_trainer_cannot_train_on_in_the_current_cycle(
    tmp_path: Path, data_template: Path
) -> None:
    data = copy_data_line(data_template, tmp_path)
    line = make_line(tmp_path, data)
    assert Trainer(line, stop_at=3, echo=None).run() == 0

    def current_cycle() -> CheckResult:
        _config, results = check_line(line, verify_checkpoints=False)
        (result,) = [result for result in results if result.message.startswith("current data cycle")]
        return result

    assert current_cycle() == CheckResult(True, "current data cycle: 0, every shard matches its manifest")
    shard = _tokens_file(data, 0)
    good = shard.read_bytes()
    _damage_in_place(shard)
    refused = current_cycle()
    assert not refused.ok and "differs from the manifest (corrupted)" in refused.message
    assert f"nsconsole data rebuild --work {data} --cycle 0" in refused.message
    shard.write_bytes(good)

    manifest = data / "cycles" / "c0000" / "manifest.json"
    document = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**document, "start_tokens": 1}))  # a valid manifest, not the one trained on
    refused = current_cycle()
    assert not refused.ok and "(the data line changed); the trainer refuses to resume" in refused.message
    manifest.write_text("{")
    refused = current_cycle()
    assert not refused.ok and f"{manifest}: not valid JSON" in refused.message
    manifest.unlink()
    manifest.mkdir()  # a directory in its place: damage, not a cycle still to prepare (`run` refuses it)
    refused = current_cycle()
    assert not refused.ok and f"{manifest}: a directory, not the cycle's manifest" in refused.message
