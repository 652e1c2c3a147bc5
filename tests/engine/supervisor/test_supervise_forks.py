"""The supervisor's branch queue on real checkpoint directories: when a cycle has ended, what is
refused before queueing (everything the fork would refuse at the cycle's end), forks made at a
cycle end, a queue carried across a restart, the line's end, failed forks in `status` and notified.

`branch_line` itself is stood in for here (its own tests are tests/engine/ops/test_branch_rollback.py; the real fork
through a running supervisor is tests/engine/supervisor/test_supervise_ops_e2e.py), so that each case is fast.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from helpers.lines import make_data_line, make_line

from datalines import open_data_line
from engine.checkpoints.format import apply_retention, branched_from, read_pinned
from engine.config.host import HostSettings
from engine.errors import LineError
from engine.layout import LineLayout
from engine.ops import branch as branch_operation
from engine.ops.branch import BranchRequest, BranchResult
from engine.supervisor.forks import ForkQueue, QueuedFork, cycle_end_checkpoint, new_fork
from engine.supervisor.supervisor import Supervisor
from nsconsole.state import ForkView, LineView


def write_checkpoint(
    layout: LineLayout, update: int, cycle: int, kept: str | None = None, tokens: int | None = None
) -> Path:
    directory = layout.checkpoint(update)
    directory.mkdir(parents=True)
    position = {"cycle": cycle} if tokens is None else {"cycle": cycle, "tokens_trained": tokens}
    state = {"update": update, "kept": kept, "position": position}
    (directory / "state.json").write_text(json.dumps(state))
    (layout.checkpoints / "latest").write_text(directory.name + "\n")
    return directory


class Recorder:
    """What the queue tells the supervisor, and a stand-in for `branch_line`."""

    def __init__(self, refuse: str | None = None) -> None:
        self.refuse = refuse
        self.requests: list[BranchRequest] = []
        self.forked: list[str] = []
        self.told_on: list[threading.Thread] = []  # the threads on_forked ran on
        self.failed: list[tuple[str, str]] = []
        self.changes = 0

    def branch_line(self, request: BranchRequest) -> BranchResult:
        self.requests.append(request)
        if self.refuse:
            raise LineError(self.refuse)
        return BranchResult(request.new, 10 * request.at_cycle, 100, None, True)  # type: ignore[arg-type]

    def queue(self, layout: LineLayout) -> ForkQueue:
        return ForkQueue(
            layout,
            on_forked=self.record_fork,
            on_failed=lambda fork, message: self.failed.append((fork.path, message)),
            on_change=self.count_change,
        )

    def record_fork(self, fork: QueuedFork, result: BranchResult) -> None:
        self.forked.append(str(result.line))
        self.told_on.append(threading.current_thread())

    def count_change(self) -> None:
        self.changes += 1


@pytest.fixture(scope="module")
def data_line(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_data_line(tmp_path_factory.mktemp("forks"), prepare=1)


@pytest.fixture(scope="module")
def one_cycle_data_line(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_data_line(tmp_path_factory.mktemp("one_cycle"), files=1, prepare=1)


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    recorder = Recorder()
    monkeypatch.setattr(branch_operation, "branch_line", recorder.branch_line)  # the fork queue calls it
    return recorder


def wait_for_worker(queue: ForkQueue) -> None:
    queue.close()


def test_a_cycle_has_ended_once_its_kept_checkpoint_is_part_of_the_line(tmp_path: Path) -> None:
    layout = LineLayout(tmp_path / "line")
    assert cycle_end_checkpoint(layout, 0) is None  # no checkpoint at all
    write_checkpoint(layout, 5, cycle=0)
    assert cycle_end_checkpoint(layout, 0) is None
    end = write_checkpoint(layout, 9, cycle=1, kept="cycle-end 0")
    assert cycle_end_checkpoint(layout, 0) == end and cycle_end_checkpoint(layout, 1) is None
    # Rolled back to u5: the cycle end of the abandoned continuation is not the line's.
    (layout.checkpoints / "latest").write_text("u00000005\n")
    assert cycle_end_checkpoint(layout, 0) is None


def test_a_branch_of_an_ended_cycle_forks_at_once(
    tmp_path: Path, data_line: Path, recorder: Recorder
) -> None:
    layout = LineLayout(make_line(tmp_path, data_line))
    write_checkpoint(layout, 9, cycle=1, kept="cycle-end 0")
    queue = recorder.queue(layout)
    reply = queue.branch(new_fork(tmp_path / "b0", 0, "decay:1e3", data_line))
    assert reply == {"state": "forked", "path": str(tmp_path / "b0"), "at_cycle": 0,
                     "fork_update": 0, "fork_tokens": 100}  # fmt: skip
    [request] = recorder.requests
    assert request.parent == layout.root and request.at_cycle == 0 and request.plan == "decay:1e3"
    wait_for_worker(queue)
    assert recorder.forked == [str(tmp_path / "b0")] and queue.export() == []
    # Told on a worker: the supervisor starts the branch there, and the call is answered first.
    assert recorder.told_on[0] is not threading.current_thread()


def test_refusals_come_before_a_fork_is_queued(
    tmp_path: Path, data_line: Path, one_cycle_data_line: Path, recorder: Recorder
) -> None:
    layout = LineLayout(make_line(tmp_path, data_line))
    write_checkpoint(layout, 9, cycle=1, kept="cycle-end 0")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    queue = recorder.queue(layout)
    refusals = [
        (new_fork(tmp_path / "b", 1, "decay:ten", data_line), "'ten' is not a number of tokens"),
        (new_fork(tmp_path / "taken", 1, "decay:1e3", data_line), "taken: already exists"),
        (new_fork(tmp_path / "b", 1, "decay:1e3", tmp_path / "nowhere"), "nowhere: no such data line"),
    ]
    for fork, message in refusals:
        with pytest.raises(LineError, match=message):
            queue.branch(fork)
    short = recorder.queue(LineLayout(make_line(tmp_path / "short", one_cycle_data_line)))  # one cycle
    with pytest.raises(LineError, match=r"the trunk's data line has 1 cycle \(0 to 0\), so cycle 1 never ends on it"):
        short.branch(new_fork(tmp_path / "b", 1, "decay:1e3", data_line))
    # The line is in cycle 1, so cycle 0 has ended; without its kept checkpoint it never will again.
    (layout.checkpoint(9) / "state.json").write_text(json.dumps({"update": 9, "position": {"cycle": 1}}))
    with pytest.raises(LineError, match="cycle 0 has ended .* its kept checkpoint is missing"):
        queue.branch(new_fork(tmp_path / "b", 0, "decay:1e3", data_line))
    queue.branch(new_fork(tmp_path / "b", 1, "decay:1e3", data_line))
    with pytest.raises(LineError, match="a branch into it is already queued"):
        queue.branch(new_fork(tmp_path / "b", 2, "decay:1e3", data_line))
    assert [fork["path"] for fork in queue.export()] == [str(tmp_path / "b")]
    assert recorder.requests == [] and recorder.changes == 1


def test_a_queued_fork_is_made_at_its_cycle_end_even_by_a_restarted_supervisor(
    tmp_path: Path, data_line: Path, recorder: Recorder
) -> None:
    layout = LineLayout(make_line(tmp_path, data_line))
    write_checkpoint(layout, 9, cycle=1, kept="cycle-end 0")
    queue = recorder.queue(layout)
    reply = queue.branch(new_fork(tmp_path / "b1", 1, "decay:1e3", data_line, long_seq_len=64))
    assert reply == {"state": "queued", "path": str(tmp_path / "b1"), "at_cycle": 1}
    queue.poll()
    wait_for_worker(queue)
    assert recorder.requests == []  # cycle 1 goes on
    saved = json.loads(json.dumps(queue.export()))  # what supervisor.json keeps

    # A new supervisor takes the queue back; cycle 1 ends (a rolling checkpoint first: no fork yet).
    again = recorder.queue(layout)
    again.restore([*saved, {"path": 3}, "junk"])  # unreadable records are dropped
    assert again.export() == saved
    write_checkpoint(layout, 12, cycle=1)
    again.poll()
    wait_for_worker(again)
    assert recorder.requests == []
    write_checkpoint(layout, 15, cycle=2, kept="cycle-end 1")
    again.poll()
    wait_for_worker(again)
    [request] = recorder.requests
    assert request.at_cycle == 1 and request.long_seq_len == 64 and request.new == tmp_path / "b1"
    assert recorder.forked == [str(tmp_path / "b1")] and again.export() == []


def test_a_fork_that_fails_at_its_cycle_end_or_whose_cycle_never_comes_is_reported(
    tmp_path: Path, data_line: Path, recorder: Recorder
) -> None:
    layout = LineLayout(make_line(tmp_path, data_line))
    write_checkpoint(layout, 9, cycle=1, kept="cycle-end 0")
    queue = recorder.queue(layout)
    queue.branch(new_fork(tmp_path / "b1", 1, "decay:1e3", data_line))
    queue.branch(new_fork(tmp_path / "b4", 4, "decay:1e3", data_line))  # past the estimated end, within its margin
    with pytest.raises(LineError, match="so cycle 7 never ends on it; the last cycle a branch can fork at is about 3"):
        queue.branch(new_fork(tmp_path / "b7", 7, "decay:1e3", data_line))  # past it even with the margin
    recorder.refuse = "the tokenizer differs"
    write_checkpoint(layout, 15, cycle=2, kept="cycle-end 1")
    queue.finish_line(line_ended=False)  # --stop-at: b1's fork is tried, b4 waits for the next run
    assert recorder.failed == [(str(tmp_path / "b1"), "the tokenizer differs")]
    assert [fork["at_cycle"] for fork in queue.export()] == [4]
    queue.finish_line()  # the line ended in cycle 2: b4's cycle never comes
    assert recorder.failed == [
        (str(tmp_path / "b1"), "the tokenizer differs"),
        (str(tmp_path / "b4"), "the line ended in cycle 2 before cycle 4 ended"),
    ]
    assert queue.export() == [] and recorder.forked == []
    # Both stay listed (for `status`) until a branch into the same directory is asked for again.
    assert [(fork["path"], fork["at_cycle"], fork["reason"]) for fork in queue.failed()] == [
        (str(tmp_path / "b1"), 1, "the tokenizer differs"),
        (str(tmp_path / "b4"), 4, "the line ended in cycle 2 before cycle 4 ended"),
    ]
    recorder.refuse = None
    queue.branch(new_fork(tmp_path / "b1", 1, "decay:1e3", data_line))  # cycle 1 has ended: forked now
    assert [fork["path"] for fork in queue.failed()] == [str(tmp_path / "b4")]


def test_a_queued_forks_cycle_end_outlives_keep_cycle_ends_until_the_fork_is_made(
    tmp_path: Path, data_line: Path, recorder: Recorder
) -> None:
    """With `checkpoints.keep_cycle_ends 1`, the end of cycle 2 can come before the supervisor's loop
    sees cycle 1's (tiny cycles; a loop busy hashing another fork): retention removed the fork point
    and the fork failed at the line's end as `the line ended in cycle 7 before cycle 1 ended` (found
    in the disk walkthrough on a real line). A queued fork pins its cycle end until it is made."""
    layout = LineLayout(make_line(tmp_path, data_line))
    write_checkpoint(layout, 9, cycle=1, kept="cycle-end 0")
    queue = recorder.queue(layout)
    queue.branch(new_fork(tmp_path / "b1", 1, "decay:1e3", data_line))
    assert read_pinned(layout.checkpoints) == {"cycle-end 1"}
    for update, cycle in ((15, 1), (20, 2)):  # the trainer's next cycle ends, each with its retention
        write_checkpoint(layout, update, cycle=cycle + 1, kept=f"cycle-end {cycle}")
        apply_retention(layout.checkpoints, keep_last=2, keep_cycle_ends=1)
    assert cycle_end_checkpoint(layout, 1) == layout.checkpoint(15)
    queue.poll()
    wait_for_worker(queue)
    assert recorder.forked == [str(tmp_path / "b1")] and queue.export() == []
    assert read_pinned(layout.checkpoints) == set()  # made: the branch has its own copy
    assert apply_retention(layout.checkpoints, keep_last=2, keep_cycle_ends=1) == ["u00000015"]

    # A new supervisor's queue pins what it takes back; a cycle end removed by hand fails its fork at
    # once (the fork names what is missing) instead of waiting for the line's end.
    again = recorder.queue(layout)
    again.restore([dataclasses.asdict(new_fork(tmp_path / "b3", 3, "decay:1e3", data_line))])
    assert read_pinned(layout.checkpoints) == {"cycle-end 3"}
    write_checkpoint(layout, 25, cycle=4, kept="cycle-end 3")
    shutil.rmtree(layout.checkpoint(25))
    write_checkpoint(layout, 30, cycle=4)
    recorder.refuse = "the kept checkpoint of cycle 3's end is missing"  # what branch_line finds
    again.poll()
    wait_for_worker(again)
    assert recorder.failed == [(str(tmp_path / "b3"), "the kept checkpoint of cycle 3's end is missing")]
    assert again.export() == [] and read_pinned(layout.checkpoints) == set()


def test_a_queued_branch_is_refused_now_for_what_would_stop_its_fork(
    tmp_path: Path, data_line: Path, one_cycle_data_line: Path, recorder: Recorder
) -> None:
    """Each of these was queued, then failed at the cycle's end (for the demo, 32 minutes later)."""
    cosine = [{"kind": "warmup", "until": 512, "to": 1.0},
              {"kind": "decay", "until": 1e6, "to": 0.1, "shape": "cosine"}, {"kind": "constant", "to": 0.1}]  # fmt: skip
    short_plan = [{"name": "trunk", "seq_len": 32, "tokens": 4000}]  # cycle 1 ends 5,000 on
    without_rows = tmp_path / "without_rows"
    shutil.copytree(data_line, without_rows)
    shutil.rmtree(without_rows / "val")
    assert open_data_line(one_cycle_data_line).tokenizer_json != open_data_line(data_line).tokenizer_json
    cases = [
        (data_line, "decay:1e3", r"cycle 1 is expected to end at about 9,992 tokens trained; the fork at "
                                 r"9,992 tokens falls inside a cosine decay piece", {"lr.pieces": cosine}),
        (one_cycle_data_line, "decay:1e3", "its tokenizer differs from the one line was trained with", {}),
        (without_rows, "decay:1e3", r"without_rows: no held-out rows of length 32 for this line's validation; "
                                    r"build them with `nsconsole data val", {}),
        (data_line, "long:1e3", "the long length must exceed the training length 32, got 32", {}),
        (data_line, "decay:1e3", "the plan ends before cycle 1 does", {"plan": short_plan}),
    ]
    for index, (data, plan, message, changes) in enumerate(cases):
        layout = LineLayout(make_line(tmp_path / f"trunk{index}", data_line, **changes))
        write_checkpoint(layout, 9, cycle=1, kept="cycle-end 0", tokens=4992)
        queue = recorder.queue(layout)
        with pytest.raises(LineError, match=message):
            queue.branch(new_fork(tmp_path / "b", 1, plan, data, long_seq_len=32 if "long" in plan else None))
        assert queue.export() == [] and recorder.changes == 0
    assert recorder.requests == [] and not (tmp_path / "b").exists()


def test_status_lists_queued_and_failed_forks_and_a_failure_is_notified(tmp_path: Path, data_line: Path) -> None:
    line = make_line(tmp_path, data_line)
    host = tmp_path / "host.json"
    received = tmp_path / "notified.json"
    notifier = tmp_path / "notify.py"
    notifier.write_text(f"import sys; open({str(received)!r}, 'w').write(sys.stdin.read())")
    host.write_text(json.dumps({"notify": f"{sys.executable} {notifier}"}))
    supervisor = Supervisor(line)
    supervisor._notify_command = HostSettings.load(host).notify  # what `run` reads at its start
    published = PublishedEvents()
    supervisor._server = published  # type: ignore[assignment]
    layout = LineLayout(line)
    write_checkpoint(layout, 9, cycle=1, kept="cycle-end 0", tokens=4992)
    branch = tmp_path / "b1"
    assert supervisor.forks.branch(new_fork(branch, 1, "decay:1e3", data_line))["state"] == "queued"
    view = LineView("trunk", line)
    view.apply_status(supervisor.state_for_status())
    assert view.queued_forks == [ForkView(str(branch), 1)] and view.failed_forks == []

    # Someone takes the branch's directory meanwhile: the fork fails at the end of cycle 1.
    branch.mkdir()
    (branch / "notes.txt").write_text("mine")
    write_checkpoint(layout, 15, cycle=2, kept="cycle-end 1", tokens=9952)
    supervisor.forks.poll()
    supervisor.forks.close()
    view.apply_status(supervisor.state_for_status())
    assert view.queued_forks == []
    [failed] = view.failed_forks
    assert failed.path == str(branch) and failed.at_cycle == 1 and "already exists" in (failed.reason or "")
    [event] = published.events
    assert event["event"] == "branch_failed" and event["path"] == str(branch) and event["reason"] == failed.reason
    for thread in supervisor._notifying:
        thread.join(timeout=60)
    notified = json.loads(received.read_text())
    assert notified["event"] == "branch_failed" and notified["at_cycle"] == 1
    assert f"the branch into {branch} at the end of cycle 1 failed: " in notified["message"]
    assert json.loads((line / "supervisor.json").read_text())["last_event"]["event"] == "branch_failed"


class PublishedEvents:
    """Stands in for the supervisor's server: what it publishes."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def publish(self, kind: str, data: dict[str, Any]) -> int:
        assert kind == "event"
        self.events.append(data)
        return len(self.events)


def test_a_branch_whose_supervisor_cannot_start_stays_and_the_failure_is_an_event(
    tmp_path: Path, data_line: Path
) -> None:
    trunk = Supervisor(make_line(tmp_path / "trunk", data_line))
    branch = make_line(tmp_path / "branch", data_line)
    (branch / "run.json").write_text("{")  # the branch's supervisor refuses it before starting
    published = PublishedEvents()
    trunk._server = published  # type: ignore[assignment]
    fork = new_fork(branch, 1, "decay:1e3", data_line)
    trunk._on_forked(fork, BranchResult(branch, 10, 100, None, True))  # type: ignore[arg-type]
    branched, start_failed = published.events
    assert branched["event"] == "branched" and branched["started"] is False
    assert "did not start" in branched["message"] and branched["path"] == str(branch)
    assert start_failed["event"] == "branch_start_failed" and "run.json" in start_failed["message"]
    assert (branch / "run.json").is_file()  # the branch stays, to be run by hand once fixed
    assert "branch_start_failed: " in (tmp_path / "trunk" / "line" / "run.log").read_text()


def test_queued_fork_records_round_trip() -> None:
    fork = QueuedFork("/b", 3, "decay:1e9,long:1e8", "/d", 4096, 12.5)
    assert QueuedFork.from_json(json.loads(json.dumps(fork.__dict__))) == fork
    assert QueuedFork.from_json({"path": "/b", "at_cycle": "3", "plan": "x", "data": "/d"}) is None


def test_the_supervisor_starts_without_torch() -> None:
    check = "import sys, engine.supervisor.supervisor; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", check]).returncode == 0


def test_status_parent_is_read_from_a_branchs_first_checkpoint(tmp_path: Path) -> None:
    trunk = LineLayout(tmp_path / "trunk")
    write_checkpoint(trunk, 0, cycle=0, kept="line-start")
    assert branched_from(trunk) is None and branched_from(LineLayout(tmp_path / "empty")) is None
    branch = LineLayout(tmp_path / "branch")
    first = write_checkpoint(branch, 9, cycle=0, kept="branch-start")
    state = json.loads((first / "state.json").read_text())
    state["branched_from"] = {"line": str(trunk.root), "checkpoint": "u00000009", "cycle": 0}
    (first / "state.json").write_text(json.dumps(state))
    write_checkpoint(branch, 14, cycle=0)
    assert branched_from(branch) == str(trunk.root)
