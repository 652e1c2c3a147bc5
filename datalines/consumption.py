"""Which training line trains on a data line and consumed its cycles, and the refusal of a second line.

A data line is trained by one training line. Its trainer's first start records that line in
`training_line.json` (`claim_data_line`), atomically and before it reads any cycle, so a second
line is refused while the first one is still in its first cycle: two lines reading the same
cycle at once would each train on it, and whichever ended it first would have its shards deleted
under the other. `nsconsole new`, `nsconsole check` and the trainer's start refuse it with
`trained_refusal`. A recorded line that no longer trains on it (its user deleted it: no run.json;
or its run.json names another data line, e.g. a copy of both) gives it up: the next line to start
takes the data line over.

A cycle's `consumed` mark (written by the trainer at the cycle's end) means its shards are
deleted and no other line will ever be given it: a line on a data line whose cycles another line
consumed (the one that took over from a deleted line, a data line trained before the record
existed) would wait for a cycle that never comes ("waiting for data cycle 0"); it is refused at
once with `consumed_refusal`. Both refusals name the command that makes an identical data line
(`nsconsole data init --work NEW --like DATA`: the same recipe, pins, tokenizer and cycle size,
hence the same cycles and held-out rows, byte for byte).

The mark holds `{"pid": ..., "line": "<training line directory>"}`; a mark written by an older
nsconsole holds the pid alone, and its line is unknown. The record holds `{"line": ..., "pid":
..., "since": <UTC time>}`.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from datalines.dataline import CONSUMED_MARK, TRAINING_LINE_RECORD, DataLine
from datalines.errors import DataLineError
from datalines.files import directory_lock, read_json, write_bytes_atomic

LINE_CONFIG = "run.json"
"""A training line's configuration, in its directory: `data.line` names the data line it trains on."""


@dataclass(frozen=True)
class Consumer:
    """Who marked a cycle consumed."""

    line: str | None
    """The training line's directory; None for a mark that does not say (an older nsconsole's)."""
    pid: int | None
    """The trainer's process id when it marked the cycle."""


def consumed_mark(by: str | os.PathLike[str] | None) -> bytes:
    """The bytes of a consumed mark written by this process for the training line `by`."""
    line = None if by is None else str(Path(by).absolute())
    return (json.dumps({"pid": os.getpid(), "line": line}) + "\n").encode("utf-8")


def _cycle_dir(data: Path, index: int) -> Path:
    return data / "cycles" / f"c{index:04d}"


def consumer_of(data: Path, index: int) -> Consumer | None:
    """Who consumed cycle `index` of the data line at `data`; None when it is not consumed."""
    path = _cycle_dir(data, index) / CONSUMED_MARK
    try:
        text = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    try:
        record = json.loads(text)
    except ValueError:
        record = None
    if isinstance(record, dict):
        pid = record.get("pid")
        line = record.get("line")
        return Consumer(line if isinstance(line, str) else None, pid if isinstance(pid, int) else None)
    return Consumer(None, int(text) if text.isdigit() else None)


def consumed_cycles(data: Path) -> dict[int, Consumer]:
    """Every consumed cycle of the data line at `data` and who consumed it (read from the marks
    alone: `nsconsole new` asks before it opens the line)."""
    found: dict[int, Consumer] = {}
    for mark in sorted(data.glob(f"cycles/c[0-9][0-9][0-9][0-9]/{CONSUMED_MARK}")):
        index = int(mark.parent.name[1:])
        consumer = consumer_of(data, index)
        if consumer is not None:
            found[index] = consumer
    return found


def _cycle_ranges(indices: list[int]) -> str:
    """`0-3, 5` for [0, 1, 2, 3, 5]."""
    parts: list[str] = []
    start = previous = indices[0]
    for index in [*indices[1:], None]:
        if index is not None and index == previous + 1:
            previous = index
            continue
        parts.append(str(start) if start == previous else f"{start}-{previous}")
        if index is not None:
            start = previous = index
    return ", ".join(parts)


def consumed_refusal(data: Path, cycles: dict[int, Consumer], what: str) -> str:
    """One line: `what` (e.g. "a new line") cannot train on the data line at `data` whose `cycles`
    are consumed."""
    indices = sorted(cycles)
    lines = sorted({consumer.line or "an unknown line (a mark without its line)" for consumer in cycles.values()})
    count = "cycle" if len(indices) == 1 else "cycles"
    return (
        f"{data}: {count} {_cycle_ranges(indices)} already consumed by {' and '.join(lines)}; "
        f"a data line is trained once, so {what} would wait for them forever; make an identical data line "
        f"with `nsconsole data init --work DIR --like {data}` and train on DIR"
    )


def claim_cycle(data_line: DataLine, index: int, line: str | os.PathLike[str], *, writes: bool = True) -> str | None:
    """A training line `line` is about to read cycle `index`: DataLineError (one line) when another
    line consumed it; when `line` itself did (a resume that fell back past a damaged cycle-end
    checkpoint), the cycle is reopened, as a rollback reopens it, and a note returned for the log
    (`writes`: this process may write the mark, rank 0 of a group)."""
    consumer = consumer_of(data_line.path, index)
    if consumer is None:
        return None
    if consumer.line is not None and Path(consumer.line) == Path(line).absolute():
        if writes:
            data_line.reopen(index)
        return f"cycle {index} was marked consumed by this line after the checkpoint resumed; reopened it"
    raise DataLineError(consumed_refusal(data_line.path, {index: consumer}, f"{Path(line).absolute()}"))


def _same_line(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Two names of one training line directory (a symlink in one of them included)."""
    return Path(a).resolve() == Path(b).resolve()


def training_line_of(data: Path) -> Path | None:
    """The training line recorded as the one that trains on the data line at `data`; None before
    any line started on it (a DataLineError naming the record when it is not one)."""
    path = data / TRAINING_LINE_RECORD
    if not path.exists():
        return None
    record = read_json(path)
    line = record.get("line") if isinstance(record, dict) else None
    if not isinstance(line, str):
        raise DataLineError(f"{path}: not a training line record (no \"line\")")
    return Path(line)


def trains_on(line: Path, data: Path) -> bool:
    """Whether the training line at `line` still trains on the data line at `data`: its run.json is
    there and its `data.line` names it (absolute, or relative to the line's directory, as
    engine.ops.lines.resolve_data_path reads it). A line deleted, or whose run.json names another
    data line (the copy made with a copy of the data line, say), trains nothing here any more; a
    run.json that cannot be read counts as naming it (the line is there, its user's to mend)."""
    try:
        document = json.loads((line / LINE_CONFIG).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return False
    except (OSError, ValueError):
        return True
    section = document.get("data") if isinstance(document, dict) else None
    named = section.get("line") if isinstance(section, dict) else None
    if not isinstance(named, str):
        return True
    path = Path(named).expanduser()
    return (path if path.is_absolute() else line / path).resolve() == data.resolve()


def trained_refusal(data: Path, owner: Path, what: str) -> str:
    """One line: `what` (e.g. "a new line") cannot train on the data line at `data`, which the
    training line `owner` trains on."""
    return (
        f"{data}: trained by {owner}, the first line that started on it; a data line is trained by one line, "
        f"so {what} cannot train on it; make an identical data line with "
        f"`nsconsole data init --work DIR --like {data}` and train on DIR"
    )


def other_training_line(data: Path, line: str | os.PathLike[str]) -> Path | None:
    """The training line other than `line` that trains on the data line at `data` and is still
    there; None when there is none and `line` may train on it (`nsconsole new` and `check` ask; the
    trainer's start claims it with `claim_data_line`)."""
    owner = training_line_of(data)
    if owner is None or _same_line(owner, line) or not trains_on(owner, data):
        return None
    return owner


def _record(line: Path) -> bytes:
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return (json.dumps({"line": str(line), "pid": os.getpid(), "since": since}) + "\n").encode("utf-8")


def claim_data_line(data: Path, line: str | os.PathLike[str], *, writes: bool = True) -> str | None:
    """The training line `line` starts on the data line at `data`, before it reads any cycle: it is
    recorded as the line that trains on it, unless another line still there is (DataLineError, one
    line: `trained_refusal`). The same line starting again (a resume, a rollback, a relaunch)
    passes. A line that no longer trains on it (`trains_on`: deleted, say) gives the data line up:
    the next line to start takes it over (a note for run.log is returned). Read and written under
    the directory's flock, so of two lines starting at once one is recorded and the other refused.
    `writes`: this process records the claim (rank 0 of a group); the other ranks only check."""
    line = Path(line).absolute()
    # The data line directory's flock for the read-then-write (short: two trainers starting at once take turns).
    with directory_lock(data) if writes else contextlib.nullcontext():
        owner = training_line_of(data)
        if owner is not None and _same_line(owner, line):
            return None
        if owner is not None and trains_on(owner, data):
            raise DataLineError(trained_refusal(data, owner, str(line)))
        if writes:
            write_bytes_atomic(data / TRAINING_LINE_RECORD, _record(line))
    if owner is None:
        return None
    return (
        f"{data}: {owner}, the line that trained on it, no longer does (deleted, or its {LINE_CONFIG} "
        "names another data line); this line takes it over"
    )
