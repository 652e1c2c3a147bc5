"""The training loop on real tiny lines: cycles, ramp, weight decay, stops, fallback, refusals, waiting."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers.lines import (
    SEQ_LEN,
    TOKENS_PER_UPDATE,
    copy_data_line,
    data_template_fixture,
    make_data_line,
    make_line,
    rows_without_wall_clock,
)

from datalines import open_data_line
from datalines.preparer import prepare_cycle
from engine.checkpoints.format import read_latest, verify_line_checkpoints
from engine.checkpoints.tensors import load_checkpoint
from engine.config.run import RunConfig
from engine.errors import CheckpointError, ConfigError, LineError
from engine.ops.stop import request_stop
from engine.training import data_cycles as data_cycles_module
from engine.training import trainer as trainer_module
from engine.training.schedule import learning_rate, tokens_per_update, update_weight_decay
from engine.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread


data_template = data_template_fixture()


@pytest.fixture
def line(tmp_path: Path, data_template: Path) -> Path:
    return make_line(tmp_path, copy_data_line(data_template, tmp_path))


def run(line: Path, stop_at: int | None = None) -> int:
    return Trainer(line, stop_at=stop_at, echo=None).run()


def read_rows(line: Path) -> list[dict]:
    return rows_without_wall_clock(line / "rows.jsonl")


def test_line_trains_to_the_data_end_with_kept_cycle_ends(line: Path) -> None:
    config = RunConfig.load(line / "run.json")
    data = open_data_line(config.data.line)
    last = data.last_cycle()
    cycle_samples = {index: data.cycle(index).num_samples(SEQ_LEN) for index in range(last + 1)}
    assert run(line) == 0
    rows = read_rows(line)
    assert [row["update"] for row in rows] == list(range(1, len(rows) + 1))
    assert all(data.is_consumed(index) for index in range(last + 1))
    # Updates never span a cycle end: each cycle's updates take exactly its samples.
    per_cycle: dict[int, int] = {}
    for row in rows:
        per_cycle[row["cycle"]] = per_cycle.get(row["cycle"], 0) + row["tokens_per_update"] // SEQ_LEN
        assert row["tokens_per_update"] <= TOKENS_PER_UPDATE
    assert per_cycle == cycle_samples
    assert verify_line_checkpoints(line) == []
    kept = sorted(
        (load_checkpoint(path).state["kept"], path.name)
        for path in (line / "checkpoints").iterdir()
        if path.is_dir() and load_checkpoint(path).state["kept"]
    )
    expected = ["line-start"] + [f"cycle-end {index}" for index in range(last + 1)]
    assert [reason for reason, _ in kept] == sorted(expected)
    assert read_latest(line / "checkpoints") == f"u{len(rows):08d}"
    heartbeat = json.loads((line / "heartbeat").read_text())
    assert heartbeat["stage"] == "stopped" and heartbeat["update"] == len(rows)
    assert "the data line has ended" in (line / "run.log").read_text()
    assert rows[-1]["loss"] < rows[0]["loss"]  # it learns


def test_ramp_weight_decay_and_rate_follow_run_json(tmp_path: Path, data_template: Path) -> None:
    ramp = [{"from": 0, "to": 7000, "tokens": 8 * SEQ_LEN}, {"from": 7000, "to": None, "tokens": 12 * SEQ_LEN}]
    line = make_line(
        tmp_path,
        copy_data_line(data_template, tmp_path),
        tokens_per_update=ramp,
        **{"optimizer.weight_decay_batch": 8 * SEQ_LEN, "optimizer.weight_decay": 0.2},
    )
    config = RunConfig.load(line / "run.json")
    data = open_data_line(config.data.line)
    cycle_samples = [data.cycle(index).num_samples(SEQ_LEN) for index in range(data.last_cycle() + 1)]
    assert run(line, stop_at=40) == 0
    tokens_trained = 0
    cycle, sample = 0, 0
    for row in read_rows(line):
        assert row["cycle"] == cycle
        samples = cycle_samples[cycle]
        wanted = tokens_per_update(config, data.cycle_start_tokens(cycle) + sample * SEQ_LEN)
        assert row["tokens_per_update"] == min(wanted, (samples - sample) * SEQ_LEN)
        assert row["weight_decay"] == pytest.approx(update_weight_decay(config, row["tokens_per_update"]))
        assert row["lr"] == learning_rate(config, tokens_trained)
        tokens_trained += row["tokens_per_update"]
        sample += row["tokens_per_update"] // SEQ_LEN
        if sample == samples:  # this update ended its cycle
            cycle, sample = cycle + 1, 0
    assert {row["tokens_per_update"] for row in read_rows(line)} >= {8 * SEQ_LEN, 12 * SEQ_LEN}


def test_stop_at_cycle_end_and_stop_file(line: Path) -> None:
    request_stop(line, at_cycle_end=0)
    assert run(line) == 0
    assert not (line / "STOP").exists()
    latest = load_checkpoint(line / "checkpoints" / read_latest(line / "checkpoints"))
    assert latest.state["kept"] == "cycle-end 0"
    assert latest.state["position"]["cycle"] == 1 and latest.state["position"]["sample"] == 0
    stopped_at = latest.update

    for request in (None, 0):  # at the next update boundary, or a cycle end already passed: at once
        request_stop(line, at_cycle_end=request)
        assert run(line) == 0
        assert not (line / "STOP").exists()
        assert read_latest(line / "checkpoints") == f"u{stopped_at:08d}"

    assert run(line, stop_at=stopped_at + 3) == 0
    assert read_latest(line / "checkpoints") == f"u{stopped_at + 3:08d}"
    assert len(read_rows(line)) == stopped_at + 3


def test_corrupted_latest_falls_back_and_replays_identically(
    tmp_path: Path, data_template: Path, line: Path
) -> None:
    reference = make_line(tmp_path / "reference", copy_data_line(data_template, tmp_path / "reference"))
    assert run(reference, stop_at=14) == 0

    assert run(line, stop_at=12) == 0
    weights = line / "checkpoints" / "u00000012" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert run(line, stop_at=14) == 0
    log = (line / "run.log").read_text()
    assert "skipped a bad checkpoint" in log and "u00000012/model.safetensors" in log
    assert "resumed from u00000010" in log
    assert read_rows(line) == read_rows(reference)
    mine = load_checkpoint(line / "checkpoints" / "u00000014")
    theirs = load_checkpoint(reference / "checkpoints" / "u00000014")
    for key, tensor in theirs.weights.items():
        assert torch.equal(mine.weights[key], tensor), key
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(mine.optimizer[key], theirs.optimizer[key]), key


def test_a_changed_sample_order_is_refused(line: Path) -> None:
    assert run(line, stop_at=3) == 0
    config = RunConfig.load(line / "run.json")
    config.seeds.data = 7
    config.allow_changes = ["seeds.data"]
    config.save(line / "run.json")
    with pytest.raises(CheckpointError, match="sample order digest differs"):
        run(line)
    # A refused start accepts nothing: the accepted configuration still has the old seed.
    assert RunConfig.load(line / "accepted_run.json").seeds.data == 0
    config.seeds.data = 0
    config.save(line / "run.json")
    assert run(line, stop_at=4) == 0


def test_an_allowed_change_is_on_record_in_run_log(line: Path) -> None:
    # Found in a walkthrough of run.json edits: a change made on purpose left no trace in the line's
    # log, so nothing told why its later updates differ from its earlier ones.
    assert run(line, stop_at=2) == 0
    config = RunConfig.load(line / "run.json")
    config.optimizer.clip = 0.5
    config.allow_changes = ["optimizer.clip"]
    config.save(line / "run.json")
    assert run(line, stop_at=3) == 0
    accepted = [text.split("run.json accepted: ", 1)[1] for text in (line / "run.log").read_text().splitlines()
                if "run.json accepted: " in text]  # fmt: skip
    assert accepted == ["optimizer.clip 1 -> 0.5 (allow_changes)"]
    assert RunConfig.load(line / "run.json").allow_changes == []  # one listing allows one change


def test_an_unallowed_lifelong_change_is_refused_before_anything_is_written(line: Path) -> None:
    config = RunConfig.load(line / "run.json")
    config.optimizer.clip = 0.5
    config.save(line / "run.json")
    with pytest.raises(ConfigError, match="optimizer.clip changed"):
        run(line)
    assert not (line / "rows.jsonl").exists() and not list((line / "checkpoints").iterdir())


def test_nonfinite_updates_are_skipped_then_stop_the_line(
    line: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = RunConfig.load(line / "run.json")
    config.optimizer.max_nonfinite_in_a_row = 2
    config.save(line / "run.json")
    config.save(line / "accepted_run.json")
    build_model = trainer_module.build_model

    def poisoned(preset: str, overrides: dict):
        model = build_model(preset, overrides)
        # A NaN in every loss: every gradient norm is NaN.
        model.register_forward_hook(lambda _module, _inputs, output: (output[0] * float("nan"), output[1]))
        return model

    monkeypatch.setattr(trainer_module, "build_model", poisoned)
    with pytest.raises(LineError, match="3 non-finite updates in a row"):
        run(line)
    rows = read_rows(line)
    assert [row["skipped"] for row in rows] == [True, True, True]
    start = load_checkpoint(line / "checkpoints" / "u00000000")
    end = load_checkpoint(line / "checkpoints" / "u00000003")
    for key, tensor in start.weights.items():
        assert torch.equal(end.weights[key], tensor), key
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(end.optimizer[key], start.optimizer[key]), key
    assert end.state["nonfinite_in_a_row"] == 3


def test_waits_for_the_next_cycle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data_cycles_module, "WAIT_POLL_SECONDS", 0.05)
    data = make_data_line(tmp_path, prepare=1)
    line = make_line(tmp_path, data)
    trainer = Trainer(line, echo=None)
    outcome: list[int] = []
    thread = threading.Thread(target=lambda: outcome.append(trainer.run()))
    thread.start()
    heartbeat = line / "heartbeat"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if heartbeat.exists() and json.loads(heartbeat.read_text())["stage"] == "waiting-data":
            break
        time.sleep(0.02)
    beat = json.loads(heartbeat.read_text())
    assert beat["stage"] == "waiting-data" and beat["cycle"] == 1
    prepare_cycle(open_data_line(data), 1)
    request_stop(line, at_cycle_end=1)
    thread.join(timeout=60)
    assert outcome == [0]
    assert open_data_line(data).is_consumed(1)
    assert "waiting for data cycle 1" in (line / "run.log").read_text()


def test_rows_past_the_checkpoint_are_cut_and_a_short_record_is_refused(line: Path) -> None:
    assert run(line, stop_at=5) == 0
    rows = (line / "rows.jsonl").read_text()
    # Rows a killed trainer wrote after its last checkpoint are replayed, not duplicated.
    (line / "rows.jsonl").write_text(rows + rows.splitlines(keepends=True)[-1] + '{"update": 6, "torn')
    assert run(line, stop_at=6) == 0
    assert [row["update"] for row in read_rows(line)] == [1, 2, 3, 4, 5, 6]
    (line / "rows.jsonl").write_text(rows[: len(rows) // 2])
    with pytest.raises(LineError, match="rows.jsonl"):
        run(line, stop_at=7)
