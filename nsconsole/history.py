"""Lines that no supervisor runs: found where lines live, read from their files.

The registry lists running supervisors only, so a line that ended would vanish from the console.
`line_candidates()` names every line that may have ended: the lines in host.json's `work_root`
and in the demo's root (`~/.nsconsole/lines` without a work root), one level down, and every line
a supervisor ever registered on this host (`engine.supervisor.registry.remembered_lines`).

`read_at_rest(line)` reads one of them, but only at rest: the design lets the console read no file
that a supervisor (or a trainer run without one) is writing. A line is at rest when its
supervisor.json names no live supervisor in a state that is not final and its heartbeat names no
live trainer still training; the caller has already left out the lines the registry lists.
Lines that never ran under a supervisor (no supervisor.json) are not listed. A damaged supervisor.json
(not JSON: by hand or by the disk) names no supervisor: its line is at rest when no trainer runs it,
and is listed with its state unknown and the damage named (`supervisor_record`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.checkpoints.format import branched_from
from engine.config.host import HostSettings
from engine.layout import LineLayout
from engine.ops.demo import demo_paths
from engine.ops.rollback_records import rollback_times
from engine.protocol.facts import FINAL_LINE_STATES
from engine.supervisor.lost import damaged_record
from engine.supervisor.reads import latest_update, read_json, running_supervisor_pid, running_trainer_pid
from engine.supervisor.registry import remembered_lines
from engine.supervisor.rows_tail import RowsTail
from nsconsole.lines.readings import DAMAGED_RECORD
from nsconsole.row_fetch import series_stride
from nsconsole.state import FULL_ROWS, joined_rows

Signature = tuple[tuple[int, int], ...]
"""What changes when a line's files do: (mtime_ns, size) of supervisor.json, heartbeat, rows.jsonl."""


@dataclass(frozen=True)
class RestingLine:
    """A line at rest, as its files leave it."""

    path: str
    """The line's directory (real path)."""
    supervisor: dict[str, Any]
    """supervisor.json (the state its last supervisor ended in, its counters, last exit and event;
    where it is damaged, `DAMAGED_RECORD` alone: `supervisor_record`), with what a supervisor's
    `status` adds from the line's files: `latest_checkpoint`, `parent`, `rollbacks`."""
    heartbeat: dict[str, Any] | None
    """The trainer's last heartbeat."""
    rows: list[dict[str, Any]]
    """rows.jsonl as the console holds a line's rows (`resting_rows`): its newest `FULL_ROWS` whole
    rows after a downsampled history of the older ones."""
    signature: Signature
    """The files' signature when they were read (`files_signature`)."""


def work_roots(settings: HostSettings) -> list[Path]:
    """host.json's `work_root` and the demo's root (the same directory when a work root is set)."""
    roots = [Path(settings.work_root).expanduser()] if settings.work_root else []
    demo_root = demo_paths(settings.work_root).line.parent
    return roots if demo_root in roots else [*roots, demo_root]


def line_candidates(settings: HostSettings | None = None) -> list[str]:
    """Every line directory under the work roots and in the history (real paths, sorted, once each)."""
    settings = settings if settings is not None else HostSettings.load()
    found = set()
    for root in work_roots(settings):
        try:
            children = list(root.iterdir())
        except OSError:
            continue  # no such root (yet): nothing there
        found.update(os.path.realpath(child) for child in children if (child / "supervisor.json").is_file())
    found.update(line for line in remembered_lines() if os.path.isfile(os.path.join(line, "supervisor.json")))
    return sorted(found)


def files_signature(line: str | Path) -> Signature:
    layout = LineLayout(line)
    signature = []
    for path in (layout.supervisor_json, layout.heartbeat, layout.rows_jsonl):
        try:
            info = path.stat()
            signature.append((info.st_mtime_ns, info.st_size))
        except OSError:
            signature.append((0, -1))
    return tuple(signature)


def read_at_rest(line: str | Path) -> RestingLine | None:
    """The line from its files, or None when it is not at rest (see the module docstring) or not a line."""
    layout = LineLayout(line)
    signature = files_signature(line)
    supervisor = supervisor_record(layout)
    heartbeat = read_json(layout.heartbeat)
    if not _at_rest(supervisor, heartbeat):
        return None
    rows = resting_rows(layout)
    status = {**supervisor, "latest_checkpoint": latest_update(layout), "parent": branched_from(layout),
              "rollbacks": rollback_times(layout)}
    if files_signature(line) != signature:
        return None  # written while read: not at rest after all
    return RestingLine(str(layout.root), status, heartbeat, rows, signature)


def resting_series(line: str | Path, name: str) -> list[list[Any]] | None:
    """Reading `name` over the whole of a line at rest, as the console asks a supervisor's `series`
    for it (`nsconsole.row_fetch.reading_points`): buckets of rows, each as its lowest and highest
    value (`RowsTail.series`); None when
    the line is not at rest (as `read_at_rest`). A pinned gradient norm of a line of months that
    ended is drawn from its first update, not only from its newest rows."""
    layout = LineLayout(line)
    signature = files_signature(line)
    if not _at_rest(supervisor_record(layout), read_json(layout.heartbeat)):
        return None
    tail = RowsTail.load(layout.rows_jsonl, layout.rows_index)
    tail.catch_up()
    stride = series_stride(tail.count)
    points: list[list[Any]] = []
    since = 0
    while since < tail.count:
        page, since = tail.series(name, since, stride)
        points += page
    return points if files_signature(line) == signature else None


def supervisor_record(layout: LineLayout) -> dict[str, Any] | None:
    """supervisor.json; None when there is none. One that is damaged (not JSON, say: by hand or by the
    disk, as a supervisor writes it whole) is a record of no state whose `DAMAGED_RECORD` says what is
    wrong: the line stays listed, its state unknown, rather than vanishing from the console."""
    supervisor = read_json(layout.supervisor_json)
    if supervisor is not None:
        return supervisor
    problem = damaged_record(layout.root)
    return None if problem is None else {DAMAGED_RECORD: problem}


def _at_rest(supervisor: dict[str, Any] | None, heartbeat: dict[str, Any] | None) -> bool:
    """Whether no supervisor or trainer writes the line whose supervisor.json and heartbeat these are."""
    if supervisor is None:
        return False  # never ran under a supervisor
    if supervisor.get("state") not in FINAL_LINE_STATES and running_supervisor_pid(supervisor) is not None:
        return False  # a supervisor starting, or one that has not registered: it writes the files
    # A trainer that still runs: without a supervisor, or an orphan finishing its checkpoint.
    return running_trainer_pid(heartbeat) is None


def resting_rows(layout: LineLayout) -> list[dict[str, Any]]:
    """The newest `FULL_ROWS` whole rows of a rows.jsonl no one writes, after the downsampled
    history of the older ones: in memory that does not grow with its length, read from where the
    supervisor's saved index left off (through, where there is none)."""
    tail = RowsTail.load(layout.rows_jsonl, layout.rows_index)
    tail.catch_up()
    newest_from = since = max(0, tail.count - FULL_ROWS)
    newest: list[dict[str, Any]] = []
    while since < tail.count:
        rows, since = tail.read(since, tail.count - since, budget=None)
        newest += [row for row in rows if "omitted" not in row]
    history = [row for _, row in tail.digest.rows(0)] if newest_from else []
    return joined_rows(history, newest)
