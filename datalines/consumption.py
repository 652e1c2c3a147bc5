"""Which training line consumed a data line's cycles, and the refusal of a second line on them.

A data line is trained once: a cycle's `consumed` mark (written by the trainer at the cycle's
end) means its shards are deleted and no other line will ever be given it. A second training
line on the same data line would wait for a cycle that never comes ("waiting for data cycle 0");
`nsconsole new` and the trainer's start refuse it at once with `consumed_refusal`, which names
the cycles, the line that consumed them and the command that makes an identical data line
(`nsconsole data init --work NEW --like DATA`: the same recipe, pins, tokenizer and cycle size,
hence the same cycles and held-out rows, byte for byte).

The mark holds `{"pid": ..., "line": "<training line directory>"}`; a mark written by an older
nsconsole holds the pid alone, and its line is unknown.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from datalines.dataline import CONSUMED_MARK, DataLine
from datalines.errors import DataLineError


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
