"""A line's event list as the console shows it: what happened, marked by a glyph and a word, and
how severe it is (the bell rings for the chosen severities)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.protocol.facts import EventKind

MAX_EVENTS = 500
"""Events kept per line."""
SEVERITIES = ("info", "warning", "error")
"""An event's severities, mildest first (the theme colours them; `--bell` picks those that ring)."""
DEFAULT_BELL = frozenset({"error"})
"""The severities that ring the terminal bell unless `--bell` says otherwise (a warning is seen, not heard)."""

DAMAGED = "damaged"
"""The console's event naming a line's damaged supervisor.json (read at rest: `LineView.apply_rest`)."""

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
    "exited": ("○", "exited"),
    "connected": ("↺", "attached"),
    "restarted": ("↻", "restarted"),
    "request": ("→", "request"),
    "refused": ("✗", "refused"),
    DAMAGED: ("✗", "damaged"),
}
"""Glyph and word of each event kind: every supervisor event (`EventKind`) and the console's own."""


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
