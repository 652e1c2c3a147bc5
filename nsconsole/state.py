"""The console's model of each line: what its supervisor said, kept between redraws.

A `LineView` is fed by the console's link to the line's supervisor (`nsconsole/live.py`):
`apply_hello` and `apply_status` after each (re)connection and at every status poll,
`apply_rows` with fetched rows, `apply_notification` with every pushed notification, and
`mark_disconnected` when the link drops (the last state stays, marked stale). A line that no
supervisor runs is read from its files instead (`apply_rest`, `nsconsole/history.py`). The widgets
only read it. Nothing here touches a socket or the clock: times are passed in, so it is testable as is.

Rows are kept compactly (`Series`: the handful of numbers the table and the curves need: every
row of the newest ones, a downsampled history of the older ones, at most `MAX_POINTS`), plus the
newest full rows and the newest validation rows. A resumed trainer writes the
replayed updates again: a row whose update is not past the last one cuts the series back first.
"""

from __future__ import annotations

import math
import re
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.ops.rollback_records import STAMP_FORMAT
from engine.protocol import facts
from engine.protocol.facts import EventKind, Stage
from engine.supervisor.rows_digest import extremes, is_validation_row
from engine.units import gib_bytes
from nsconsole import health
from nsconsole.health import HealthFlag
from nsconsole.widgets.format import PAUSING_FOR, SUPERVISOR_LOST, UNREACHABLE

RECENT_ROWS = 256
"""Full rows kept per line (the health checks look at these)."""
FULL_ROWS = 2048
"""The newest rows the console reads whole when it attaches to a line (or reads one at rest); the
older ones come as the downsampled history (`engine.supervisor.rpc.RowsDigest`)."""
MAX_POINTS = 8192
"""Points a line's `Series` holds at most: past it, all but its newest `FULL_ROWS` are thinned
(`Series.thin`), so a console left open for weeks holds what it held on the first day."""
THIN_GROUP = 6
"""Consecutive points that `Series.thin` replaces by their `extremes` (at most 3 of them)."""
MAX_VALIDATIONS = 512
"""Validation rows kept per line."""
MAX_EVENTS = 500
"""Events kept per line."""
ROLLBACK_EVENT_LAG_S = 60.0
"""A supervisor's `rolled_back` event comes at most this long after the second its rollback's
rows.rolledback-<time>.jsonl names (the copy, the reopened cycles and the cut rows come between)."""
SEVERITIES = ("info", "warning", "error")
"""An event's severities, mildest first (the theme colours them; `--bell` picks those that ring)."""
DEFAULT_BELL = frozenset({"error"})
"""The severities that ring the terminal bell unless `--bell` says otherwise (a warning is seen, not heard)."""

EVENT_GLYPHS: dict[str, tuple[str, str]] = {
    EventKind.LAUNCHED: ("▶", "launched"),
    EventKind.FINISHED: ("✓", "finished"),
    EventKind.STOPPED: ("■", "stopped"),
    EventKind.FAILED: ("✗", "failed"),
    EventKind.CRASHED: ("✗", "crashed"),
    EventKind.STUCK: ("◷", "stuck"),
    EventKind.WATCHDOG_RESTART: ("↻", "watchdog"),
    EventKind.SIGNAL_RESTART: ("↻", "signal"),
    EventKind.DISK_FULL: ("■", "disk"),
    EventKind.DATA_WAIT: ("…", "data"),
    EventKind.GPU_WAIT: ("…", "gpu"),
    EventKind.GPU_BUSY: ("…", "gpu busy"),
    EventKind.PREPARER_FAILING: ("✗", "preparer"),
    EventKind.SUPERVISOR_FAILED: ("✗", "supervisor"),
    EventKind.BRANCHED: ("⑂", "branched"),
    EventKind.BRANCH_FAILED: ("✗", "branch"),
    EventKind.BRANCH_START_FAILED: ("✗", "branch start"),
    EventKind.ROLLED_BACK: ("↶", "rolled back"),
    EventKind.ROLLBACK_FAILED: ("✗", "rollback"),
    EventKind.TUNED: ("⚙", "tuned"),
    EventKind.TUNE_FAILED: ("✗", "tune"),
    "disconnected": ("⚡", "lost"),
    "connected": ("↺", "attached"),
    "restarted": ("↻", "restarted"),
    "request": ("→", "request"),
    "refused": ("✗", "refused"),
}
"""Glyph and word of each event kind: every supervisor event (`EventKind`) and the console's own."""

SHOWN_STAGES = frozenset(
    {Stage.CHECKPOINTING, Stage.WAITING_DATA, Stage.VALIDATING, Stage.CAPTURING, Stage.COMPILING, Stage.PROBING,
     Stage.DREAMING}
)
"""Trainer stages shown in place of the supervisor's `training`: they say more."""

_VAL_MIX = re.compile(r"^val_(\d+)/mix$")


@dataclass(frozen=True)
class ConsoleEvent:
    """One entry of a line's event list."""

    time: float
    """When it happened (Unix time)."""
    kind: str
    """A supervisor event kind, a health check's kind, or the console's own (`disconnected`...)."""
    glyph: str
    """One character marking it."""
    word: str
    """A short word beside the glyph."""
    message: str
    """What happened."""
    severity: str = "info"
    """`info`, `warning` or `error`."""


@dataclass(frozen=True)
class ForkView:
    """A branch the line's supervisor holds for a cycle end: queued, or failed (the status reply's
    `queued_forks` and `failed_forks`), so the lines table can show it before, or instead of, the fork."""

    path: str
    """The branch line's directory."""
    at_cycle: int | None
    """The trunk cycle at whose end it forks (None when the supervisor did not say)."""
    reason: str | None = None
    """Why it failed (None for a queued fork)."""


def _fork_views(records: Any, failed: bool) -> list[ForkView]:
    """The status reply's fork records as `ForkView`s (records without a path are skipped)."""
    views = []
    for record in records if isinstance(records, list) else []:
        if not isinstance(record, dict) or not isinstance(record.get("path"), str):
            continue
        at_cycle = record.get("at_cycle")
        reason = str(record.get("reason", "")) if failed else None
        views.append(ForkView(record["path"], at_cycle if isinstance(at_cycle, int) else None, reason))
    return views


@dataclass(frozen=True)
class LineFacts:
    """What the console reads once from a line's run.json (written atomically, so safe to read)."""

    preset: str | None = None
    """The model preset (`pssa-*` lines get the memory tab)."""
    schedule: Callable[[float], float] | None = None
    """The learning rate at a number of tokens trained (None: unknown, no lr check)."""
    share_reserve_gb: float | None = None
    """run.json's `guards.share_reserve_gb`, GiB (2**30 bytes) left to other processes on the GPU;
    None: sharing is off (the line waits for a free GPU)."""
    min_free_disk_gb: float | None = None
    """run.json's `guards.min_free_disk_gb`, the line's own disk guard in GiB (2**30 bytes)."""

    @property
    def is_pssa(self) -> bool:
        return bool(self.preset and self.preset.startswith("pssa"))

    @property
    def sharing(self) -> bool:
        return self.share_reserve_gb is not None

    @property
    def share_reserve_bytes(self) -> int | None:
        """The reserve in bytes, converted as GiB like the trainer's (`GuardsConfig.share_reserve_bytes`)."""
        return None if self.share_reserve_gb is None else gib_bytes(self.share_reserve_gb)

    @property
    def min_free_disk_bytes(self) -> int | None:
        """The disk guard in bytes, converted as GiB like the trainer's (`GuardsConfig.min_free_disk_bytes`)."""
        return None if self.min_free_disk_gb is None else gib_bytes(self.min_free_disk_gb)


@dataclass
class Series:
    """The numbers of every training row the table and the curves need, column by column."""

    update: list[int] = field(default_factory=list)
    tokens: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    time: list[float] = field(default_factory=list)
    """When each row was written (Unix time; the curves' time axis)."""
    cycle: list[float] = field(default_factory=list)
    """The data cycle of each row's update (the curves mark where one ends)."""

    def __len__(self) -> int:
        return len(self.update)

    def append(self, row: dict[str, Any]) -> None:
        self.update.append(int(row["update"]))
        self.tokens.append(_number(row.get("tokens")))
        self.loss.append(_number(row.get("loss")))
        self.lr.append(_number(row.get("lr")))
        self.grad_norm.append(_number(row.get("grad_norm")))
        self.tokens_per_s.append(_number(row.get("tokens_per_s")))
        self.skipped.append(bool(row.get("skipped")))
        self.time.append(_number(row.get("time")))
        self.cycle.append(_number(row.get("cycle")))

    def thin(self, keep_newest: int) -> None:
        """Replace every `THIN_GROUP` consecutive points before the newest `keep_newest` by their
        `extremes` (lowest and highest loss, highest gradient norm): about half as many points, and
        a spike stays visible."""
        older = len(self) - keep_newest
        if older < THIN_GROUP:
            return
        points = [(index, {name: getattr(self, name)[index] for name in ("loss", "grad_norm")})
                  for index in range(older)]
        kept = [index for start in range(0, older, THIN_GROUP) for index, _ in extremes(points[start:start + THIN_GROUP])]
        kept += range(older, len(self))
        for column in self._columns():
            column[:] = [column[index] for index in kept]

    def cut_from(self, update: int) -> None:
        """Drop every row of `update` and later (a resume writes them again)."""
        keep = len(self.update)
        while keep and self.update[keep - 1] >= update:
            keep -= 1
        for column in self._columns():
            del column[keep:]

    def _columns(self) -> tuple[list[Any], ...]:
        return tuple(getattr(self, name) for name in COLUMN_NAMES)


COLUMN_NAMES = ("update", "tokens", "loss", "lr", "grad_norm", "tokens_per_s", "skipped", "time", "cycle")
"""`Series`' columns, in its order."""


def joined_rows(history: list[dict[str, Any]], newest: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A line's rows as the console holds them: the downsampled history before the newest rows,
    then the newest rows whole."""
    first = next((row.get("update") for row in newest if isinstance(row.get("update"), int)), None)
    older = history if first is None else [row for row in history if _number(row.get("update")) < first]
    return [*older, *newest]


def _number(value: Any) -> float:
    """A row's number, NaN where it is missing or not a number (a NaN loss arrives as null)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    return float(value)


def validation_loss(row: dict[str, Any]) -> float | None:
    """The headline validation loss of a validation row: `val_<L>/mix` at the row's length if present."""
    seq_len = row.get("seq_len")
    preferred = f"val_{seq_len}/mix"
    if isinstance(row.get(preferred), (int, float)):
        return float(row[preferred])
    mixes = sorted((int(match[1]), key) for key in row if (match := _VAL_MIX.match(key)))
    if mixes and isinstance(row[mixes[0][1]], (int, float)):
        return float(row[mixes[0][1]])
    for key, value in row.items():
        if key.startswith("val_") and key.endswith("/mean") and isinstance(value, (int, float)):
            return float(value)
    return None


class LineView:
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
            if isinstance(heartbeat, dict) and _beat_time(heartbeat) >= _beat_time(self.heartbeat or {}):
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
            if _beat_time(data) >= _beat_time(self.heartbeat or {}):
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
        live line whose supervisor and trainer have gone, and an event says what happened.
        """
        saved = supervisor.get("state")
        self.at_rest, self.connected, self.registered = True, False, False
        self.orphaned = saved not in facts.FINAL_LINE_STATES
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
            notes.append((_beat_time(heartbeat or {}) or now, "crashed", message, "warning"))
        for when, kind, message, severity in notes:
            if (when, kind, message) not in told:
                self.add_event(when, kind, message, severity)
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

    # ---- health --------------------------------------------------------------------------------

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
            None if ended else health.waiting_for_data(heartbeat.get("stage"), heartbeat.get("cycle")),
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

    # ---- what the table shows ------------------------------------------------------------------

    @property
    def kind(self) -> str:
        # The supervisor's status names the line a branch was forked from (`parent`).
        return "branch" if self.status.get("parent") else "trunk"

    @property
    def parent(self) -> str | None:
        """The path of the line this branch was forked from (None: a trunk)."""
        parent = self.status.get("parent")
        return parent if isinstance(parent, str) and parent else None

    @property
    def supervisor_state(self) -> str | None:
        return self.status.get("state")

    @property
    def display_state(self) -> str:
        """The supervisor's state, or what says more: the trainer's stage (checkpointing...), a stop
        asked for (`stopping`), what a pause is for (`pausing → tuning`), nothing left running."""
        if not (self.ever_connected or self.at_rest):
            return UNREACHABLE
        state = self.supervisor_state or facts.LineState.STARTING
        if self.orphaned and not self.connected and state not in facts.FINAL_LINE_STATES:
            return SUPERVISOR_LOST
        if state == facts.LineState.PAUSING:
            # The supervisor's `under_way`: the mutations it has taken, oldest (the one it pauses for) first.
            for entry in self.status.get("under_way") or ():
                if isinstance(entry, dict) and entry.get("method") in PAUSING_FOR:
                    return PAUSING_FOR[entry["method"]]
        if state == facts.LineState.TRAINING:
            stop = self.status.get("stop")
            if isinstance(stop, dict):
                cycle = stop.get("at_cycle_end")
                return facts.LineState.STOPPING if cycle is None else f"{facts.LineState.STOPPING} after cycle {cycle}"
            stage = (self.heartbeat or {}).get("stage")
            if stage in SHOWN_STAGES:
                return stage
        return state

    @property
    def ended(self) -> bool:
        """Nothing runs the line: it ended (finished, stopped, failed) or its supervisor and trainer are
        gone. Its heartbeat, pace and next events are history, not live readings."""
        state = self.display_state
        return state in facts.FINAL_LINE_STATES or state == SUPERVISOR_LOST

    @property
    def on_cpu(self) -> bool | None:
        """Whether the line trains on the CPU: run.json's `device` as its supervisor read it, else the
        GPUs that `device` lets it lease (none: the CPU); None when its supervisor did not say."""
        device = self.status.get("device")
        if device == "cpu":
            return True
        if "gpu_candidates" in self.status:  # what `device` came to on this host (`auto` without a GPU: the CPU)
            return self.gpu_candidates is None
        return False if isinstance(device, str) and device.startswith("cuda") else None

    def heartbeat_age(self, now: float) -> float | None:
        if not self.heartbeat:
            return None
        beat = _beat_time(self.heartbeat)
        return None if beat <= 0 else max(0.0, now - beat)

    @property
    def last_row(self) -> dict[str, Any] | None:
        return self.recent_rows[-1] if self.recent_rows else None

    @property
    def update(self) -> int | None:
        row_update = self.series.update[-1] if self.series.update else None
        beat_update = (self.heartbeat or {}).get("update")
        candidates = [value for value in (row_update, beat_update) if isinstance(value, int)]
        return max(candidates) if candidates else None

    @property
    def tokens(self) -> float | None:
        return self.series.tokens[-1] if self.series.tokens else None

    @property
    def cycle(self) -> int | None:
        """The data cycle the trainer is in: its last row's, or the one a heartbeat says it waits for."""
        row = self.last_row
        candidates = [
            value
            for value in (None if row is None else row.get("cycle"), (self.heartbeat or {}).get("cycle"))
            if isinstance(value, int) and not isinstance(value, bool)
        ]
        return max(candidates) if candidates else None

    @property
    def is_pssa(self) -> bool:
        """A PSSA line (it gets the memory tab), from run.json or the supervisor's status."""
        preset = self.status.get("preset")
        return self.facts.is_pssa or (isinstance(preset, str) and preset.startswith("pssa"))

    @property
    def plan_stage(self) -> str | None:
        row = self.last_row
        return None if row is None else row.get("stage")

    @property
    def loss(self) -> float | None:
        return _present(self.series.loss[-1]) if self.series.loss else None

    @property
    def tokens_per_s(self) -> float | None:
        return _present(self.series.tokens_per_s[-1]) if self.series.tokens_per_s else None

    @property
    def val_loss(self) -> float | None:
        for row in reversed(self.validations):
            value = validation_loss(row)
            if value is not None:
                return value
        return None

    @property
    def restarts(self) -> int:
        """Crashes the supervisor restarted the trainer after (supervisor.json's `crashes`, over every
        life of the line's supervisor); relaunches the line asked for (a rollback, a tune, a resume) are none."""
        crashes = self.status.get("crashes")
        return crashes if isinstance(crashes, int) and not isinstance(crashes, bool) else 0

    @property
    def gpu_index(self) -> int | None:
        index = self.status.get("gpu_index")
        return index if isinstance(index, int) else None

    @property
    def gpu_indices(self) -> list[int]:
        """Every GPU the line's leases hold, rank 0's first (one at parallel.degree 1; none on the
        CPU or while it waits; a supervisor older than the field: `gpu_index` alone)."""
        indices = self.status.get("gpu_indices")
        if isinstance(indices, list) and indices and all(type(index) is int for index in indices):
            return indices
        return [] if self.gpu_index is None else [self.gpu_index]

    @property
    def gpu_candidates(self) -> list[int] | None:
        """The GPUs (NVML indices) run.json's `device` lets the line lease (None: the CPU, or not said)."""
        candidates = self.status.get("gpu_candidates")
        if not isinstance(candidates, list):
            return None
        return [index for index in candidates if isinstance(index, int) and not isinstance(index, bool)]

    @property
    def waiting_for_gpus(self) -> list[int]:
        """The GPUs the line waits for a lease on, every one held by another line (none while it holds
        one, or waits holding its own for other processes to leave)."""
        if self.at_rest or self.supervisor_state != facts.LineState.WAITING_GPU or self.gpu_index is not None:
            return []
        return self.gpu_candidates or []

    @property
    def sharing_gpu(self) -> bool:
        """Training with its lengths' shared shapes beside other GPU processes (its newest row's
        `gpu_mode`): slower on purpose, and back to its own shapes once they have gone."""
        row = self.last_row
        return row is not None and row.get("gpu_mode") == "shared"

    @property
    def trainer_pid(self) -> int | None:
        pid = self.status.get("trainer_pid")
        return pid if isinstance(pid, int) else None

    @property
    def trainer_pids(self) -> list[int]:
        """The trainer's processes: its pid and, at parallel.degree above 1, its ranks' (none while no
        trainer runs)."""
        pid = self.trainer_pid
        if pid is None:
            return []
        children = self.status.get("trainer_children")
        ranks = [child for child in children if type(child) is int] if isinstance(children, list) else []
        return [pid, *ranks]

    @property
    def latest_checkpoint(self) -> int | None:
        update = self.status.get("latest_checkpoint")
        return update if isinstance(update, int) else None

    @property
    def queued_forks(self) -> list[ForkView]:
        """Branches waiting for the end of their trunk cycle (the supervisor's `queued_forks`)."""
        return _fork_views(self.status.get("queued_forks"), failed=False)

    @property
    def failed_forks(self) -> list[ForkView]:
        """Queued branches that could not be made (the supervisor's `failed_forks`, with the reason)."""
        return _fork_views(self.status.get("failed_forks"), failed=True)

    @property
    def mutable(self) -> bool:
        """Mutating keys work only on a line whose supervisor answers now."""
        return self.connected

    @property
    def resumable(self) -> bool:
        """No supervisor runs the line (none answers, none is registered): `resume` may start one."""
        return not self.connected and not self.registered


def _present(value: float) -> float | None:
    return None if math.isnan(value) else value


def _beat_time(heartbeat: dict[str, Any]) -> float:
    beat = heartbeat.get("time")
    return float(beat) if isinstance(beat, (int, float)) and not isinstance(beat, bool) else 0.0


class LineBook:
    """Every line the console shows, by key, in a stable order (by path)."""

    def __init__(self) -> None:
        self.lines: dict[str, LineView] = {}

    def __iter__(self) -> Iterator[LineView]:
        return iter(sorted(self.lines.values(), key=lambda line: line.path))

    def __len__(self) -> int:
        return len(self.lines)

    def get(self, key: str) -> LineView | None:
        return self.lines.get(key)

    def add(self, line: LineView) -> LineView:
        return self.lines.setdefault(line.key, line)
