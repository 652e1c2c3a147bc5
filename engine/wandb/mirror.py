"""W&B continuity: one W&B run per line that mirrors rows.jsonl, whatever happens to the line.

The trainer appends each row to rows.jsonl and hands it to a `WandbMirror`; the mirror sends
rows to W&B from a background thread, so training never waits on W&B and never fails because
of it. `rows.jsonl` stays the line's own record: whatever W&B missed (a crash, an outage, a
rollback, a branch) is sent again from it, in order, so the W&B curve has no hole.

- Start: continue the line's run (`wandb_run.json` keeps its id) and re-send every row after the
  last step the server acknowledged; carry out a rewind or fork planned by `plan_rollback` /
  `plan_branch` (see engine.wandb.start for what each sends). A damaged or lost wandb_run.json
  does not start a new run beside the line's: what it held is rebuilt from the line's checkpoints
  -- the run continued, rewound after a rollback, or a branch's fork made (engine.wandb.recovery).
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

    mirror = WandbMirror(line_dir, config.wandb, run_config=config.to_dict(), report=run_log.write,
                         resumed_from=checkpoint_update)
    mirror.start()
    ...; append row to rows.jsonl; mirror.log(row)          # never blocks
    state["wandb"] = mirror.checkpoint_record()               # in each checkpoint
    mirror.close(timeout_s=30.0)                              # at a stop
    mirror.abandon()                                          # at a fault: never waits

Call `start()` once rows.jsonl is consistent with the state being resumed (the trainer has cut
the rows past its checkpoint): the mirror reads it to re-send what W&B lacks. `resumed_from` (that
checkpoint's update) says how far those rows go: a rewind that waited out a session which trained
on (W&B out since the rollback) sends them all, not only those up to the rollback point.

Here is the trainer's side; the background thread's work is `MirrorThread` (engine.wandb.mirror_thread),
the replay check `ReplayCheck` (engine.wandb.mirror_replay), the client's local directories
engine.wandb.local_files, and `plan_rollback` / `plan_branch` engine.wandb.plans.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engine.config.run import WandbConfig
from engine.layout import LineLayout
from engine.wandb.backend import WandbBackend
from engine.wandb.mirror_options import MirrorOptions
from engine.wandb.mirror_options import (
    RetryPolicy as RetryPolicy,  # re-exported beside MirrorOptions, which holds it
)
from engine.wandb.mirror_replay import ReplayCheck
from engine.wandb.mirror_thread import MirrorThread
from engine.wandb.plans import plan_branch as plan_branch  # re-exported: engine.ops.branch plans here
from engine.wandb.plans import plan_rollback as plan_rollback  # re-exported: engine.ops.rollback plans here
from engine.wandb.recovery import load_or_recover
from engine.wandb.replay import ReplayWindow
from engine.wandb.rows import row_update
from engine.wandb.state import Gap, WandbRunState

logger = logging.getLogger("nsconsole.wandb")


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


class WandbMirror(MirrorThread, ReplayCheck):
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
        resumed_from: int | None = None,
    ) -> None:
        """`report` writes a line for the operator (the trainer's run.log); default: a warning.

        `resumed_from`: the update of the checkpoint the trainer resumed from, rows.jsonl cut back to
        it before `start` (None: a new line, or a caller that does not say; a planned rewind then
        sends rows.jsonl's rows only up to its rollback point, engine.wandb.start).
        """
        self.layout = LineLayout(line_dir)
        self.settings = settings
        self.options = options or MirrorOptions()
        self.enabled = settings.mode != "disabled"
        self._backend = backend
        self._run_config = run_config or {}
        self._new_run_id = new_run_id or _generate_run_id
        self._report = report or logger.warning
        self._resumed_from = resumed_from
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

        `run_id` and `acknowledged_step`, and `pending` (as wandb_run.json holds it) while a planned
        rewind or fork is not carried out yet. A rollback or branch from the checkpoint can tell which
        run (and how far acknowledged) the checkpoint's updates belong to, and a start that finds
        wandb_run.json damaged or lost, what the line's run is and what it still has to do.
        """
        if not self.enabled:
            return None
        with self._lock:
            record: dict[str, Any] = {"run_id": self._state.run_id, "acknowledged_step": self._state.acknowledged_step}
            if self._state.pending is not None:
                # A rewind or fork not carried out yet (W&B out since the rollback or branch): a start
                # that finds wandb_run.json lost carries it out from this record (engine.wandb.recovery).
                record["pending"] = asdict(self._state.pending)
            return record

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

    # The line's wandb_run.json and the operator's lines.

    def _load_state(self) -> None:
        # A damaged or lost wandb_run.json: rebuilt from the checkpoints (the damaged file is set
        # aside first); where they record nothing, a new run backfilled from rows.jsonl.
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
