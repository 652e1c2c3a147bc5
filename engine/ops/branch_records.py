"""A line's record of its branches: branches.json, beside run.json in the trunk's directory.

Kept apart from the branch operation (engine.ops.branch, which opens data lines and so loads numpy
and pyarrow) because the console and `status` read it on their light start.
"""

from __future__ import annotations

import fcntl
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.atomic import write_text_atomic
from engine.errors import LineError
from engine.layout import LineLayout

if TYPE_CHECKING:
    from engine.ops.branch import BranchRequest


def read_branches(layout: LineLayout) -> list[dict[str, Any]]:
    """The branches recorded on a line (branches.json; empty when there is none)."""
    try:
        document = json.loads(layout.branches_json.read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as error:
        raise LineError(f"{layout.branches_json}: unreadable ({error})") from None
    if not isinstance(document, dict) or not isinstance(document.get("branches"), list):
        raise LineError(f"{layout.branches_json}: expected an object with a list of branches")
    return document["branches"]


def live_branches(layout: LineLayout) -> list[dict[str, Any]]:
    """The records of branches.json whose branch directory still holds a run.json (one deleted by
    hand has nothing to keep or show); LineError when branches.json is unreadable."""
    return [entry for entry in read_branches(layout)
            if isinstance(entry, dict) and entry.get("line")
            and LineLayout(Path(str(entry["line"]))).run_json.is_file()]  # fmt: skip


def branches_forked_after(layout: LineLayout, update: int) -> list[str]:
    """`PATH (forked at update N)` of each branch recorded on the line that forked after `update`:
    a rollback to it sets aside the trunk history they grew from (each keeps its own checkpoints
    and rows; the console draws a branch over its trunk's rows up to the fork, so theirs then
    have a gap). A branch whose directory holds no run.json any more (deleted) has nothing to keep
    and is not named. Empty when branches.json is absent or unreadable (a rollback is not refused for it)."""
    try:
        entries = live_branches(layout)
    except LineError:
        return []
    return [f"{entry['line']} (forked at update {entry['at_update']})" for entry in entries
            if isinstance(entry.get("at_update"), int) and entry["at_update"] > update]


def record_branch(parent: LineLayout, branch: Path, request: BranchRequest, update: int, tokens: int) -> None:
    """Record the branch in the parent's branches.json (replaced atomically).

    A directory holds one branch: a record of an earlier branch into it (deleted, then made again,
    perhaps from another cycle end) goes, so that readers that take a branch's record by its path
    (the console's fork, a rollback's list) find this fork and name the branch once. Read and
    written under an flock of `.branches.lock`: a branch from the command line and one the line's
    supervisor forks at a cycle end may be recorded at the same moment, and neither is lost.
    """
    with open(parent.root / BRANCHES_LOCK, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        _record(parent, branch, request, update, tokens)


BRANCHES_LOCK = ".branches.lock"
"""In the trunk's directory: held while a process rewrites its branches.json."""


def _record(parent: LineLayout, branch: Path, request: BranchRequest, update: int, tokens: int) -> None:
    branches = [entry for entry in read_branches(parent)
                if not (isinstance(entry, dict) and entry.get("line") == str(branch))]  # fmt: skip
    branches.append({
        "line": str(branch),
        "at_cycle": request.at_cycle,
        "at_update": update,
        "at_tokens": tokens,
        "plan": request.plan,
        "data": str(request.data.absolute()),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    })  # fmt: skip
    write_text_atomic(
        parent.branches_json, json.dumps({"branches": branches}, indent=2, sort_keys=True) + "\n"
    )
