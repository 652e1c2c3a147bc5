"""The branches a line's supervisor holds for a cycle end, read from its status reply."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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


def fork_views(records: Any, failed: bool) -> list[ForkView]:
    """The status reply's fork records as `ForkView`s (records without a path are skipped)."""
    views = []
    for record in records if isinstance(records, list) else []:
        if not isinstance(record, dict) or not isinstance(record.get("path"), str):
            continue
        at_cycle = record.get("at_cycle")
        reason = str(record.get("reason", "")) if failed else None
        views.append(ForkView(record["path"], at_cycle if isinstance(at_cycle, int) else None, reason))
    return views
