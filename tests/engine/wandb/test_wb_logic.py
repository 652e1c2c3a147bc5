"""W&B continuity logic (engine.wandb.mirror) against a recording backend that simulates the W&B server.

The simulated server follows what W&B does: a continued run keeps its history and drops a step
not above its last one, a fork copies its parent's history up to the fork step, a rewind cuts a
run's history after the rewind step; it can be down (every call raises), or lack fork / rewind.
Online it reports a continued run's next step; offline (`offline=True`) it reports nothing, as
wandb's offline mode does. The server-side behaviours live here; the real client is exercised
in offline mode by test_wb_offline.py.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.wandb_fakes import (
    FAST,
    ONLINE,
    RecordingBackend,
    SimulatedServer,
    make_parent,
    row,
    run_ids,
    save_state,
    session,
    started_mirror,
    state_of,
    wait_for,
    write_rows,
)

from engine.config.run import WandbConfig
from engine.errors import LineError
from engine.wandb.backend import StartedRun
from engine.wandb.local_files import remove_finished_local_files
from engine.wandb.mirror import (
    MirrorOptions,
    RetryPolicy,
    WandbMirror,
    plan_branch,
    plan_rollback,
)
from engine.wandb.rows import read_rows
from engine.wandb.state import LocalRunFiles, RunPoint, WandbRunState, WandbStateError
from engine.wandb.txlog import FILE_HEADER

# Start and resume.


def test_new_line_gets_one_run_with_every_row(tmp_path: Path) -> None:
    server = SimulatedServer()
    session(tmp_path, RecordingBackend(server), live=[row(u) for u in range(1, 6)])
    state = state_of(tmp_path)
    assert (state.run_id, state.start, state.acknowledged_step) == ("run1", "new", 5)
    assert server.steps("run1") == [1, 2, 3, 4, 5]
    assert server.history["run1"][0][1] == {"tokens": 512, "loss": 10.0, "lr": 1e-3}  # update is the step


@pytest.mark.parametrize("offline", [False, True])
def test_resume_resends_every_row_after_the_acknowledged_step(tmp_path: Path, offline: bool) -> None:
    server = SimulatedServer(history={"runA": [(u, {"loss": 10.0 / u}) for u in range(1, 4)]})
    write_rows(tmp_path, range(1, 9))  # rows 4..8 were written but never reached the server
    save_state(tmp_path, run_id="runA", start="new", acknowledged_step=3)
    # The trainer replays updates 7..8 from its checkpoint, then trains on.
    session(tmp_path, RecordingBackend(server, offline=offline), live=[row(7), row(8), row(9), row(10)])
    assert server.steps("runA") == list(range(1, 11))
    assert ("dropped", 7) not in server.calls  # replayed rows already sent are not sent twice
    state = state_of(tmp_path)
    assert (state.run_id, state.start, state.acknowledged_step) == ("runA", "resume", 10)
    assert [call for call in server.calls if call[0] == "init"][0][1]["resume"] is True


def test_online_resume_trusts_the_server_over_the_recorded_acknowledgement(tmp_path: Path) -> None:
    # The server got rows up to 6 before the crash, but the last saved acknowledgement says 3.
    server = SimulatedServer(history={"runA": [(u, {"loss": 1.0}) for u in range(1, 7)]})
    write_rows(tmp_path, range(1, 9))
    save_state(tmp_path, run_id="runA", start="new", acknowledged_step=3)
    session(tmp_path, RecordingBackend(server))
    assert server.steps("runA") == list(range(1, 9))
    assert not [call for call in server.calls if call[0] == "dropped"]


def test_a_torn_last_row_is_skipped(tmp_path: Path) -> None:
    write_rows(tmp_path, range(1, 4))
    with (tmp_path / "rows.jsonl").open("a") as handle:
        handle.write('{"update": 4, "lo')
    assert [item["update"] for item in read_rows(tmp_path / "rows.jsonl", after=1)] == [2, 3]


# Rollback.


def test_rollback_rewinds_the_run_where_the_server_can(tmp_path: Path) -> None:
    server = SimulatedServer(history={"runA": [(u, {"loss": 10.0 / u}) for u in range(1, 9)]})
    write_rows(tmp_path, range(1, 6))  # rows.jsonl cut back to the rollback point
    save_state(tmp_path, run_id="runA", start="new", acknowledged_step=8)
    plan_rollback(tmp_path, 5)
    assert state_of(tmp_path).pending.kind == "rewind"
    session(tmp_path, RecordingBackend(server), live=[row(6, loss=0.5), row(7, loss=0.4)])
    assert server.steps("runA") == [1, 2, 3, 4, 5, 6, 7]
    assert server.losses("runA")[5:] == [0.5, 0.4]  # the new continuation, not the abandoned one
    inits = [call[1] for call in server.calls if call[0] == "init"]
    assert inits[0]["rewind"] == RunPoint("runA", 5)
    state = state_of(tmp_path)
    assert (state.run_id, state.start, state.method) == ("runA", "rewind", "native")
    assert state.parent == RunPoint("runA", 5)
    assert state.pending is None and state.superseded == []


@pytest.mark.parametrize("rewind", [True, False])
def test_rows_of_the_abandoned_continuation_never_reach_wandb(tmp_path: Path, rewind: bool) -> None:
    server = SimulatedServer(history={"runA": [(u, {"loss": 10.0 / u}) for u in range(1, 9)]})
    write_rows(tmp_path, range(1, 9))  # not cut back yet when the mirror starts
    save_state(tmp_path, run_id="runA", start="new", acknowledged_step=8)
    plan_rollback(tmp_path, 5)
    session(tmp_path, RecordingBackend(server, rewind=rewind), live=[row(6, loss=0.5)], ids=lambda: "runB")
    run_id = "runA" if rewind else "runB"
    assert server.steps(run_id) == [1, 2, 3, 4, 5, 6]
    assert server.losses(run_id)[-1] == 0.5


def test_a_branch_cannot_be_rolled_back_before_its_fork_point(tmp_path: Path) -> None:
    parent, _ = make_parent(tmp_path, acknowledged=4)
    branch = tmp_path / "decay"
    branch.mkdir()
    plan_branch(branch, parent, 6)
    with pytest.raises(LineError, match="the branch starts at update 6; it cannot be rolled back to 5"):
        plan_rollback(branch, 5)
    plan_rollback(branch, 7)  # not started yet: its first start still forks at 6
    assert state_of(branch).pending.kind == "fork"


def test_rewind_goes_back_to_the_acknowledged_step_and_resends_the_rest(tmp_path: Path) -> None:
    server = SimulatedServer(history={"runA": [(u, {"loss": 10.0 / u}) for u in range(1, 4)]})
    write_rows(tmp_path, range(1, 6))
    save_state(tmp_path, run_id="runA", start="new", acknowledged_step=3)
    plan_rollback(tmp_path, 5)
    session(tmp_path, RecordingBackend(server, offline=True), live=[row(6)])
    inits = [call[1] for call in server.calls if call[0] == "init"]
    assert inits[0]["rewind"] == RunPoint("runA", 3)
    assert server.steps("runA") == [1, 2, 3, 4, 5, 6]


def test_rollback_without_rewind_starts_a_backfilled_run_and_marks_the_old_one(tmp_path: Path) -> None:
    server = SimulatedServer(history={"runA": [(u, {"loss": 10.0 / u}) for u in range(1, 9)]})
    write_rows(tmp_path, range(1, 6))
    save_state(tmp_path, run_id="runA", start="new", acknowledged_step=8)
    plan_rollback(tmp_path, 5)
    session(tmp_path, RecordingBackend(server, rewind=False), live=[row(6, loss=0.5)], ids=lambda: "runB")
    assert server.steps("runB") == [1, 2, 3, 4, 5, 6]
    assert server.steps("runA") == list(range(1, 9))  # the old run is kept, marked
    assert server.tags["runA"] == {"superseded"} and server.summary["runA"]["superseded_by"] == "runB"
    state = state_of(tmp_path)
    assert (state.run_id, state.start, state.method) == ("runB", "rewind", "backfill")
    assert state.parent == RunPoint("runA", 5)
    marks = [(entry.run_id, entry.by_run_id, entry.at_update, entry.marked) for entry in state.superseded]
    assert marks == [("runA", "runB", 5, True)]


def test_a_server_that_refuses_rewind_is_remembered(tmp_path: Path) -> None:
    server = SimulatedServer(history={"runA": [(u, {"loss": 1.0}) for u in range(1, 9)]}, refuses_rewind=True)
    write_rows(tmp_path, range(1, 6))
    save_state(tmp_path, run_id="runA", start="new", acknowledged_step=8)
    plan_rollback(tmp_path, 5)
    ids = run_ids()
    session(tmp_path, RecordingBackend(server), ids=ids)
    assert state_of(tmp_path).rewind_unsupported
    assert server.steps("run1") == [1, 2, 3, 4, 5]
    # A second rollback goes straight to the backfill: no rewind is tried again.
    plan_rollback(tmp_path, 3)
    server.calls.clear()
    session(tmp_path, RecordingBackend(server), ids=ids)
    assert all(call[1]["rewind"] is None for call in server.calls if call[0] == "init")
    assert server.steps("run2") == [1, 2, 3]
    assert [s.run_id for s in state_of(tmp_path).superseded] == ["runA", "run1"]


def test_a_backfill_cut_short_is_finished_by_the_retry_in_the_same_run(tmp_path: Path) -> None:
    server = SimulatedServer(history={"runA": [(u, {"loss": 1.0}) for u in range(1, 9)]}, fail_log_calls={3})
    write_rows(tmp_path, range(1, 6))
    save_state(tmp_path, run_id="runA", start="new", acknowledged_step=8)
    plan_rollback(tmp_path, 5)
    session(tmp_path, RecordingBackend(server, rewind=False), ids=run_ids())
    assert set(server.history) == {"runA", "run1"}  # the retry reused the new run's id
    assert server.steps("run1") == [1, 2, 3, 4, 5]
    assert state_of(tmp_path).pending is None


# Branch.




def test_branch_forks_the_parent_run_where_the_server_can(tmp_path: Path) -> None:
    parent, server = make_parent(tmp_path, acknowledged=4)
    branch = tmp_path / "decay"
    branch.mkdir()
    plan_branch(branch, parent, 6)
    session(branch, RecordingBackend(server), live=[row(7, loss=0.7)], ids=lambda: "decayrun")
    # Forked at the parent's acknowledged step 4, then 5..6 from the parent's rows.jsonl.
    inits = [call[1] for call in server.calls if call[0] == "init"]
    assert inits[0]["fork"] == RunPoint("trunkrun", 4)
    assert server.steps("decayrun") == [1, 2, 3, 4, 5, 6, 7]
    assert server.losses("decayrun")[-1] == 0.7
    state = state_of(branch)
    assert (state.run_id, state.start, state.method) == ("decayrun", "fork", "native")
    assert state.parent == RunPoint("trunkrun", 4)


def test_branch_without_fork_is_backfilled_from_the_parent_rows(tmp_path: Path) -> None:
    parent, server = make_parent(tmp_path, acknowledged=10)
    server.refuses_fork = True
    branch = tmp_path / "decay"
    branch.mkdir()
    plan_branch(branch, parent, 6)
    session(branch, RecordingBackend(server), live=[row(7, loss=0.7)], ids=lambda: "decayrun")
    assert server.steps("decayrun") == [1, 2, 3, 4, 5, 6, 7]
    assert server.steps("trunkrun") == list(range(1, 11))
    state = state_of(branch)
    assert (state.method, state.parent, state.fork_unsupported) == ("backfill", RunPoint("trunkrun", 6), True)


def test_a_branch_that_already_has_a_run_is_refused(tmp_path: Path) -> None:
    parent, _ = make_parent(tmp_path, acknowledged=4)
    branch = tmp_path / "decay"
    branch.mkdir()
    save_state(branch, run_id="other")
    with pytest.raises(LineError, match="already has W&B run other"):
        plan_branch(branch, parent, 6)


# Outages.


def test_rows_logged_while_wandb_is_down_arrive_in_order_when_it_is_back(tmp_path: Path) -> None:
    server = SimulatedServer(down=True)
    mirror = started_mirror(tmp_path, server, FAST)
    for item in write_rows(tmp_path, range(1, 6)):
        mirror.log(item)
    wait_for(lambda: mirror.status().last_error is not None)
    assert mirror.status().queued == 5
    server.down = False
    wait_for(lambda: mirror.status().sent_through == 5)
    assert mirror.close(timeout_s=10.0)
    assert server.steps("run1") == [1, 2, 3, 4, 5]


def test_rows_given_up_after_the_limit_are_a_gap_resent_when_wandb_is_back(tmp_path: Path) -> None:
    server = SimulatedServer()
    options = MirrorOptions(retry=RetryPolicy(0.005, 0.02, give_up_after_s=0.05), acknowledge_every_s=0.01)
    mirror = started_mirror(tmp_path, server, options)
    for item in write_rows(tmp_path, range(1, 3)):
        mirror.log(item)
    wait_for(lambda: mirror.status().sent_through == 2)
    server.down = True
    for item in write_rows(tmp_path, range(3, 6)):
        mirror.log(item)
    wait_for(lambda: mirror.status().gap is not None)
    assert mirror.status().queued == 0  # given up: no longer held in memory
    for item in write_rows(tmp_path, range(6, 8)):
        mirror.log(item)
    assert mirror.status().gap == (3, 7)
    wait_for(lambda: state_of(tmp_path).gap is not None)  # recorded for the next start
    server.down = False
    wait_for(lambda: mirror.status().gap is None and mirror.status().sent_through == 7)
    mirror.log(write_rows(tmp_path, range(8, 9))[0])
    assert mirror.close(timeout_s=10.0)
    assert server.steps("run1") == list(range(1, 9))
    assert state_of(tmp_path).gap is None


def test_the_next_start_resends_what_an_outage_kept_from_wandb(tmp_path: Path) -> None:
    server = SimulatedServer()
    options = MirrorOptions(retry=RetryPolicy(0.005, 0.02, give_up_after_s=0.05), acknowledge_every_s=0.01)
    ids = run_ids()
    mirror = started_mirror(tmp_path, server, options, ids)
    for item in write_rows(tmp_path, range(1, 3)):
        mirror.log(item)
    wait_for(lambda: state_of(tmp_path).acknowledged_step == 2)
    server.down = True
    for item in write_rows(tmp_path, range(3, 7)):
        mirror.log(item)
    wait_for(lambda: state_of(tmp_path).gap is not None)
    mirror.close(timeout_s=0.5)  # W&B is still down: closing gives up in time
    state = state_of(tmp_path)
    assert (state.acknowledged_step, state.gap.from_update) == (2, 3)
    server.down = False
    session(tmp_path, RecordingBackend(server, offline=True), ids=ids)
    assert server.steps("run1") == [1, 2, 3, 4, 5, 6]


def test_logging_never_waits_on_wandb_and_close_is_bounded(tmp_path: Path) -> None:
    release = threading.Event()

    class HangingBackend(RecordingBackend):
        def init(self, *args: Any, **kwargs: Any) -> StartedRun:
            release.wait(30)  # W&B hangs on connect
            return super().init(*args, **kwargs)

    server = SimulatedServer()
    mirror = WandbMirror(tmp_path, ONLINE, backend=HangingBackend(server), options=FAST, new_run_id=run_ids())
    mirror.start()
    for item in write_rows(tmp_path, range(1, 201)):
        mirror.log(item)  # returns at once although W&B does not answer
    assert mirror.status().queued == 200
    assert mirror.close(timeout_s=0.2) is False  # bounded: the caller goes on
    release.set()


def test_abandoning_never_waits_nor_finishes_and_the_next_start_resends_the_rest(tmp_path: Path) -> None:
    """A trainer stopping for a fault (a full disk) abandons the mirror: `close` waited out its
    limit on a `finish` that could not complete."""
    release = threading.Event()
    finishing: list[str | None] = []

    class FinishHangs(RecordingBackend):
        def finish(self) -> bool:
            finishing.append(self.run_id)
            release.wait(30)  # as on a full disk: the client's last writes do not complete
            return super().finish()

    server = SimulatedServer()
    ids = run_ids()
    mirror = WandbMirror(tmp_path, ONLINE, backend=FinishHangs(server), options=FAST, new_run_id=ids)
    mirror.start()
    for item in write_rows(tmp_path, range(1, 4)):
        mirror.log(item)
    wait_for(lambda: mirror.status().sent_through == 3)
    started = time.monotonic()
    mirror.abandon()
    assert time.monotonic() - started < 0.5  # no wait at all
    for item in write_rows(tmp_path, range(4, 6)):
        mirror.log(item)  # rows after the fault are not taken (rows.jsonl has them)
    assert mirror.close(timeout_s=5.0)  # the thread ended without finishing the run
    release.set()
    assert finishing == [] and server.steps("run1") == [1, 2, 3]
    session(tmp_path, RecordingBackend(server), ids=ids)
    assert server.steps("run1") == [1, 2, 3, 4, 5]  # the next start sent what the fault kept back


def test_closing_while_wandb_is_out_gives_up_after_a_few_tries(tmp_path: Path) -> None:
    server = SimulatedServer(down=True)  # unreachable from the start (as with wandb not installed)
    mirror = started_mirror(tmp_path, server, FAST)
    for item in write_rows(tmp_path, range(1, 4)):
        mirror.log(item)
    wait_for(lambda: mirror.status().last_error is not None)
    # Returns before its time is up (a few failed tries): the trainer's stop does not wait it out.
    assert mirror.close(timeout_s=20.0) is True
    server.down = False
    session(tmp_path, RecordingBackend(server), ids=run_ids())
    assert server.steps("run1") == [1, 2, 3]  # the next start sent what the outage held back


def test_a_full_queue_is_dropped_and_read_back_from_rows_jsonl(tmp_path: Path) -> None:
    server = SimulatedServer(down=True)
    options = MirrorOptions(retry=FAST.retry, acknowledge_every_s=0.01, max_queued_rows=3)
    mirror = started_mirror(tmp_path, server, options)
    for item in write_rows(tmp_path, range(1, 7)):
        mirror.log(item)
    assert mirror.status().queued <= 3 and mirror.status().gap is not None
    server.down = False
    wait_for(lambda: mirror.status().sent_through == 6)
    assert mirror.close(timeout_s=10.0)
    assert server.steps("run1") == [1, 2, 3, 4, 5, 6]


# State file and local files.


def test_a_damaged_state_file_is_set_aside_and_a_new_run_gets_every_row(tmp_path: Path) -> None:
    write_rows(tmp_path, range(1, 4))
    (tmp_path / "wandb_run.json").write_text('{"version": 1, "run_id": ')
    server = SimulatedServer()
    session(tmp_path, RecordingBackend(server))
    assert server.steps("run1") == [1, 2, 3]
    assert len(list(tmp_path.glob("wandb_run.json.bad-*"))) == 1


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"version": 1, "run_id": ', "wandb_run.json: malformed JSON at line 1 column 26"),
        ('{"version": 1, "acknowledged_step": ' + "9" * 5000 + "}",
         "wandb_run.json: cannot be parsed (Exceeds the limit (4300 digits)"),
        ("\udcff{}", "wandb_run.json: not UTF-8 text (byte 0)"),
        ('{"version": 2}', "wandb_run.json: version must be 1, got 2"),
        ('{"version": 1, "acknowledged_step": "7"}', 'wandb_run.json: acknowledged_step must be int or null'),
        ('{"version": 1, "start": "restart"}', "wandb_run.json: start must be one of new, resume, fork"),
        ('{"version": 1, "pending": {"kind": "fork"}}', "wandb_run.json: pending.at_update is missing"),
        # Below 0 read as sound: `status` showed "rewind at update -5" and the next start made a new run.
        ('{"version": 1, "pending": {"kind": "rewind", "at_update": -5}}',
         "wandb_run.json: pending.at_update must be 0 or more, got -5"),
        ('{"version": 1, "replay_mismatch_count": -1}', "wandb_run.json: replay_mismatch_count must be 0 or more"),
        ('{"version": 1, "superseded": [{"run_id": "a", "by_run_id": "b", "at_update": 1, "x": 1}]}',
         "wandb_run.json: superseded[0].x is not a known key"),
    ],
)
def test_state_file_errors_name_the_file_and_the_key(tmp_path: Path, content: str, message: str) -> None:
    (tmp_path / "wandb_run.json").write_bytes(content.encode("utf-8", "surrogateescape"))
    with pytest.raises(WandbStateError) as raised:
        WandbRunState.load(tmp_path / "wandb_run.json")
    assert str(raised.value).startswith(message)
    with pytest.raises(LineError) as refused:  # rollback refuses, leaving the file as it is
        plan_rollback(tmp_path, 3)
    named = f"{tmp_path / 'wandb_run.json'}{str(raised.value).removeprefix('wandb_run.json')}"
    assert str(refused.value) == (f"{named}; the rollback changed nothing: move the file aside and roll back "
                                  "again (the next start rewinds the W&B run the line's checkpoints record)")  # fmt: skip
    assert (tmp_path / "wandb_run.json").read_bytes() == content.encode("utf-8", "surrogateescape")


def test_local_files_of_cleanly_finished_runs_are_removed(tmp_path: Path) -> None:
    names = ("online_done", "offline_done", "offline_synced", "crashed")
    directories = {name: tmp_path / name for name in names}
    for directory in directories.values():
        directory.mkdir()
    (directories["offline_synced"] / "run-c.wandb.synced").touch()
    # Not synced, and its log holds records (a directory whose log holds none is removed at once).
    (directories["offline_done"] / "run-b.wandb").write_bytes(FILE_HEADER + b"records")
    state = WandbRunState(local_files=[
        LocalRunFiles(str(directories["online_done"]), "a", offline=False, finished=True),
        LocalRunFiles(str(directories["offline_done"]), "b", offline=True, finished=True),
        LocalRunFiles(str(directories["offline_synced"]), "c", offline=True, finished=True),
        LocalRunFiles(str(directories["crashed"]), "d", offline=False, finished=False),
        LocalRunFiles(str(tmp_path / "gone"), "e", offline=False, finished=True),
    ])
    remove_finished_local_files(state)
    assert [entry.run_id for entry in state.local_files] == ["b", "d"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["crashed", "offline_done"]


def test_disabled_mode_does_nothing(tmp_path: Path) -> None:
    server = SimulatedServer()
    mirror = WandbMirror(tmp_path, WandbConfig(mode="disabled"), backend=RecordingBackend(server))
    mirror.start()
    mirror.log(row(1))
    assert mirror.close() is True
    assert server.calls == [] and not (tmp_path / "wandb_run.json").exists()


