"""The console's model of each line: what its supervisor said, kept between redraws.

A `LineView` is fed by the console's link to the line's supervisor (`nsconsole/live.py`):
`apply_hello` and `apply_status` after each (re)connection and at every status poll,
`apply_rows` with fetched rows, `apply_notification` with every pushed notification, and
`mark_disconnected` when the link drops (the last state stays, marked stale). A line that no
supervisor runs is read from its files instead (`apply_rest`, `nsconsole/history.py`). The widgets
only read it. Nothing here touches a socket or the clock: times are passed in, so it is testable as is.

What the widgets read off it is in `readings.py`, its health checks in `line_health.py`, the rows it
holds in `rows.py`, its events in `events.py`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from engine.ops.rollback_records import STAMP_FORMAT
from engine.protocol import facts
from engine.protocol.facts import EventKind
from engine.supervisor.rows_digest import is_validation_row
from nsconsole.client import missing_methods, older_supervisor_words
from nsconsole.health import HealthFlag
from nsconsole.lines.events import DAMAGED, EVENT_GLYPHS, MAX_EVENTS, ConsoleEvent
from nsconsole.lines.line_health import LineHealth
from nsconsole.lines.readings import DAMAGED_RECORD, LineReadings, beat_time, is_newer_beat
from nsconsole.lines.rows import FULL_ROWS, MAX_POINTS, MAX_VALIDATIONS, RECENT_ROWS, Series
from nsconsole.lines.run_facts import LineFacts

ROLLBACK_EVENT_LAG_S = 60.0
"""A supervisor's `rolled_back` event comes at most this long after the second its rollback's
rows.rolledback-<time>.jsonl names (the copy, the reopened cycles and the cut rows come between)."""


class LineView(LineHealth, LineReadings):
    """Everything the console knows about one line (see the module docstring)."""

    def __init__(self, key: str, path: str | Path, facts: LineFacts | None = None) -> None:
        self.key = key
        """The line's registry id (stable for its path)."""
        self.path = str(path)
        self.name = Path(path).name
        self.facts = facts or LineFacts()
        self.connected = False
        self.ever_connected = False
        self.disconnect_reason: str | None = None
        self.epoch: str | None = None
        self.supervisor_pid: int | None = None
        self.status: dict[str, Any] = {}
        """The supervisor's latest `status` reply."""
        self.heartbeat: dict[str, Any] | None = None
        self.series = Series()
        self.recent_rows: deque[dict[str, Any]] = deque(maxlen=RECENT_ROWS)
        self.validations: deque[dict[str, Any]] = deque(maxlen=MAX_VALIDATIONS)
        self.events: deque[ConsoleEvent] = deque(maxlen=MAX_EVENTS)
        self.health: list[HealthFlag] = []
        self.alerts: deque[ConsoleEvent] = deque(maxlen=MAX_EVENTS)
        """Events not yet told (`take_alerts`): the app rings the bell for those of the chosen severities."""
        self.trainer_started: float | None = None
        """When the running trainer was launched (its `launched` event, the status' `trainer_launched`):
        the slow check skips its first updates."""
        self.at_rest = False
        """Read from the line's files: no supervisor runs it (a line that ended, listed from the history)."""
        self.registered = False
        """Discovery found a live supervisor of the line in the registry at its last look."""
        self.disk_free: int | None = None
        self.disk_total: int | None = None
        self.orphaned = False
        """The supervisor is gone (its socket or its pid) and so is the trainer's pid: nothing runs the
        line, whatever its last state says (set by the console's link while it cannot reattach)."""
        self.version = 0
        """Bumped by every change, so a widget redraws only lines that changed."""
        self.rows_version = 0
        """Bumped by every change to the training rows (`series`, `recent_rows`): what depends on the
        rows alone is computed again only when it moves (the row checks of `refresh_health`)."""
        self._row_checks: tuple[tuple[Any, ...], list[HealthFlag | None]] | None = None
        """(what the row checks read, their flags) as last run (see `_row_health`)."""

    # ---- what the supervisor says ------------------------------------------------------------

    def apply_hello(self, hello: dict[str, Any], now: float) -> bool:
        """A (re)connection's hello; True when the supervisor is a new one (its rows are refetched)."""
        epoch = hello.get("epoch")
        restarted = self.epoch is not None and epoch != self.epoch
        if restarted:
            self.add_event(now, "restarted", f"the supervisor restarted (pid {hello.get('pid')})", "warning")
        elif not self.ever_connected or not self.connected:
            self.add_event(now, "connected", f"attached to the supervisor (pid {hello.get('pid')})")
        fresh = restarted or self.epoch is None
        missing = missing_methods(hello)
        if fresh and missing:  # said once per supervisor life, as a warning: it asks for a restart
            self.add_event(now, "connected", older_supervisor_words(self.path, hello.get("pid"), missing), "warning")
        self.epoch = epoch
        self.supervisor_pid = hello.get("pid")
        self.connected, self.ever_connected, self.disconnect_reason = True, True, None
        self.at_rest = False
        self.orphaned = False
        self.version += 1
        return fresh

    def apply_status(self, status: dict[str, Any]) -> None:
        if status != self.status:
            self.status = status
            self._note_rollbacks(status.get("rollbacks"))
            self._trainer_launched_at(status.get("trainer_launched"))
            heartbeat = status.get("heartbeat")
            if isinstance(heartbeat, dict) and is_newer_beat(heartbeat, self.heartbeat):
                self.heartbeat = heartbeat
            self.version += 1

    def apply_rows(self, rows: Iterable[dict[str, Any]], first_index: int) -> None:
        """Rows fetched with `rows {since: first_index}`; a fetch from 0 replaces what is held."""
        if first_index == 0:
            self.series = Series()
            self.recent_rows.clear()
            self.validations.clear()
            self.rows_version += 1
        for row in rows:
            if "omitted" not in row:
                self.add_row(row)
        self.version += 1

    def add_row(self, row: dict[str, Any]) -> None:
        """One row, pushed or fetched, in order."""
        update = row.get("update")
        if not isinstance(update, int) or isinstance(update, bool):
            return
        if is_validation_row(row):
            while self.validations and self.validations[-1].get("update", -1) >= update:
                self.validations.pop()
            self.validations.append(row)
            self.version += 1
        if "loss" not in row:
            return  # a validation row of its own: the training row of its update came before it
        if self.series.update and self.series.update[-1] >= update:
            # The line went back (a resume, a rollback): what came after this update is set aside.
            self.series.cut_from(update)
            while self.recent_rows and self.recent_rows[-1].get("update", -1) >= update:
                self.recent_rows.pop()
            while self.validations and self.validations[-1].get("update", -1) >= update:
                self.validations.pop()
        self.series.append(row)
        if len(self.series) > MAX_POINTS:
            self.series.thin(FULL_ROWS)
        self.recent_rows.append(row)
        self.rows_version += 1
        self.version += 1

    def apply_notification(self, kind: str, data: dict[str, Any], now: float) -> None:
        if "omitted" in data:
            return  # too large to push: the next rows fetch brings it
        if kind in ("row", "validation"):
            self.add_row(data)
        elif kind == "heartbeat":
            # A replayed backlog may carry older beats than the status reply already gave.
            if is_newer_beat(data, self.heartbeat):
                self.heartbeat = data
        elif kind == "event":
            event_kind = str(data.get("event", "event"))
            severity = "error" if event_kind in facts.ERROR_EVENTS else "info"
            event = self.add_event(float(data.get("time") or now), event_kind, str(data.get("message", "")), severity)
            result = data.get("result")
            if event_kind == EventKind.ROLLED_BACK and isinstance(result, dict) and self.heartbeat is not None \
                    and isinstance(result.get("to_update"), int):
                # The stopped trainer's last beat names the update it had reached: the line is back at
                # the rollback's until the next trainer beats.
                self.heartbeat = {**self.heartbeat, "update": result["to_update"]}
            if event_kind == EventKind.LAUNCHED:
                # Before the new trainer's first row (one stream, in order): its warm-up is not judged slow.
                self._trainer_launched_at(event.time)
            if event_kind in facts.ENDING_EVENTS:
                # The line has ended: say so at once, not at the next status poll (which a supervisor
                # exiting right after may never answer).
                self.status = {**self.status, "state": facts.ENDING_EVENTS[event_kind].value, "trainer_pid": None}
        self.version += 1

    def mark_disconnected(self, reason: str, now: float) -> None:
        if self.connected or not self.ever_connected and self.disconnect_reason is None:
            state = self.status.get("state")
            if state in facts.FINAL_LINE_STATES:
                # The line ended and its supervisor exits with it: its socket going quiet is no fault,
                # so no warning (nor the bell that `--bell warning` rings) after each stop or finish.
                self.add_event(now, "exited", f"the supervisor has exited (state {state}): {reason}")
            else:
                self.add_event(now, "disconnected", f"supervisor unreachable: {reason}", "warning")
        self.connected = False
        self.disconnect_reason = reason
        self.version += 1

    def add_event(
        self, now: float, kind: str, message: str, severity: str = "info", alert: bool = True
    ) -> ConsoleEvent:
        """A new event; `alert` False for one that is history, not news (read from a line at rest)."""
        glyph, word = EVENT_GLYPHS.get(kind, ("•", kind))
        event = ConsoleEvent(now, kind, glyph, word, message, severity)
        self.events.append(event)
        if alert and not self.at_rest:
            self.alerts.append(event)
        self.version += 1
        return event

    def take_alerts(self) -> list[ConsoleEvent]:
        """The events that came since the last call (each is told once)."""
        alerts = list(self.alerts)
        self.alerts.clear()
        return alerts

    def _trainer_launched_at(self, launched: Any) -> None:
        if isinstance(launched, (int, float)) and not isinstance(launched, bool):
            self.trainer_started = max(self.trainer_started or 0.0, float(launched))

    def apply_rest(
        self, supervisor: dict[str, Any], heartbeat: dict[str, Any] | None, rows: Iterable[dict[str, Any]], now: float
    ) -> None:
        """The line as its files left it, no supervisor running it: supervisor.json (`supervisor`, its
        state and counters), the trainer's last heartbeat and every row of rows.jsonl.

        Its state is the one its supervisor ended in. A supervisor that died while the line ran
        (killed, the host went down) left a state that is not final: the line is `orphaned`, as a
        live line whose supervisor and trainer have gone, and an event says what happened. A damaged
        supervisor.json (`DAMAGED_RECORD`) leaves its state unknown, and an event names the damage.
        """
        saved = supervisor.get("state")
        damage = supervisor.get(DAMAGED_RECORD)
        self.at_rest, self.connected, self.registered = True, False, False
        self.orphaned = damage is None and saved not in facts.FINAL_LINE_STATES
        self.disconnect_reason = "no supervisor runs the line"
        self.status = {**supervisor, "trainer_pid": None}
        self.heartbeat = heartbeat
        self.apply_rows(rows, 0)
        told = {(event.time, event.kind, event.message) for event in self.events}
        notes = []
        last_event = supervisor.get("last_event")
        if isinstance(last_event, dict) and isinstance(last_event.get("time"), (int, float)):
            kind = str(last_event.get("event", "event"))
            severity = "error" if kind in facts.ERROR_EVENTS else "info"
            notes.append((float(last_event["time"]), kind, str(last_event.get("message", "")), severity))
        if self.orphaned:
            message = (f"its supervisor (pid {supervisor.get('pid', '?')}) ended while the line was {saved} "
                       "(killed, or the host went down); a resume starts from its latest checkpoint")
            notes.append((beat_time(heartbeat or {}) or now, "crashed", message, "warning"))
        for when, kind, message, severity in notes:
            if (when, kind, message) not in told:
                self.add_event(when, kind, message, severity)
        # Told once: the file has no time of its own to tell a second read of the same damage by.
        if isinstance(damage, str) and not any(event.message == damage for event in self.events):
            self.add_event(now, DAMAGED, damage, "error")
        self._note_rollbacks(supervisor.get("rollbacks"))

    def _note_rollbacks(self, times: object) -> None:
        """A `rolled_back` event (history, no alert) for each rollback the line's files record (its
        status's `rollbacks`) that no event tells of yet: one made from the command line, or under an
        earlier supervisor. The files give the second; the supervisor's own event comes after it."""
        if not isinstance(times, list):
            return
        told = sorted(event.time for event in self.events if event.kind == facts.EventKind.ROLLED_BACK)
        for when in times:
            if not isinstance(when, (int, float)):
                continue
            # Each event tells of one rollback (two may share a second).
            match = next((time for time in told if 0.0 <= time - when <= ROLLBACK_EVENT_LAG_S), None)
            if match is not None:
                told.remove(match)
                continue
            stamp = time.strftime(STAMP_FORMAT, time.gmtime(when))
            self.add_event(float(when), facts.EventKind.ROLLED_BACK, f"rolled back (the rows set aside are kept in "
                           f"rows.rolledback-{stamp}.jsonl)", alert=False)
