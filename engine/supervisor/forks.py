"""Branches asked of a running line: forked at once when their trunk cycle has ended, else queued.

A `branch` call names a cycle of the trunk. When that cycle's kept "cycle-end" checkpoint is
part of the line, `engine.ops.branch.branch_line` forks the branch there and then. When the cycle has
not ended yet, everything but the fork checkpoint itself is checked now
(`engine.ops.branch.check_branch_request`: the plan, the target directory, the data line, its
tokenizer and held-out rows, whether the trunk reaches that cycle's end, the schedule there) and
the request waits in a queue that the supervisor keeps in supervisor.json, so a restarted
supervisor still performs it. The supervisor's loop calls `poll`:
whenever `latest` moves (or a request joins the queue), the cycle ends are looked for, and the due
forks are made on a worker thread, so that hashing a large fork checkpoint does not hold up the
trainer's watch (a queued fork's cycle end is pinned, `checkpoints/pinned`, from the moment it is
queued until the fork is made or fails: `checkpoints.keep_cycle_ends` does not remove it meanwhile,
though the next cycle may end before the loop sees this one's). A branch forked at once is announced (`on_forked`, where the supervisor starts the
branch's own supervisor) on a worker thread too, so that the `branch` call is answered without
waiting for that start. When the line reaches its end, `finish_line` reports the forks whose cycle
never came as failed. Failed forks stay listed (`failed`, for the `status` reply) until a branch
into the same directory is asked for again.

The supervisor starts without torch (seconds, and memory, for a process that only watches): this
module and `engine.ops.branch` read checkpoints through the torch-free `engine.checkpoints.format`.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from datalines.errors import DataLineError
from engine.checkpoints.format import (
    PINNED_NAME,
    cycle_of_kept,
    pin_cycle_end,
    pin_file_problems,
    read_checkpoint_state,
    restore_queue_pins,
    unpin_cycle_end,
)
from engine.errors import CheckpointError, LineError
from engine.layout import LineLayout, checkpoint_update
from engine.supervisor.reads import latest_update

if TYPE_CHECKING:
    from engine.ops.branch import BranchRequest, BranchResult


@dataclass
class QueuedFork:
    """One branch asked for over the socket (kept in supervisor.json while it waits)."""

    path: str
    """The branch line's directory (absolute)."""
    at_cycle: int
    """The trunk's data cycle at whose end the branch forks."""
    plan: str
    """The branch's stages, as `nsconsole branch --plan` takes them."""
    data: str
    """The branch's own data line (absolute)."""
    long_seq_len: int | None = None
    """The length of `long` stages (None: `engine.ops.branch`'s default)."""
    requested: float = 0.0
    """When it was asked for (Unix time)."""

    def request(self, parent: Path) -> BranchRequest:
        # The branch operation brings numpy and the data line's readers: imported when a fork is
        # made or checked, so that `nsconsole status` and the console can read queued forks light.
        from engine.ops.branch import BranchRequest

        return BranchRequest(
            new=Path(self.path), parent=parent, at_cycle=self.at_cycle, plan=self.plan,
            data=Path(self.data), long_seq_len=self.long_seq_len,
        )

    @classmethod
    def from_json(cls, record: Any) -> QueuedFork | None:
        """A record of supervisor.json (None when it is not one: a hand-edited file costs the entry)."""
        if not isinstance(record, dict):
            return None
        names = {field.name for field in dataclasses.fields(cls)}
        try:
            fork = cls(**{key: value for key, value in record.items() if key in names})
        except TypeError:
            return None
        typed = isinstance(fork.path, str) and isinstance(fork.plan, str) and isinstance(fork.data, str)
        return fork if typed and isinstance(fork.at_cycle, int) else None


@dataclass
class FailedFork:
    """A queued branch that could not be made (the `status` reply's `failed_forks`)."""

    path: str
    """The branch line's directory (absolute)."""
    at_cycle: int
    """The trunk's data cycle at whose end it was to fork."""
    reason: str
    """Why it was not made (one line)."""
    time: float
    """When it failed (Unix time)."""


def checkpoint_directories(layout: LineLayout) -> list[tuple[int, Path]]:
    """The line's finished checkpoints, (update, directory), oldest first."""
    try:
        entries = list(layout.checkpoints.iterdir())
    except FileNotFoundError:
        return []
    found = [(checkpoint_update(entry.name), entry) for entry in entries if entry.is_dir()]
    return sorted((update, entry) for update, entry in found if update is not None)


def cycle_end_checkpoint(layout: LineLayout, cycle: int) -> Path | None:
    """The kept checkpoint of `cycle`'s end once the line stands on or past it, else None.

    A checkpoint after `latest` belongs to a continuation that a rollback abandoned: its cycle end
    is not the line's (the cycle will end again).
    """
    latest = latest_update(layout)
    if latest is None:
        return None
    for update, checkpoint in checkpoint_directories(layout):
        if update > latest:
            break
        if cycle_of_kept((read_checkpoint_state(checkpoint) or {}).get("kept")) == cycle:
            return checkpoint
    return None


def current_cycle(layout: LineLayout) -> int | None:
    """The data cycle the line's latest checkpoint stands in (None: no checkpoint yet)."""
    latest = latest_update(layout)
    if latest is None:
        return None
    cycle = (read_checkpoint_state(layout.checkpoint(latest)) or {}).get("position", {}).get("cycle")
    return cycle if isinstance(cycle, int) else None


class ForkQueue:
    """The line's branch requests (see the module docstring). Thread-safe.

    `on_forked(fork, result)` and `on_failed(fork, message)` tell the supervisor what happened (it
    starts the branch's supervisor and publishes `branched` / `branch_failed` events); `on_change()`
    after the queue changed (it saves supervisor.json). `on_forked` runs on a worker thread, never on
    the thread of `branch` or `poll` (only `finish_line` makes the due forks, and tells, on its own).
    """

    def __init__(
        self,
        layout: LineLayout,
        on_forked: Callable[[QueuedFork, BranchResult], None],
        on_failed: Callable[[QueuedFork, str], None],
        on_change: Callable[[], None],
    ) -> None:
        self.layout = layout
        self.on_forked = on_forked
        self.on_failed = on_failed
        self.on_change = on_change
        self._forks: list[QueuedFork] = []
        self._failed: list[FailedFork] = []
        self._lock = threading.Lock()  # guards _forks, _failed, _latest_seen and _changed
        self._forking = threading.Lock()  # one branch_line at a time (a queued and an asked one may meet)
        self._latest_seen: int | None = None
        self._changed = True  # look for cycle ends at the next poll, whatever `latest` says
        self._worker: threading.Thread | None = None
        self._announcers: list[threading.Thread] = []  # on_forked of the forks made at once

    def export(self) -> list[dict[str, Any]]:
        with self._lock:
            return [dataclasses.asdict(fork) for fork in self._forks]

    def failed(self) -> list[dict[str, Any]]:
        """The forks that failed (oldest first), as the `status` reply lists them."""
        with self._lock:
            return [dataclasses.asdict(fork) for fork in self._failed]

    def restore(self, records: Any) -> list[str]:
        """Take back what `export` gave (a previous supervisor's queue, at this one's start), and
        the pins with it: the ends of the cycles its forks wait for are pinned (already, unless a
        hand edit lost them), and a pin that no fork waits for any more is dropped -- one that a
        supervisor killed (SIGKILL) left between pinning and saving its queue, or while it forked
        or rolled back (`restore_queue_pins`). Returns run.log's lines on what it dropped, and on
        the pin file's lines that pin nothing."""
        records = records if isinstance(records, list) else []
        forks = [fork for fork in map(QueuedFork.from_json, records) if fork is not None]
        checkpoints = self.layout.checkpoints
        try:
            dropped = restore_queue_pins(checkpoints, {fork.at_cycle for fork in forks})
        except CheckpointError:
            dropped = []  # left as it is: `pin_file_problems` says why
        notes = [f"{checkpoints / PINNED_NAME}: dropped the pin {json.dumps(line)}, left by a supervisor that ended "
                 "before taking it back (no queued branch forks there and no rollback runs); retention treats "
                 "its checkpoint as any other again" for line in dropped]
        with self._lock:
            self._forks.extend(forks)
            self._changed = True
        return notes + pin_file_problems(checkpoints)

    def branch(self, fork: QueuedFork) -> dict[str, Any]:
        """An asked-for branch: `{"state": "forked", ...}` made now, or `{"state": "queued", ...}`."""
        with self._lock:
            if any(queued.path == fork.path for queued in self._forks):
                raise LineError(f"{fork.path}: a branch into it is already queued")
            checkpoint = cycle_end_checkpoint(self.layout, fork.at_cycle)
            if checkpoint is None:
                from engine.ops.branch import check_branch_request

                check_branch_request(fork.request(self.layout.root))
                # Retention (`checkpoints.keep_cycle_ends`) must not remove the fork point before the
                # fork is made: the next cycle may end before this loop sees the one it waits for.
                pin_cycle_end(self.layout.checkpoints, fork.at_cycle)
                self._forks.append(fork)
                self._changed = True
            self._failed = [failed for failed in self._failed if failed.path != fork.path]
        if checkpoint is None:
            self.on_change()
            return {"state": "queued", "path": fork.path, "at_cycle": fork.at_cycle}
        result = self._fork(fork)
        self._announce_in_background(fork, result)
        return {
            "state": "forked", "path": str(result.line), "at_cycle": fork.at_cycle,
            "fork_update": result.fork_update, "fork_tokens": result.fork_tokens,
        }

    def poll(self) -> None:
        """From the supervisor's loop: start making the forks whose cycle has ended (on a worker)."""
        if self._worker is not None and self._worker.is_alive():
            return  # it looks again once the worker is done (`_latest_seen` has not moved)
        due = self._take_due()
        if due:
            self._worker = threading.Thread(target=self._make, args=(due,), name="branch-forks", daemon=True)
            self._worker.start()

    def finish_line(self, line_ended: bool = True) -> None:
        """The trainer has finished: make what is due; when the line has reached its end (not only a
        `--stop-at`), fail the forks whose cycle never came."""
        self.close()
        self._make(self._take_due(force=True))
        if not line_ended:
            return
        cycle = current_cycle(self.layout)
        with self._lock:
            never, self._forks = self._forks, []
            for at_cycle in {fork.at_cycle for fork in never}:
                unpin_cycle_end(self.layout.checkpoints, at_cycle)
            failures = [
                FailedFork(fork.path, fork.at_cycle, f"the line ended in cycle {cycle} before cycle "
                           f"{fork.at_cycle} ended", time.time())
                for fork in never
            ]  # fmt: skip
            self._failed += failures
        for fork, failure in zip(never, failures, strict=True):
            self.on_failed(fork, failure.reason)
        if never:
            self.on_change()

    def close(self) -> None:
        """Wait for a fork in the making (as long as verifying and linking its checkpoint takes) and
        for the announcements of forks made at once (as long as starting their supervisors takes)."""
        if self._worker is not None:
            self._worker.join()
        with self._lock:
            announcers, self._announcers = self._announcers, []
        for announcer in announcers:
            announcer.join()

    def _announce_in_background(self, fork: QueuedFork, result: BranchResult) -> None:
        # Starting the branch's supervisor takes seconds: the caller (an RPC thread) answers first.
        announcer = threading.Thread(
            target=self.on_forked, args=(fork, result), name="branch-announce", daemon=True
        )
        with self._lock:
            self._announcers = [thread for thread in self._announcers if thread.is_alive()]
            self._announcers.append(announcer)
        announcer.start()

    def _take_due(self, force: bool = False) -> list[QueuedFork]:
        latest = latest_update(self.layout)
        with self._lock:
            if not self._forks or not (force or self._changed or latest != self._latest_seen):
                return []
            self._latest_seen, self._changed = latest, False
            # A cycle the line has left whose kept checkpoint is gone (removed by hand) is due too: its
            # fork fails now, naming the missing checkpoint, rather than wait for an end that came.
            now = current_cycle(self.layout)
            return [fork for fork in self._forks if cycle_end_checkpoint(self.layout, fork.at_cycle)
                    or (now is not None and now > fork.at_cycle)]

    def _make(self, due: list[QueuedFork]) -> None:
        # Each stays queued (and saved) until it is made: a supervisor killed meanwhile tries it again
        # (`branch_line` builds a branch beside its place and renames it in, so no half-made line is left).
        for fork in due:
            result: BranchResult | None = None
            try:
                result = self._fork(fork)
            except (LineError, DataLineError) as error:
                failure = str(error)
            except Exception as error:  # the loop must go on; the operator is told
                failure = f"internal error: {type(error).__name__}: {error}"
            with self._lock:
                self._forks.remove(fork)
                if not any(queued.at_cycle == fork.at_cycle for queued in self._forks):
                    unpin_cycle_end(self.layout.checkpoints, fork.at_cycle)  # the branch holds its own link now
                if result is None:
                    self._failed.append(FailedFork(fork.path, fork.at_cycle, failure, time.time()))
            self.on_change()
            # Told once it has left the queue: whoever hears of it then sees the queue without it.
            if result is not None:
                self.on_forked(fork, result)
            else:
                self.on_failed(fork, failure)

    def _fork(self, fork: QueuedFork) -> BranchResult:

        with self._forking:
            from engine.ops.branch import branch_line

            # Pinned while its files are linked: the trainer's retention may run meanwhile.
            pin_cycle_end(self.layout.checkpoints, fork.at_cycle)
            try:
                return branch_line(fork.request(self.layout.root))
            finally:
                with self._lock:
                    if not any(queued.at_cycle == fork.at_cycle for queued in self._forks):
                        unpin_cycle_end(self.layout.checkpoints, fork.at_cycle)


def new_fork(
    path: Path, at_cycle: int, plan: str, data: Path, long_seq_len: int | None = None
) -> QueuedFork:
    """A request as the queue keeps it: absolute paths, the time it was asked."""
    return QueuedFork(str(path.absolute()), at_cycle, plan, str(data.absolute()), long_seq_len, time.time())
