"""Forget the watchers of widgets that are gone, which Textual keeps until the watched value changes.

A widget that watches a reactive of another object (`self.watch(app, "title", ...)`, as Textual's
`Header` does; `data_bind`, as each `FooterKey` binds its footer's `compact`) is listed on that
object, and Textual drops the entries of closed widgets only when that very reactive changes. The
console's title, its footers' `compact` never change: every line screen opened and closed left
its header on the app, every footer redrawn (a key that turns on or off, a supervisor that comes
or goes, a tab shown) left its old keys on the footer, each with its styles and caches: about
0.6 MiB a visit of a line's screen, without bound, in a console left open for days
(`bench/long_lived.py`, `tests/console/test_console_closed_watchers.py`).

`drop_closed_watchers(obj)` forgets them, by the rule Textual itself applies at a change (the
watching widget is closing). Textual keeps the lists in an attribute named `__watchers` (set
with `setattr`, so not name-mangled); pyproject.toml pins Textual to 8.2.x, and the test above
fails if that changes under it.
"""

from __future__ import annotations

from typing import Any

WATCHERS_ATTRIBUTE = "__watchers"
"""Where Textual (textual/reactive.py, `_watch`) keeps an object's watchers: {reactive name: [(node, callback)]}."""


def drop_closed_watchers(obj: Any) -> int:
    """Forget the watchers of `obj`'s reactives whose widget is closing or closed; how many were forgotten."""
    watchers = getattr(obj, WATCHERS_ATTRIBUTE, None)
    if not isinstance(watchers, dict):
        return 0
    dropped = 0
    for entries in watchers.values():
        kept = [(node, callback) for node, callback in entries if not getattr(node, "_closing", False)]
        dropped += len(entries) - len(kept)
        entries[:] = kept
    return dropped
