"""A line's health: the checks of `nsconsole.health` run on what the console holds of it, each flag
newly raised told as an event.

A mixin of `nsconsole.lines.view.LineView`, sharing its state: it reads the rows, the heartbeat, the
trainer's launch and run.json's facts, and sets `health` (and `_row_checks`, the row checks' last run).
"""

from __future__ import annotations

from nsconsole import health
from nsconsole.health import HealthFlag
from nsconsole.lines.events import ConsoleEvent
from nsconsole.lines.rows import RECENT_ROWS


class LineHealth:
    """The line's health checks (mixed into `LineView`, whose rows, heartbeat and state it reads)."""

    def refresh_health(self, now: float) -> list[HealthFlag]:
        """Re-run the health checks; returns the flags that were not raised before (also as events)."""
        heartbeat = self.heartbeat or {}
        spike, slow, lr, skipped = self._row_health()
        ended = self.ended
        candidates = [
            spike,
            # A line that nothing runs has no pace and waits for nothing: its last rows' rate is no alarm.
            None if ended else slow,
            lr,
            # A line that nothing runs any more (read at rest, or orphaned) has ended: its old heartbeat is no alarm.
            health.stale_heartbeat(
                None if self.at_rest or self.orphaned else self.supervisor_state, self.heartbeat_age(now),
                stage=heartbeat.get("stage"),
            ),
            skipped,
            None if ended else health.waiting_for_data(heartbeat.get("stage"), heartbeat.get("cycle"),
                                                        self._preparer_note()),
            health.full_disk(self.disk_free, self.disk_total, self.facts.min_free_disk_bytes),
        ]
        flags = [flag for flag in candidates if flag is not None]
        before = {flag.kind for flag in self.health}
        new = [flag for flag in flags if flag.kind not in before]
        for flag in new:
            event = ConsoleEvent(now, flag.kind, flag.glyph, flag.word, flag.detail, flag.severity)
            self.events.append(event)
            if not self.at_rest:
                self.alerts.append(event)
        if [flag.label for flag in flags] != [flag.label for flag in self.health]:
            self.version += 1
        self.health = flags
        return new

    def _preparer_note(self) -> str | None:
        """What the data line's preparer says that the user acts on, from its status as the
        supervisor's `status` relays it: why it waits (preparer.json's `waiting_reason`), or that
        its preparer.json is damaged (`status_problem`: else a trainer waiting for data would show
        no cause); None otherwise."""
        preparer = self.status.get("preparer")
        if not isinstance(preparer, dict):
            return None
        problem = preparer.get("status_problem")
        if isinstance(problem, str):
            return f"the preparer's state is unknown: {problem}"
        status = preparer.get("status")
        if not isinstance(status, dict) or status.get("state") != "waiting":
            return None
        reason = status.get("waiting_reason")
        return f"the preparer waits: {reason}" if isinstance(reason, str) else None

    def _row_health(self) -> list[HealthFlag | None]:
        """The checks of the rows (spike, slow, lr, skipped), run again only when what they read
        changed: the rows, the trainer's launch (the slow check skips its first rows) or run.json's
        facts (the lr schedule). Between two rows every tick would find the same flags (a slow flag
        raised stays raised on the rows that raised it), so the rows are judged once, not at every tick."""
        inputs = (self.rows_version, self.trainer_started, self.facts)
        if self._row_checks is not None and self._row_checks[0] == inputs:
            return self._row_checks[1]
        series = self.series
        newest_row = self.recent_rows[-1] if self.recent_rows else None
        raised_slow = next((flag for flag in self.health if flag.kind == "slow"), None)
        judged = health.SLOW_SKIP_AFTER_START + health.SLOW_SUSTAIN  # rows since a launch before any is judged
        flags = [
            health.loss_spike(series.loss[-health.SPIKE_WINDOW - 1 :]),
            health.slow_throughput(
                series.tokens_per_s[-health.SLOW_WINDOW - health.SLOW_SUSTAIN :], self.rows_since_start(judged),
                raised_slow,
            ),
            None if newest_row is None else health.lr_off_schedule(newest_row, self.facts.schedule),
            health.skipped_updates(series.skipped[-health.SKIPPED_WINDOW :]),
        ]
        self._row_checks = (inputs, flags)
        return flags

    def rows_since_start(self, at_most: int = RECENT_ROWS) -> int | None:
        """Rows the running trainer has written (those after its launch), counted up to `at_most`;
        None when its launch is unknown."""
        if self.trainer_started is None:
            return None
        count = 0
        for written in reversed(self.series.time):  # NaN where a row has no time: that ends the count
            if count >= at_most or not written >= self.trainer_started:
                break
            count += 1
        return count
