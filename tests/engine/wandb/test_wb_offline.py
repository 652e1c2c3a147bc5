"""W&B continuity with the real wandb client in offline mode (no network is ever touched).

What the client wrote is read back from its local transaction logs (`run-<id>.wandb`) with
engine.wandb.txlog: wandb 0.31 has no Python reader of its own, and its public API reads only
from a server. Each start of a line writes a new offline directory (in the order recorded in
wandb_run.json), so the run's curve is the union of the history of those directories.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.environment import scoped_environment

from engine.config.run import WandbConfig
from engine.wandb.backend import RealWandbBackend
from engine.wandb.mirror import MirrorOptions, RetryPolicy, WandbMirror, plan_branch, plan_rollback
from engine.wandb.state import RunPoint, WandbRunState
from engine.wandb.txlog import TransactionLogError, TransactionLogReader, transaction_log_of

OFFLINE = WandbConfig(project="nsconsole-tests", mode="offline")
OPTIONS = MirrorOptions(retry=RetryPolicy(0.01, 0.05, 3600.0), acknowledge_every_s=0.05)


@pytest.fixture(scope="module", autouse=True)
def offline_mode(offline_wandb: Path) -> Iterator[None]:
    """On top of conftest's temporary wandb home: every client of this module runs offline."""
    with scoped_environment({"WANDB_MODE": "offline"}):
        yield


def make_row(update: int, loss: float) -> dict[str, Any]:
    return {"update": update, "tokens": update * 256, "loss": loss, "lr": 0.003, "stage": "trunk"}


def append_rows(line: Path, rows: list[dict[str, Any]]) -> None:
    with (line / "rows.jsonl").open("a", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")


def cut_rows(line: Path, through: int) -> None:
    """What a rollback leaves in rows.jsonl: the rows up to the checkpoint rolled back to."""
    rows = [json.loads(text) for text in (line / "rows.jsonl").read_text().splitlines()]
    kept = [row for row in rows if row["update"] <= through]
    (line / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in kept))


def run_session(line: Path, live: list[dict[str, Any]], backend: Any = None) -> WandbMirror:
    """One start of the line with the real client: rows are appended to rows.jsonl, then logged."""
    mirror = WandbMirror(line, OFFLINE, {"model": {"preset": "pssa-tiny"}}, backend=backend, options=OPTIONS)
    mirror.start()
    for row in live:
        append_rows(line, [row])
        mirror.log(row)
    assert mirror.close(timeout_s=60.0)
    return mirror


def state_of(line: Path) -> WandbRunState:
    return WandbRunState.load(line / "wandb_run.json")


def session_logs(line: Path) -> list[Path]:
    """The transaction logs of the line's runs, oldest first."""
    logs = [transaction_log_of(Path(entry.path)) for entry in state_of(line).local_files]
    return [log for log in logs if log is not None]


def history(log: Path) -> list[tuple[int, float]]:
    return [(row.step, row.values["loss"]) for row in TransactionLogReader(log).read_history()]


def run_records(log: Path) -> list[Any]:
    return [record.run for record in TransactionLogReader(log).read_records() if record.HasField("run")]


def summary_of(log: Path) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for record in TransactionLogReader(log).read_records():
        if record.HasField("summary"):
            for item in record.summary.update:
                values[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return values


def test_a_resumed_run_resends_the_rows_it_missed_and_cleans_synced_files(tmp_path: Path) -> None:
    rows = [make_row(update, 10.0 / update) for update in range(1, 10)]
    run_session(tmp_path, rows[:4])
    first = state_of(tmp_path)
    assert (first.start, first.acknowledged_step) == ("new", 4)
    [first_log] = session_logs(tmp_path)
    assert history(first_log) == [(u, 10.0 / u) for u in range(1, 5)]
    # The trainer went on to update 7 while its W&B client was gone (a crash): rows.jsonl has
    # them, W&B does not. Meanwhile `wandb sync` uploaded the first directory.
    append_rows(tmp_path, rows[4:7])
    first_log.with_suffix(".wandb.synced").touch()
    # The next start replays update 7 from its checkpoint and trains on to 9.
    run_session(tmp_path, rows[6:9])
    second = state_of(tmp_path)
    assert (second.run_id, second.start, second.acknowledged_step) == (first.run_id, "resume", 9)
    # Finished and synced: removed at the next start. (A session started within the same second
    # may re-create a directory of the same name, so the marker is what tells the first apart.)
    assert not first_log.with_suffix(".wandb.synced").exists()
    [second_log] = session_logs(tmp_path)
    assert [record.run_id for record in run_records(second_log)] == [first.run_id]
    # Rows 5..7 re-sent from rows.jsonl, 8..9 live, nothing sent twice: no hole in 1..9.
    assert history(second_log) == [(u, 10.0 / u) for u in range(5, 10)]


def test_offline_acknowledgements_come_from_the_local_log(tmp_path: Path) -> None:
    wide = {f"train/grad_norm/layer{index:02d}": 0.5 for index in range(60)}
    mirror = WandbMirror(tmp_path, OFFLINE, {}, options=OPTIONS)
    mirror.start()
    for update in range(1, 61):
        row = {**make_row(update, 1.0), **wide}
        append_rows(tmp_path, [row])
        mirror.log(row)
    # The client writes its log in 32 KiB blocks: acknowledgements trail the rows a little.
    # The wait is generous: on a loaded machine the client's service can take many seconds.
    done = threading.Event()
    deadline = time.monotonic() + 120
    while True:
        acknowledged = mirror.status().acknowledged_step
        if (acknowledged is not None and acknowledged >= 20) or time.monotonic() > deadline:
            break
        done.wait(0.05)
    assert acknowledged is not None and 20 <= acknowledged <= 60
    # wandb_run.json is written just after the status moves (outside the lock): it catches up,
    # and it never runs ahead of what the mirror knows.
    deadline = time.monotonic() + 30
    while (state_of(tmp_path).acknowledged_step or -1) < acknowledged and time.monotonic() < deadline:
        done.wait(0.05)
    saved = state_of(tmp_path).acknowledged_step
    assert saved is not None and acknowledged <= saved <= (mirror.status().acknowledged_step or -1)
    assert mirror.close(timeout_s=60.0)
    assert state_of(tmp_path).acknowledged_step == 60


def test_rollback_rewinds_and_branch_forks_the_run(tmp_path: Path) -> None:
    trunk = tmp_path / "trunk"
    trunk.mkdir()
    run_session(trunk, [make_row(update, 10.0 / update) for update in range(1, 7)])
    run_id = state_of(trunk).run_id
    # Roll back to update 4: rows.jsonl is cut there, and the line trains 5..6 again differently.
    cut_rows(trunk, through=4)
    plan_rollback(trunk, 4)
    run_session(trunk, [make_row(5, 0.5), make_row(6, 0.25)])
    rewound = state_of(trunk)
    assert (rewound.run_id, rewound.start, rewound.method) == (run_id, "rewind", "native")
    assert rewound.parent == RunPoint(run_id, 4)
    rewind_log = session_logs(trunk)[-1]
    [record] = run_records(rewind_log)
    assert (record.run_id, record.branch_point.run, record.branch_point.value) == (run_id, run_id, 4)
    assert history(rewind_log) == [(5, 0.5), (6, 0.25)]
    # A branch from the trunk after update 3.
    decay = tmp_path / "decay"
    decay.mkdir()
    plan_branch(decay, trunk, 3)
    run_session(decay, [make_row(4, 0.125)])
    branch = state_of(decay)
    assert (branch.start, branch.method, branch.parent) == ("fork", "native", RunPoint(run_id, 3))
    assert branch.run_id != run_id
    [branch_log] = session_logs(decay)
    [record] = run_records(branch_log)
    assert (record.run_id, record.branch_point.run, record.branch_point.value) == (branch.run_id, run_id, 3)
    assert history(branch_log) == [(4, 0.125)]


class NoRewindBackend(RealWandbBackend):
    """The real client against a server without rewind (as on W&B servers lacking the preview)."""

    def supports_rewind(self) -> bool:
        return False


def test_rollback_without_rewind_backfills_a_new_run_and_marks_the_old_one(tmp_path: Path) -> None:
    run_session(tmp_path, [make_row(update, 10.0 / update) for update in range(1, 6)])
    old_run_id = state_of(tmp_path).run_id
    cut_rows(tmp_path, through=3)
    plan_rollback(tmp_path, 3)
    run_session(tmp_path, [make_row(4, 0.5)], backend=NoRewindBackend(OFFLINE, tmp_path))
    state = state_of(tmp_path)
    assert state.run_id != old_run_id
    assert (state.start, state.method, state.parent) == ("rewind", "backfill", RunPoint(old_run_id, 3))
    assert [(entry.run_id, entry.by_run_id, entry.marked) for entry in state.superseded] == [
        (old_run_id, state.run_id, True)
    ]
    logs = {run_records(log)[0].run_id: log for log in session_logs(tmp_path)[1:]}
    assert history(logs[state.run_id]) == [(1, 10.0), (2, 5.0), (3, 10.0 / 3), (4, 0.5)]
    marked = logs[old_run_id]
    assert "superseded" in run_records(marked)[-1].tags
    assert summary_of(marked)["superseded_by"] == state.run_id


def test_the_log_reader_reads_a_growing_file_a_record_at_a_time_and_detects_damage(tmp_path: Path) -> None:
    line = tmp_path / "line"
    line.mkdir()
    wide = {f"probe/{index:03d}": float(index) for index in range(400)}  # rows span 32 KiB blocks
    run_session(line, [{**make_row(update, 1.0 / update), **wide} for update in range(1, 41)])
    [log] = session_logs(line)
    content = log.read_bytes()
    assert len(content) > 3 * 32768
    growing = tmp_path / "growing.wandb"
    reader = TransactionLogReader(growing)
    steps: list[int] = []
    for cut in (5, 1000, 40000, 70001, 100003, len(content)):  # inside headers, records, blocks
        growing.write_bytes(content[:cut])
        steps += [row.step for row in reader.read_history()]
    assert steps == list(range(1, 41))
    damaged = bytearray(content)
    damaged[7 + 7 + 5] ^= 0xFF  # file header, chunk header, then inside the first record's data
    growing.write_bytes(bytes(damaged))
    with pytest.raises(TransactionLogError, match="checksum mismatch"):
        list(TransactionLogReader(growing).read_records())
