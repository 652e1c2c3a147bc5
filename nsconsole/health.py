"""Health at a glance: pure checks of a line's recent rows, heartbeat and disk.

Each check returns a `HealthFlag` (a glyph plus a word, so a state is never told by colour
alone, and a sentence for the event list) or None when all is well. Nothing here reads a file,
a socket or the clock: the console passes in what it knows, so every check is testable as is.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.protocol.facts import LineState, Stage
from engine.units import GIB

SPIKE_FACTOR = 1.5
"""A loss above this multiple of the mean of the rows before it is a spike."""
SPIKE_WINDOW = 8
"""Rows whose mean loss a new row is compared with."""
SLOW_FRACTION = 0.6
"""Throughput below this fraction of its running median is slow."""
SLOW_CLEAR_FRACTION = 0.8
"""A raised slow flag clears only once throughput is back above this fraction of the median (so a
rate hovering about `SLOW_FRACTION` is one episode, not an alarm per row)."""
SLOW_SUSTAIN = 3
"""Rows in a row that must all be slow to raise the flag, or all recovered to clear it: one slow
update (a checkpoint written beside it, a validation) is no episode."""
SLOW_SKIP_AFTER_START = 20
"""The updates after each trainer start that are never judged (imports, compilation, CUDA graph
captures, cold caches): the first rows of a relaunch are slow by nature."""
SLOW_MIN_HISTORY = 8
"""Rows of throughput needed before slowness is judged (the first updates warm up)."""
SLOW_WINDOW = 256
"""The running median covers at most this many rows before the judged ones."""
LR_RELATIVE_TOLERANCE = 1e-3
"""The logged lr may differ from the schedule's by this fraction (float32 rounding) and more is off."""
SKIPPED_WINDOW = 64
"""Recent rows searched for updates skipped for a non-finite gradient."""
STALE_HEARTBEAT_S = 300.0
"""A training line whose heartbeat is older than this (seconds) is stale."""
FULL_DISK_FRACTION = 0.02
"""Free space below this fraction of the disk is full (besides the line's own min_free_disk_gb)."""


@dataclass(frozen=True)
class HealthFlag:
    """One health problem of a line."""

    kind: str
    """Which check raised it (`spike`, `slow`, `lr`, `stale`, `skipped`, `data`, `disk`)."""
    glyph: str
    """One character that marks it in the lines table."""
    word: str
    """A short word beside the glyph."""
    detail: str
    """A sentence for the event list."""
    severity: str = "warning"
    """`warning` or `error`: the theme colours them, the glyph and word say the same."""

    @property
    def label(self) -> str:
        return f"{self.glyph} {self.word}"


def _finite(value: Any) -> float | None:
    if type(value) is float:  # the console's series hold floats: the common case, checked first
        return value if math.isfinite(value) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def loss_spike(losses: Sequence[float | None]) -> HealthFlag | None:
    """The newest loss against the mean of the `SPIKE_WINDOW` before it (non-finite ones left out)."""
    if len(losses) < SPIKE_WINDOW + 1:
        return None
    newest = _finite(losses[-1])
    before = [value for value in (_finite(loss) for loss in losses[-SPIKE_WINDOW - 1 : -1]) if value is not None]
    if newest is None or len(before) < SPIKE_WINDOW // 2:
        return None
    mean = sum(before) / len(before)
    if mean > 0 and newest > SPIKE_FACTOR * mean:
        return HealthFlag(
            "spike", "▲", "spike",
            f"loss spike: {newest:.4g} is {newest / mean:.2f}x the mean {mean:.4g} of the last {len(before)} rows",
        )
    return None


def slow_throughput(
    tokens_per_s: Sequence[float | None], rows_since_start: int | None = None, raised: HealthFlag | None = None
) -> HealthFlag | None:
    """The newest `SLOW_SUSTAIN` throughputs against the running median of the rows before them.

    One episode, one flag: `raised` (the flag as it stands) stays until the rate has recovered
    (`SLOW_CLEAR_FRACTION`), and is kept as it is while the newest rows are among the first
    `SLOW_SKIP_AFTER_START` of the running trainer (`rows_since_start`; None: unknown, all judged).
    """
    if rows_since_start is not None and rows_since_start < SLOW_SKIP_AFTER_START + SLOW_SUSTAIN:
        return raised
    values = [value for value in (_finite(item) for item in tokens_per_s) if value is not None]
    if len(values) < SLOW_MIN_HISTORY + SLOW_SUSTAIN:
        return raised
    newest = values[-SLOW_SUSTAIN:]
    median = statistics.median(values[-SLOW_WINDOW - SLOW_SUSTAIN : -SLOW_SUSTAIN])
    if median <= 0:
        return raised
    if raised is not None:
        recovered = all(value >= SLOW_CLEAR_FRACTION * median for value in newest)
        return None if recovered else raised
    if all(value < SLOW_FRACTION * median for value in newest):
        return HealthFlag(
            "slow", "▼", "slow",
            f"throughput {newest[-1]:,.0f} tokens/s is {newest[-1] / median:.0%} of its running median "
            f"{median:,.0f} ({SLOW_SUSTAIN} updates in a row under {SLOW_FRACTION:.0%})",
        )
    return None


def lr_off_schedule(row: dict[str, Any], schedule: Callable[[float], float] | None) -> HealthFlag | None:
    """The row's lr against `schedule(tokens trained before the update)`.

    The trainer takes the rate at the tokens trained before an update; the row's `tokens` is after
    it, and does not count the update's tokens when the update was skipped.
    """
    if schedule is None:
        return None
    lr, tokens = _finite(row.get("lr")), _finite(row.get("tokens"))
    if lr is None or tokens is None:
        return None
    update_tokens = 0.0 if row.get("skipped") else (_finite(row.get("tokens_per_update")) or 0.0)
    expected = schedule(tokens - update_tokens)
    if abs(lr - expected) > LR_RELATIVE_TOLERANCE * max(abs(expected), 1e-12):
        return HealthFlag("lr", "≠", "lr", f"lr {lr:.4g} is off its schedule ({expected:.4g} expected)")
    return None


def stale_heartbeat(
    state: str | None, heartbeat_age_s: float | None, limit_s: float = STALE_HEARTBEAT_S, stage: str | None = None
) -> HealthFlag | None:
    """A training line's heartbeat older than `limit_s`. A line that ended (a final state, or a
    trainer whose last heartbeat's `stage` says it stopped) beats no more, and that is no alarm."""
    if state != LineState.TRAINING or stage == Stage.STOPPED:
        return None
    if heartbeat_age_s is None or heartbeat_age_s <= limit_s:
        return None
    return HealthFlag(
        "stale", "◷", "stale", f"no heartbeat for {heartbeat_age_s:,.0f} s (more than {limit_s:,.0f} s)", "error"
    )


def skipped_updates(skipped: Sequence[bool]) -> HealthFlag | None:
    """Updates skipped for a non-finite gradient among the last `SKIPPED_WINDOW` rows."""
    count = sum(1 for flag in skipped[-SKIPPED_WINDOW:] if flag)
    if not count:
        return None
    return HealthFlag(
        "skipped", "✗", "skipped",
        f"{count} of the last {min(len(skipped), SKIPPED_WINDOW)} updates skipped (non-finite gradient)",
        "error" if count > 1 else "warning",
    )


def waiting_for_data(stage: str | None, cycle: Any = None, preparer_note: str | None = None) -> HealthFlag | None:
    """The trainer waits for the preparer to finish a data cycle; `preparer_note`: what the user has
    to act on about the preparer itself ("the preparer waits: disk: ..." for free disk that other
    lines took, or its preparer.json damaged)."""
    if stage != Stage.WAITING_DATA:
        return None
    which = f" cycle {cycle}" if cycle is not None else ""
    why = f"; {preparer_note}" if preparer_note else ""
    return HealthFlag("data", "…", "data", f"waiting for the preparer: data{which} is not ready{why}")


def full_disk(free_bytes: int | None, total_bytes: int | None, min_free_bytes: float | None) -> HealthFlag | None:
    """Free space below the line's `min_free_disk_gb` or below `FULL_DISK_FRACTION` of the disk."""
    if free_bytes is None or not total_bytes:
        return None
    low_fraction = free_bytes < FULL_DISK_FRACTION * total_bytes
    below_guard = min_free_bytes is not None and free_bytes < min_free_bytes
    if not (low_fraction or below_guard):
        return None
    gib = free_bytes / GIB
    return HealthFlag("disk", "■", "disk", f"disk nearly full: {gib:.1f} GiB free ({free_bytes / total_bytes:.1%})", "error")
