"""The mirror's background thread: connect (start or continue the run and re-send what W&B lacks),
then send each queued row, riding out outages with backoff, reading the server's acknowledged step
now and then, and at the close hand over what is left and finish the run.

A mixin of `engine.wandb.mirror.WandbMirror`, sharing its state: the layout, settings, options,
backend, the lock and its condition, the queue, the closing flags and deadline, the connection,
outage and gap records, the step sent through, the update the trainer resumed from and the line's
`WandbRunState`; it compares replayed rows through `ReplayCheck` and saves and reports through the
mirror.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from engine.wandb.backend import RealWandbBackend
from engine.wandb.local_files import adopt_untracked_local_files, remove_finished_local_files
from engine.wandb.rows import read_rows, row_update, row_values
from engine.wandb.start import StartContext, mark_superseded_runs, start_run
from engine.wandb.state import Gap

logger = logging.getLogger("nsconsole.wandb")

CLOSE_CONNECT_ATTEMPTS = 3
"""Failed connections while closing before the mirror gives up on handing its rows over. W&B out at
the close (not installed, an offline host, a run id still held by a killed trainer) would otherwise
hold every stop and relaunch of the line for the close's whole limit; the next start re-sends what
was not handed over, from rows.jsonl."""
CLOSE_CONNECT_PAUSE_S = 1.0
"""The longest wait between those connections: not the outage's backoff, grown to minutes by then,
which held the stop for the close's whole limit all the same."""


class MirrorThread:
    """The background thread's work (mixed into `WandbMirror`)."""

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
                               say=self._say, resumed_from=self._resumed_from)
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
