"""The trainer's W&B mirror on real tiny lines, with the real wandb client in offline mode.

What the client wrote is read back from its local transaction logs (engine.wandb.txlog); each start
of a line writes a new offline directory, listed in order in wandb_run.json, so the run's curve
is the union of the histories of those directories.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest
from helpers import REPOSITORY as REPO_ROOT
from helpers.lines import (
    copy_data_line,
    data_template_fixture,
    make_line,
)

from engine.errors import DiskFull
from engine.layout import LineLayout
from engine.ops.branch import BranchRequest, branch_line
from engine.ops.rollback import rollback_line
from engine.training import checkpointing as checkpointing_module
from engine.training import trainer as trainer_module
from engine.training.trainer import Trainer
from engine.wandb import mirror_thread
from engine.wandb.backend import RealWandbBackend
from engine.wandb.mirror import WandbMirror
from engine.wandb.rows import row_values
from engine.wandb.state import RunPoint, WandbRunState
from engine.wandb.txlog import TransactionLogReader, transaction_log_of

UPDATES = 4
"""Updates per session: the first session trains 1..UPDATES, the resumed one UPDATES+1..2*UPDATES."""

pytestmark = pytest.mark.usefixtures("offline_wandb", "one_thread")  # conftest: a temporary, offline wandb home




data_template = data_template_fixture()


def wandb_line(root: Path, data_template: Path, mode: str) -> Path:
    return make_line(
        root, copy_data_line(data_template, root), **{"wandb.mode": mode, "wandb.project": "nsconsole-tests"}
    )


def train(line: Path, stop_at: int) -> None:
    assert Trainer(line, stop_at=stop_at, echo=None).run() == 0


def line_rows(line: Path) -> list[dict[str, Any]]:
    return [json.loads(text) for text in (line / "rows.jsonl").read_text().splitlines()]


def last_session(line: Path) -> tuple[Any, list[tuple[int, float]]]:
    """The run record and the (step, loss) history of the line's newest offline directory."""
    newest = WandbRunState.load(LineLayout(line).wandb_run_json).local_files[-1]
    log = transaction_log_of(Path(newest.path))
    assert log is not None, f"{newest.path} holds no transaction log"
    [run] = [record.run for record in TransactionLogReader(log).read_records() if record.HasField("run")]
    history = [(row.step, row.values["loss"]) for row in TransactionLogReader(log).read_history()]
    return run, history


def losses(line: Path, updates: range) -> list[tuple[int, float]]:
    by_update = {row["update"]: row["loss"] for row in line_rows(line)}
    return [(update, by_update[update]) for update in updates]


def wandb_history(line: Path) -> list[tuple[str, int, dict[str, Any]]]:
    """(run id, step, values) of every row in the line's offline logs, oldest session first."""
    history = []
    for entry in WandbRunState.load(LineLayout(line).wandb_run_json).local_files:
        log = transaction_log_of(Path(entry.path))
        assert log is not None, f"{entry.path} holds no transaction log"
        history += [(entry.run_id, row.step, row.values) for row in TransactionLogReader(log).read_history()]
    return history


def last_update_in_rows_jsonl(line: Path) -> int | None:
    rows = line_rows(line) if (line / "rows.jsonl").exists() else []
    return rows[-1]["update"] if rows else None


def test_a_resumed_line_keeps_its_run_and_wandb_gets_every_update_once(
    tmp_path: Path, data_template: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    line = wandb_line(tmp_path, data_template, "offline")
    layout = LineLayout(line)
    # What rows.jsonl holds whenever the trainer starts the mirror or hands it a row.
    seen_at_start: list[int | None] = []
    seen_at_log: list[tuple[int, int | None]] = []
    start, log = WandbMirror.start, WandbMirror.log

    def spied_start(mirror: WandbMirror) -> None:
        seen_at_start.append(last_update_in_rows_jsonl(line))
        start(mirror)

    def spied_log(mirror: WandbMirror, row: dict[str, Any]) -> None:
        seen_at_log.append((row["update"], last_update_in_rows_jsonl(line)))
        log(mirror, row)

    monkeypatch.setattr(WandbMirror, "start", spied_start)
    monkeypatch.setattr(WandbMirror, "log", spied_log)
    train(line, stop_at=UPDATES)
    first = WandbRunState.load(layout.wandb_run_json)
    assert (first.start, first.acknowledged_step) == ("new", UPDATES)
    # A kill after a row was written and before its checkpoint leaves a row the resume abandons
    # (cut from rows.jsonl, trained again): it must never reach W&B.
    abandoned = {**line_rows(line)[-1], "update": UPDATES + 1, "loss": 123.0}
    with (line / "rows.jsonl").open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(abandoned) + "\n")
    train(line, stop_at=2 * UPDATES)
    # The mirror starts once rows.jsonl is cut back, and gets each row after rows.jsonl has it.
    assert seen_at_start == [None, UPDATES]
    assert seen_at_log == [(update, update) for update in range(1, 2 * UPDATES + 1)]
    state = WandbRunState.load(layout.wandb_run_json)
    assert (state.run_id, state.start, state.acknowledged_step) == (first.run_id, "resume", 2 * UPDATES)
    # One offline directory per session, both of the line's one run, in the line's wandb/.
    assert [entry.run_id for entry in state.local_files] == [first.run_id, first.run_id]
    assert all(Path(entry.path).parent == layout.wandb_dir for entry in state.local_files)
    history = wandb_history(line)
    assert [step for _, step, _ in history] == list(range(1, 2 * UPDATES + 1))  # each update once
    assert {run_id for run_id, _, _ in history} == {first.run_id}
    # W&B holds rows.jsonl's values (the row trained again, not the abandoned one): the row's
    # update is the step, every other key is logged.
    rows = line_rows(line)
    assert [row["update"] for row in rows] == list(range(1, 2 * UPDATES + 1))
    for row, (_, step, values) in zip(rows, history, strict=True):
        expected = {key: value for key, value in row.items() if key != "update"}
        assert {key: values[key] for key in expected} == expected, f"update {step}"


def test_a_disabled_line_never_touches_wandb(tmp_path: Path, data_template: Path) -> None:
    line = wandb_line(tmp_path, data_template, "disabled")
    # In a fresh interpreter: this one may have imported wandb for the other tests.
    script = (
        "import sys, torch; torch.set_num_threads(1)\n"
        "from engine.training.trainer import Trainer\n"
        f"assert Trainer({str(line)!r}, stop_at=2, echo=None).run() == 0\n"
        "print(sorted(name for name in sys.modules if name == 'wandb' or name.startswith('wandb.')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"  # no wandb module was imported
    assert [row["update"] for row in line_rows(line)] == [1, 2]
    layout = LineLayout(line)
    assert not layout.wandb_dir.exists() and not layout.wandb_run_json.exists()


class BrokenWandb:
    """A W&B client that fails every call, as during a long outage."""

    calls = 0

    def __init__(self, *arguments: Any, **keywords: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        def fail(*arguments: Any, **keywords: Any) -> Any:
            BrokenWandb.calls += 1
            raise ConnectionError(f"W&B is down ({name})")

        return fail


def test_a_failing_wandb_never_stops_training(
    tmp_path: Path, data_template: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mirror_thread, "RealWandbBackend", BrokenWandb)
    monkeypatch.setattr(trainer_module, "WANDB_CLOSE_SECONDS", 1.0)  # the outage lasts past the exit
    monkeypatch.setattr(BrokenWandb, "calls", 0)
    line = wandb_line(tmp_path, data_template, "offline")
    train(line, stop_at=UPDATES)
    assert BrokenWandb.calls > 0  # the mirror did try
    assert [row["update"] for row in line_rows(line)] == list(range(1, UPDATES + 1))
    run_log = (line / "run.log").read_text()
    assert f"stopped: reached --stop-at (update {UPDATES}," in run_log
    # W&B got nothing, so the next start sends every row: nothing recorded as acknowledged.
    state = WandbRunState.load(LineLayout(line).wandb_run_json)
    assert state.acknowledged_step is None


DiskUsage = namedtuple("DiskUsage", "total used free")


def test_a_disk_full_stop_does_not_wait_on_wandb_and_the_next_start_resends_what_it_lacks(
    tmp_path: Path, data_template: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a full disk the offline client cannot finish its run (its log cannot grow): the trainer's
    exit waited out the whole W&B close limit (30 s) before the supervisor heard of the full disk."""
    line = wandb_line(tmp_path, data_template, "offline")
    train(line, stop_at=UPDATES)  # a normal stop: W&B takes everything, the run is finished
    assert WandbRunState.load(LineLayout(line).wandb_run_json).acknowledged_step == UPDATES
    close_limit = 20.0
    monkeypatch.setattr(trainer_module, "WANDB_CLOSE_SECONDS", close_limit)
    disk_full_at: list[float] = []
    freed = threading.Event()
    real_usage, real_finish = shutil.disk_usage, RealWandbBackend.finish

    def usage(path: str | Path) -> DiskUsage:
        position = getattr(trainer, "position", None)
        if freed.is_set() or position is None or position.update < UPDATES + 2:
            return real_usage(path)
        # The disk fills once W&B holds rows of this session: its run has something to finish.
        deadline = time.monotonic() + 60
        while (trainer.mirror.status().sent_through or 0) <= UPDATES:
            assert time.monotonic() < deadline, "W&B never took a row of the second session"
            time.sleep(0.05)
        disk_full_at.append(time.monotonic())
        return DiskUsage(total=10**12, used=10**12 - 1000, free=1000)  # no room for a checkpoint

    def finish_on_a_full_disk(backend: RealWandbBackend) -> bool:
        if disk_full_at and not freed.is_set():
            freed.wait(60)  # the client's writes do not complete until the disk has room
        return real_finish(backend)

    monkeypatch.setattr(checkpointing_module.shutil, "disk_usage", usage)
    monkeypatch.setattr(RealWandbBackend, "finish", finish_on_a_full_disk)
    trainer = Trainer(line, stop_at=2 * UPDATES, echo=None)
    with pytest.raises(DiskFull, match="no room for another checkpoint"):
        trainer.run()
    waited = time.monotonic() - disk_full_at[0]
    freed.set()
    assert waited < close_limit / 2, f"the trainer's exit waited {waited:.1f} s on W&B"
    # A trainer is a process of its own, whose exit ends the abandoned thread; in this one the next
    # trainer must not meet it, so it is waited for here.
    assert trainer.mirror.close(60)
    train(line, stop_at=2 * UPDATES)  # room again: the next start sends what W&B lacks
    steps = {step for _, step, _ in wandb_history(line)}
    assert steps == set(range(1, 2 * UPDATES + 1))
    assert WandbRunState.load(LineLayout(line).wandb_run_json).acknowledged_step == 2 * UPDATES


def test_the_next_start_carries_out_a_planned_rollback_and_branch(tmp_path: Path, data_template: Path) -> None:
    trunk = wandb_line(tmp_path / "trunk", data_template, "offline")
    train(trunk, stop_at=12)  # past cycle 0's end (5,000 tokens at 512 an update: update 10)
    run_id = WandbRunState.load(LineLayout(trunk).wandb_run_json).run_id
    assert run_id is not None

    # A branch after cycle 0: its first start forks the trunk's run at the fork update.
    branch_data = copy_data_line(data_template, tmp_path / "branch_data")
    fork = branch_line(BranchRequest(tmp_path / "b1", trunk, 0, "decay:1024", branch_data))
    train(fork.line, stop_at=fork.fork_update + 2)
    branch = WandbRunState.load(LineLayout(fork.line).wandb_run_json)
    assert (branch.start, branch.method, branch.pending) == ("fork", "native", None)
    assert branch.parent == RunPoint(run_id, fork.fork_update) and branch.run_id != run_id
    record, history = last_session(fork.line)
    assert (record.run_id, record.branch_point.run, record.branch_point.value) == (
        branch.run_id, run_id, fork.fork_update
    )  # fmt: skip
    assert history == losses(fork.line, range(fork.fork_update + 1, fork.fork_update + 3))

    # A rollback of the trunk to update 5: the next start rewinds the run there, then trains on.
    rollback_line(trunk, 5)
    train(trunk, stop_at=7)
    assert_rewound(trunk, run_id, point=5, through=7)


def assert_rewound(line: Path, run_id: str, point: int, through: int) -> None:
    """The line's last start rewound its run natively to step `point`; its session holds the rows
    after it, up to update `through`."""
    rewound = WandbRunState.load(LineLayout(line).wandb_run_json)
    assert (rewound.run_id, rewound.start, rewound.method, rewound.pending) == (run_id, "rewind", "native", None)
    assert rewound.parent == RunPoint(run_id, point)
    record, history = last_session(line)
    assert (record.run_id, record.branch_point.run, record.branch_point.value) == (run_id, run_id, point)
    assert history == losses(line, range(point + 1, through + 1))


def test_a_rewind_that_waited_out_a_session_without_wandb_sends_that_session_s_rows(
    tmp_path: Path, data_template: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """W&B out from a rollback until the trainer's stop: the line trains on past the rollback point,
    its checkpoints recording the rewind as still to do; the next start, W&B back, rewinds the run
    and sends every row of the line after the point, the rows of the session without W&B included."""
    line = wandb_line(tmp_path, data_template, "offline")
    layout = LineLayout(line)
    train(line, stop_at=8)
    run_id = WandbRunState.load(layout.wandb_run_json).run_id
    rollback_line(line, 5)
    monkeypatch.setattr(mirror_thread, "RealWandbBackend", BrokenWandb)
    monkeypatch.setattr(trainer_module, "WANDB_CLOSE_SECONDS", 1.0)
    train(line, stop_at=12)
    for update in (10, 12):
        record = json.loads((layout.checkpoint(update) / "state.json").read_text())["wandb"]
        assert (record["pending"]["kind"], record["pending"]["at_update"]) == ("rewind", 5), update
    monkeypatch.setattr(mirror_thread, "RealWandbBackend", RealWandbBackend)
    train(line, stop_at=15)
    assert_rewound(line, run_id, point=5, through=15)
    # The run is the first session's steps up to the point (the rewind drops the rest), then the last
    # session's: every row of the line once, in order, with rows.jsonl's values -- the new
    # continuation's, not the abandoned one's (rows.rolledback-*.jsonl), whose times differ.
    history = wandb_history(line)
    assert [step for _, step, _ in history] == list(range(1, 9)) + list(range(6, 16))
    run = history[:5] + history[8:]
    rows = line_rows(line)
    assert [row["update"] for row in rows] == list(range(1, 16))
    for row, (_, step, values) in zip(rows, run, strict=True):
        expected = row_values(row)
        assert step == row["update"] and {key: values[key] for key in expected} == expected, f"update {step}"
    [abandoned] = line.glob("rows.rolledback-*.jsonl")
    abandoned_rows = [json.loads(text) for text in abandoned.read_text().splitlines()]
    assert [row["update"] for row in abandoned_rows] == [6, 7, 8]  # the rows it set aside
    assert [row["time"] for row in abandoned_rows] != [row["time"] for row in rows[5:8]]
