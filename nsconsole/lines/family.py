"""The order many lines are listed in: each branch right after the line it was forked from.

A host that runs a trunk, its branches and other experiments lists them by path, except that a
branch follows its trunk (and its own branches follow it), so a trunk's family reads together and
is not scattered by name among the other lines. The console's table (`book.py`) and `nsconsole
status` with no LINE (`nsconsole/commands/status_overview.py`) list lines in this order.
"""

from __future__ import annotations

from collections.abc import Mapping


def lineage(path: str, parents: Mapping[str, str | None]) -> tuple[str, ...]:
    """The paths from the oldest ancestor listed down to `path` (a trunk's: its own path alone), where
    `parents` maps every listed line's path to the line it was branched from (None: a trunk). Sorting by
    these tuples puts every branch after its trunk, before the next trunk. A parent not listed (its
    directory removed) leaves the branch in its own place by path."""
    chain = [path]
    parent = parents.get(path)
    while parent is not None and parent in parents and parent not in chain:
        chain.append(parent)
        parent = parents[parent]
    return tuple(reversed(chain))
