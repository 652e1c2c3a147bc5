"""W&B continuity: one W&B run per line that mirrors rows.jsonl, whatever happens to the line.

The trainer appends each row to rows.jsonl and hands it to a `WandbMirror`; the mirror sends
rows to W&B from a background thread, so training never waits on W&B and never fails because
of it. `rows.jsonl` stays the line's own record: whatever W&B missed (a crash, an outage, a
rollback, a branch) is sent again from it, in order, so the W&B curve has no hole.

- Start: continue the line's run (`wandb_run.json` keeps its id) and re-send every row after the
  last step the server acknowledged; carry out a rewind or fork planned by `plan_rollback` /
  `plan_branch` (see engine.wandb.start for what each sends). A damaged or lost wandb_run.json
  does not start a new run beside the line's: the run its newest checkpoint records continues
  (engine.wandb.recovery).
- Replayed updates: online, the rows of updates the trainer trains again after a resume (the
  server got them before the crash) are compared with the server's copy instead of being sent
  again; a difference is recorded in wandb_run.json and reported (run.log), one line per update.
- Outage: each W&B call that fails is retried with exponential backoff. After `give_up_after_s`
  (2 h) of failures the rows held in memory are dropped and recorded as a gap in
  wandb_run.json; they are re-sent from rows.jsonl when W&B answers again, or by the next start.
- Close: bounded in time; whatever was not handed over is re-sent by the next start. A trainer
  stopping for a fault abandons the mirror instead: no wait at all (on a full disk W&B cannot write
  either, and finishing the run held the trainer's exit for the whole close limit); the run is left
  as a crash leaves it, and the next start continues it and re-sends what it lacks.
- The client's local files of cleanly finished runs are removed at the next start (offline
  runs once `wandb sync` has marked them synced after their last write, finished or crashed:
  before that they are the only copy; or at once when their log holds no record).

The trainer uses:

    mirror = WandbMirror(line_dir, config.wandb, run_config=config.to_dict(), report=run_log.write)
    mirror.start()
    ...; append row to rows.jsonl; mirror.log(row)          # never blocks
    state["wandb"] = mirror.checkpoint_record()               # in each checkpoint
    mirror.close(timeout_s=30.0)                              # at a stop
    mirror.abandon()                                          # at a fault: never waits

Call `start()` once rows.jsonl is consistent with the state being resumed (the trainer has cut
the rows past its checkpoint): the mirror reads it to re-send what W&B lacks.
"""

from __future__ import annotations

import copy
import functools
import logging
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config.run import WandbConfig
from engine.errors import LineError
from engine.layout import LineLayout
from engine.wandb.backend import RealWandbBackend, WandbBackend
from engine.wandb.recovery import load_or_recover
from engine.wandb.replay import ReplayWindow, describe
from engine.wandb.rows import read_rows, row_update, row_values
from engine.wandb.start import StartContext, mark_superseded_runs, start_run
from engine.wandb.state import (
    Gap,
    LocalRunFiles,
    PendingStart,
    ReplayMismatch,
    WandbRunState,
    WandbStateError,
    synced_after_last_write,
)
from engine.wandb.txlog import FILE_HEADER, transaction_log_of

logger = logging.getLogger("nsconsole.wandb")

CLOSE_CONNECT_ATTEMPTS = 3
"""Failed connections while closing before the mirror gives up on handing its rows over. W&B out at
the close (not installed, an offline host, a run id still held by a killed trainer) would otherwise
hold every stop and relaunch of the line for the close's whole limit; the next start re-sends what
was not handed over, from rows.jsonl."""
CRASHED_ONLINE_KEPT = 2
"""Directories of crashed online sessions kept (the newest), for their debug logs. Nothing else needs
them: the server holds what their client uploaded, and the next start re-sends from rows.jsonl what
it lacks; each holds its session's rows again, so a line killed hundreds of times kept GiBs."""
CLOSE_CONNECT_PAUSE_S = 1.0
"""The longest wait between those connections: not the outage's backoff, grown to minutes by then,
which held the stop for the close's whole limit all the same."""


@dataclass(frozen=True)
class RetryPolicy:
    """How long and how often a failing W&B is tried again."""

    first_delay_s: float = 1.0
    """The wait after the first failure; doubled after each further failure."""
    max_delay_s: float = 300.0
    """The longest wait between two tries (W&B is still tried this often after giving up rows)."""
    give_up_after_s: float = 7200.0
    """After this long without success, the rows held in memory are given up (recorded as a gap)."""


@dataclass(frozen=True)
class MirrorOptions:
    """Tuning of a `WandbMirror` (the defaults are what a line uses)."""

    retry: RetryPolicy = field(default_factory=RetryPolicy)
    """Retries while W&B fails."""
    acknowledge_every_s: float = 30.0
    """How often the server's acknowledged step is read and saved to wandb_run.json."""
    max_queued_rows: int = 20_000
    """Rows held in memory while W&B lags; past it they are dropped and re-read from rows.jsonl later."""
    finish_timeout_s: float = 60.0
    """How long the real client may take to finish a run (upload what is left)."""


@dataclass(frozen=True)
class MirrorStatus:
    """What the mirror is doing, for the supervisor and the console."""

    mode: str
    """online, offline or disabled."""
    run_id: str | None
    """The line's W&B run."""
    start: str | None
    """The kind of this session's start: new, resume, fork or rewind."""
    connected: bool
    """A run is started and the last W&B call succeeded."""
    sent_through: int | None
    """The last update handed to W&B."""
    acknowledged_step: int | None
    """The last update the server acknowledged."""
    queued: int
    """Rows waiting in memory."""
    gap: tuple[int, int] | None
    """Updates given up (from, to), to be re-sent from rows.jsonl."""
    last_error: str | None
    """The last W&B failure, while W&B is failing."""


class WandbMirror:
    """Mirrors a line's rows to its W&B run from a background thread."""

    def __init__(
        self,
        line_dir: Path | str,
        settings: WandbConfig,
        run_config: dict[str, Any] | None = None,
        *,
        backend: WandbBackend | None = None,
        options: MirrorOptions | None = None,
        new_run_id: Callable[[], str] | None = None,
        report: Callable[[str], None] | None = None,
    ) -> None:
        """`report` writes a line for the operator (the trainer's run.log); default: a warning."""
        self.layout = LineLayout(line_dir)
        self.settings = settings
        self.options = options or MirrorOptions()
        self.enabled = settings.mode != "disabled"
        self._backend = backend
        self._run_config = run_config or {}
        self._new_run_id = new_run_id or _generate_run_id
        self._report = report or logger.warning
        self._save_failed = False
        """The last save of wandb_run.json failed (reported once, until a save succeeds again)."""
        self._state = WandbRunState()
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._queue: deque[dict[str, Any]] = deque()
        self._closing = False
        self._abandoned = False
        """Closing without handing anything over or finishing the run (`abandon`)."""
        self._close_deadline = 0.0
        self._connected = False
        self._sent_through: int | None = None
        self._gap: Gap | None = None
        self._last_error: str | None = None
        self._outage_since: float | None = None
        self._delay = self.options.retry.first_delay_s
        self._next_acknowledge = 0.0
        self._replay_through: int | None = None
        """The last step the server held when the run was continued: replayed rows up to it are compared."""
        self._replay_window: ReplayWindow | None = None
        self._replayed: list[dict[str, Any]] = []
        """Replayed rows taken off the queue, waiting to be compared with the server's copy."""
        self._thread: threading.Thread | None = None

    # The trainer's side: never blocks on W&B.

    def start(self) -> None:
        """Start the background thread (it connects, re-sends what W&B lacks, then mirrors)."""
        if not self.enabled or self._thread is not None:
            return
        # Read here, not in the thread: a checkpoint taken right after the start names the run.
        self._load_state()
        self._thread = threading.Thread(target=self._work, name="nsconsole-wandb", daemon=True)
        self._thread.start()

    def log(self, row: dict[str, Any]) -> None:
        """Queue one row (already appended to rows.jsonl) for W&B."""
        if not self.enabled or row_update(row) is None:
            return
        row = dict(row)  # the trainer may reuse its dict; the queued row must not change
        with self._lock:
            if self._closing:
                return
            if self._gap is not None:
                # Rows given up: new ones join the gap and are read back from rows.jsonl later.
                self._gap.to_update = max(self._gap.to_update, row["update"])
            elif len(self._queue) >= self.options.max_queued_rows:
                self._queue.append(row)
                self._give_up_queued_rows()
            else:
                self._queue.append(row)
            self._wakeup.notify()

    def close(self, timeout_s: float = 30.0) -> bool:
        """Hand over what is queued, finish the run; returns False if that took longer than `timeout_s`.

        Whatever is not handed over by then is re-sent from rows.jsonl by the next start.
        """
        if self._thread is None:
            return True
        with self._lock:
            self._closing = True
            self._close_deadline = time.monotonic() + timeout_s
            self._wakeup.notify()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def abandon(self) -> None:
        """Stop mirroring now, without waiting, handing over what is queued or finishing the run.

        For a trainer that stops for a fault: its exit must not wait on W&B (on a full disk the
        client's own writes fail, and `close` waited out its whole limit). The background thread
        ends at its next look at the queue; the run is left as a crash leaves it, and the next
        start continues it and re-sends from rows.jsonl what W&B lacks.
        """
        if self._thread is None:
            return
        with self._lock:
            self._closing = True
            self._abandoned = True
            self._close_deadline = time.monotonic()
            self._wakeup.notify()

    def checkpoint_record(self) -> dict[str, Any] | None:
        """The line's W&B run as a checkpoint's state.json keeps it (None: W&B is disabled).

        A rollback or branch from the checkpoint can tell which run (and how far acknowledged)
        the checkpoint's updates belong to.
        """
        if not self.enabled:
            return None
        with self._lock:
            return {"run_id": self._state.run_id, "acknowledged_step": self._state.acknowledged_step}

    def status(self) -> MirrorStatus:
        with self._lock:
            gap = (self._gap.from_update, self._gap.to_update) if self._gap else None
            return MirrorStatus(
                mode=self.settings.mode,
                run_id=self._state.run_id,
                start=self._state.start,
                connected=self._connected,
                sent_through=self._sent_through,
                acknowledged_step=self._state.acknowledged_step,
                queued=len(self._queue),
                gap=gap,
                last_error=self._last_error,
            )

    # The background thread.

    def _work(self) -> None:
        try:
            adopt_untracked_local_files(self._state, self.layout.wandb_dir)
            remove_finished_local_files(self._state)
            self._save_state()
            if self._backend is None:
                finish_timeout_s = self.options.finish_timeout_s
                self._backend = RealWandbBackend(self.settings, self.layout.root, finish_timeout_s)
            self._mirror()
        except Exception:  # the mirror must never take the trainer down with it
            logger.exception("W&B mirror stopped")

    def _mirror(self) -> None:
        first_start = True
        failed_while_closing = 0
        while not self._should_stop():
            if not self._connected:
                if self._attempt(self._connect):
                    if first_start:
                        self._mark_superseded()
                        first_start = False
                elif self._is_closing() and (failed_while_closing := failed_while_closing + 1) >= CLOSE_CONNECT_ATTEMPTS:
                    break
                else:
                    closing = self._is_closing()
                    self._wait(min(self._delay, CLOSE_CONNECT_PAUSE_S) if closing else self._delay)
                    self._delay = min(self._delay * 2, self.options.retry.max_delay_s)
                continue
            if self._gap is not None and not self._attempt(self._catch_up):
                continue
            row = self._next_row(wait=True)
            self._compare_replayed()
            if row is not None and not self._attempt(functools.partial(self._send, row)):
                continue
            self._acknowledge_when_due()
        self._shutdown()

    def _connect(self) -> None:
        context = StartContext(self._backend, self.layout, self._state, self._run_config, self._new_run_id,
                               say=self._say)
        sent_through = start_run(context)
        with self._lock:
            self._sent_through = sent_through
            self._connected = True
            self._replay_through = context.server_through
            self._replay_window = None
            if self._gap is not None and sent_through is not None and sent_through >= self._gap.to_update:
                self._gap = None
            self._state.gap = self._gap
        self._save_state()
        self._next_acknowledge = time.monotonic() + self.options.acknowledge_every_s

    def _catch_up(self) -> None:
        """Send the given-up rows from rows.jsonl; the gap closes once nothing is left in it."""
        while True:
            with self._lock:
                assert self._gap is not None
                through = self._gap.to_update
            for row in read_rows(self.layout.rows_jsonl, after=self._sent_through, through=through):
                self._send(row)
            with self._lock:
                if self._gap.to_update == through:
                    self._gap = None
                    self._state.gap = None
                    break
        self._save_state()

    def _next_row(self, wait: bool) -> dict[str, Any] | None:
        """The oldest queued row not sent yet (left queued until it is sent)."""
        with self._lock:
            while True:
                while self._queue:
                    update = row_update(self._queue[0])
                    if self._sent_through is None or update > self._sent_through:
                        return self._queue[0]
                    # Already sent (from rows.jsonl at the start), or a replayed update the server
                    # had before the crash: that one is compared with the server's copy.
                    sent = self._queue.popleft()
                    if self._replay_through is not None and update <= self._replay_through:
                        self._replayed.append(sent)
                if not wait or self._closing or self._gap is not None or self._replayed:
                    return None
                timeout = max(0.0, self._next_acknowledge - time.monotonic())
                if timeout == 0.0:
                    return None
                self._wakeup.wait(timeout)

    def _send(self, row: dict[str, Any]) -> None:
        update = row_update(row)
        assert update is not None
        self._backend.log(row_values(row), step=update)
        with self._lock:
            self._sent_through = update
            if self._queue and self._queue[0] is row:
                self._queue.popleft()

    def _attempt(self, operation: Callable[[], None]) -> bool:
        """Run one W&B operation; on failure note the outage and give rows up once it is too long."""
        try:
            operation()
        except Exception as error:  # any failure of W&B is an outage to ride out
            now = time.monotonic()
            with self._lock:
                self._connected = False
                self._last_error = f"{type(error).__name__}: {error}"
                began = self._outage_since is None
                if began:
                    self._outage_since = now
                if now - self._outage_since >= self.options.retry.give_up_after_s:
                    self._give_up_queued_rows()
            if began:
                # One line per outage, not per retry: a weeks-long line's run.log stays readable.
                self._say(
                    f"W&B failed ({self._last_error}); retrying in the background, and every row "
                    f"stays in {self.layout.rows_jsonl.name} to be sent once W&B answers"
                )
            self._discard_run()
            self._save_state()
            return False
        with self._lock:
            since, self._outage_since = self._outage_since, None
            self._last_error = None
        if since is not None:
            self._say(f"W&B answers again after {time.monotonic() - since:.0f} s of failures")
        self._delay = self.options.retry.first_delay_s
        return True

    def _compare_replayed(self) -> None:
        """Compare the replayed rows taken off the queue with the server's rows at their steps."""
        with self._lock:
            replayed, self._replayed = self._replayed, []
        found: list[list[ReplayMismatch]] = []
        for row in replayed:
            update = row_update(row)
            assert update is not None
            window = self._replay_window
            if window is None or not window.covers(update):
                window = self._read_replay_window(after=update - 1)
                if window is None:
                    break  # no server copy to compare with (offline, or it could not be read)
            mismatches = window.compare(update, row_values(row))
            if mismatches:
                found.append(mismatches)
        if not found:
            return
        with self._lock:
            for mismatches in found:
                self._state.record_replay_mismatches(mismatches)
            run_id = self._state.run_id
        self._save_state()
        for mismatches in found:
            self._report(describe(run_id, mismatches))

    def _read_replay_window(self, after: int) -> ReplayWindow | None:
        """The server's rows from `after` to the step it held at the resume; None: none to compare."""
        with self._lock:
            through = self._replay_through
        if through is None or after >= through:
            return None
        try:
            rows = self._backend.server_rows(after, through)
        except Exception as error:  # reading back is a check: its failure never stops the mirror
            self._report(
                f"W&B: could not read the server's copy of updates {after + 1}..{through} ({error}); "
                "the replayed updates are not compared"
            )
            rows = None
        if rows is None:
            with self._lock:
                self._replay_through = None
            return None
        self._replay_window = ReplayWindow(after, through, rows)
        return self._replay_window

    def _give_up_queued_rows(self) -> None:
        """Drop the rows held in memory, recording them as the gap (caller holds the lock)."""
        updates = [row_update(row) for row in self._queue]
        updates = [update for update in updates if update is not None]
        self._queue.clear()
        if not updates:
            return
        if self._gap is None:
            self._gap = Gap(from_update=updates[0], to_update=updates[-1])
            first, rows_name = updates[0], self.layout.rows_jsonl.name
            self._say(f"W&B: gave up holding rows from update {first}; they are re-sent from {rows_name}")
        else:
            self._gap.to_update = max(self._gap.to_update, updates[-1])
        self._state.gap = self._gap

    def _discard_run(self) -> None:
        """After a failure, drop the client's run (best effort) so the next try starts cleanly."""
        try:
            self._backend.finish()
        except Exception as error:  # the client may be as broken as the call that failed
            logger.debug("finishing a failed W&B run: %s", error)

    def _acknowledge_when_due(self) -> None:
        if time.monotonic() < self._next_acknowledge:
            return
        self._next_acknowledge = time.monotonic() + self.options.acknowledge_every_s
        self._attempt(self._acknowledge)

    def _acknowledge(self) -> None:
        acknowledged = self._backend.acknowledged_step()
        if acknowledged is None:
            return
        with self._lock:
            known = self._state.acknowledged_step
            if known is not None and acknowledged <= known:
                return
            self._state.acknowledged_step = acknowledged
        self._save_state()

    def _mark_superseded(self) -> None:
        context = StartContext(self._backend, self.layout, self._state, self._run_config, self._new_run_id,
                               say=self._say)
        mark_superseded_runs(context)

    def _shutdown(self) -> None:
        """Closing: hand over the queued rows while time is left, then finish the run."""
        if self._abandoned:
            return
        if not self._connected:
            self._save_state()
            return
        try:
            while time.monotonic() < self._close_deadline:
                row = self._next_row(wait=False)
                if row is None:
                    break
                self._send(row)
            finished = self._backend.finish()
        except Exception as error:  # closing must end; the next start re-sends what is missing
            logger.warning("W&B: closing the run failed (%s)", error)
            finished = False
        with self._lock:
            self._connected = False
            if finished and self._sent_through is not None:
                # A clean finish hands everything over: the server (or local log) holds it all.
                self._state.acknowledged_step = self._sent_through
        if finished:
            self._mark_local_files_finished()
        self._save_state()

    def _mark_local_files_finished(self) -> None:
        """The run's directory of this session (the newest one of the run) is finished cleanly."""
        for entry in reversed(self._state.local_files):
            if entry.run_id == self._state.run_id:
                entry.finished = True
                return

    # Helpers.

    def _is_closing(self) -> bool:
        with self._lock:
            return self._closing

    def _should_stop(self) -> bool:
        """Closing, and either everything queued is handed over or the time is up."""
        with self._lock:
            if not self._closing:
                return False
            if time.monotonic() >= self._close_deadline:
                return True
            return self._connected and not self._queue and self._gap is None

    def _wait(self, seconds: float) -> None:
        with self._lock:
            if self._closing:
                seconds = min(seconds, max(0.0, self._close_deadline - time.monotonic()))
            self._wakeup.wait(seconds)

    def _load_state(self) -> None:
        # A damaged or lost wandb_run.json: the run a checkpoint records continues (the damaged
        # file is set aside first); where none records one, a new run backfilled from rows.jsonl.
        self._state = load_or_recover(self.layout, self._say, online=self.settings.mode == "online")
        # A gap left by an earlier session needs nothing of its own: the start re-sends every
        # row after the acknowledged step, which lies before the gap.
        self._gap = None

    def _save_state(self) -> None:
        with self._lock:
            self._state.gap = self._gap
            # Written from a copy, outside the lock: `log()` takes the lock, and the training loop
            # must not wait on this file's fsync.
            snapshot = copy.deepcopy(self._state)
        try:
            snapshot.save(self.layout.wandb_run_json)
        except OSError as error:  # a full disk must not stop training; the trainer notices it
            if not self._save_failed:
                self._say(f"W&B: could not save {self.layout.wandb_run_json}: {error.strerror or error}")
            self._save_failed = True
        else:
            self._save_failed = False

    def _say(self, message: str) -> None:
        """One line for the operator (run.log); a log that cannot be written (a full disk) must not
        stop the mirror, so the line then goes to the logger."""
        try:
            self._report(message)
        except OSError:
            logger.warning("%s", message)


def _generate_run_id() -> str:
    from wandb.sdk.lib.runid import generate_id

    return generate_id()


def remove_finished_local_files(state: WandbRunState) -> None:
    """Remove the client's directories of earlier sessions that nothing needs any more: online, of
    cleanly finished runs, and of crashed ones but the newest `CRASHED_ONLINE_KEPT`; offline, once
    `wandb sync` uploaded all their log holds, crashed sessions' included (a line that restarts
    hundreds of times would keep every one of those otherwise)."""
    crashed_online = [entry for entry in state.local_files if not entry.offline and not entry.finished]
    kept_crashed = {id(entry) for entry in crashed_online[len(crashed_online) - CRASHED_ONLINE_KEPT:]}
    kept = []
    for entry in state.local_files:
        directory = Path(entry.path)
        if not directory.exists():
            continue
        if entry.offline:
            needless = synced_after_last_write(directory) or log_is_empty(directory)
        else:
            needless = entry.finished or id(entry) not in kept_crashed
        if needless:
            shutil.rmtree(directory, ignore_errors=True)
            continue
        kept.append(entry)
    state.local_files = kept


def adopt_untracked_local_files(state: WandbRunState, wandb_dir: Path) -> None:
    """List the client's directories of this line's runs that wandb_run.json lacks: a trainer
    killed while `wandb.init` ran (seconds, at each start) left one before the mirror recorded it,
    and a directory never listed is never removed."""
    run_ids = {state.run_id, *(entry.run_id for entry in state.superseded)}
    if state.pending is not None:
        run_ids.add(state.pending.new_run_id)
    listed = {Path(entry.path).resolve() for entry in state.local_files}
    # The client names them `run-<time>-<id>` (online) and `offline-run-<time>-<id>`.
    for directory in sorted(wandb_dir.glob("*run-*-*")):
        run_id = directory.name.rsplit("-", 1)[1]
        if directory.is_symlink() or not directory.is_dir() or run_id not in run_ids:
            continue
        if directory.resolve() not in listed:
            offline = directory.name.startswith("offline-")
            state.local_files.append(LocalRunFiles(str(directory), run_id, offline=offline))


def log_is_empty(directory: Path) -> bool:
    """Whether the directory's log holds no record (its session ended before it logged any)."""
    log = transaction_log_of(directory)
    return log is None or log.stat().st_size <= len(FILE_HEADER)


def plan_rollback(line_dir: Path | str, to_update: int) -> None:
    """Record that the line was rolled back to `to_update`; its next start rewinds the W&B run.

    Called by the rollback operation before the trainer is started again. Where the server can
    rewind, the run continues from `to_update`; elsewhere a new run is backfilled from rows.jsonl
    up to `to_update` and the old run is marked superseded.
    """
    layout = LineLayout(line_dir)
    try:
        state = WandbRunState.load(layout.wandb_run_json)
    except WandbStateError as error:
        # Refused, the file left as it is: a rollback is the user's act, so the user decides; the
        # start that follows a move recovers the run (engine.wandb.recovery).
        raise WandbStateError(
            f"{error}; the rollback changed nothing: move the file aside and roll back again (the next start "
            "continues the W&B run the line's checkpoints record)"
        ) from None
    if state.pending is not None and state.pending.kind == "fork":
        if to_update < state.pending.at_update:
            raise LineError(
                f"{layout.wandb_run_json.name}: the branch starts at update {state.pending.at_update}; "
                f"it cannot be rolled back to {to_update}"
            )
        return  # the branch's run does not exist yet: its first start forks it as planned
    if state.run_id is None:
        return  # no run yet: the first start sends the rows as they are then
    state.pending = PendingStart(kind="rewind", at_update=to_update)
    state.gap = None  # the rewound run is rebuilt from rows.jsonl up to the rollback point
    state.save(layout.wandb_run_json)


def plan_branch(branch_dir: Path | str, parent_dir: Path | str, at_update: int) -> None:
    """Record that the line at `branch_dir` branches from `parent_dir` after update `at_update`.

    Called by the branch operation once the branch's directory exists. The branch's first start
    forks the parent's run at `at_update` where the server can, else starts a new run
    backfilled from the parent's rows.jsonl up to `at_update`.
    """
    branch = LineLayout(branch_dir)
    parent = LineLayout(parent_dir)
    existing = WandbRunState.load(branch.wandb_run_json)
    if existing.run_id is not None:
        raise LineError(f"{branch.wandb_run_json}: the branch already has W&B run {existing.run_id}")
    parent_state = WandbRunState.load(parent.wandb_run_json)
    state = WandbRunState(
        pending=PendingStart(
            kind="fork",
            at_update=at_update,
            parent_run_id=parent_state.run_id,
            parent_rows=str(parent.rows_jsonl.resolve()),
            parent_acknowledged=parent_state.acknowledged_step,
        ),
        # What the server refused for the parent it refuses for the branch too.
        fork_unsupported=parent_state.fork_unsupported,
        rewind_unsupported=parent_state.rewind_unsupported,
    )
    state.save(branch.wandb_run_json)
