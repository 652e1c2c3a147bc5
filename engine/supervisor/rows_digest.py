"""A downsampled history of rows.jsonl whose size does not grow with the line's age: what a
client attaching to a line of months is sent instead of its every row (`history`), and what the
console's curves draw of the rows before the newest ones.

Rows are read compactly (`compact_row`: the few numbers the curves and the table need, without
parsing an ns-2b row's hundreds of keys) and kept as each stretch's `extremes`, so a spike stays
visible however far the history is zoomed out.
"""

from __future__ import annotations

import math
import re
from collections import deque
from dataclasses import dataclass
from typing import Any

from engine.supervisor.reads import parse_json

HISTORY_BUCKETS = 1024
"""Buckets of the downsampled history (`RowsDigest`): its size whatever the line's age."""
HISTORY_VALIDATIONS = 512
"""Newest validations the downsampled history keeps (their headline losses)."""
COMPACT_KEYS = ("update", "tokens", "loss", "lr", "grad_norm", "tokens_per_s", "skipped", "time", "cycle")
"""What a row of the downsampled history carries: what the console's curves and table need."""

JSON_NUMBER = rb"-?[0-9][0-9.eE+-]*|NaN|-?Infinity"
"""A number as rows.jsonl writes it (json.dumps, NaN and infinities allowed): what the row readers
here and `RowsTail.series` pick out of a line without parsing it whole."""
_COMPACT_FIELD = re.compile(
    rb'"(' + b"|".join(key.encode() for key in COMPACT_KEYS) + rb')": (' + JSON_NUMBER + rb"|true|false|null)"
)
_VALIDATION_KEY = re.compile(r"^(ema/)?val_\d+/[^/]+$")


def compact_row(line: bytes) -> dict[str, Any] | None:
    """A row of rows.jsonl as the downsampled history keeps it: its `COMPACT_KEYS`, read without
    parsing the whole line (an ns-2b row has hundreds of keys; a validation, thousands), and for a
    validation its headline losses (`val_<L>/<name>`, no probes or samples). None: no update."""
    if b'"val_' in line or b'"ema/val_' in line:
        row = parse_json(line)
        if row is None:
            return None
        kept = {key: row[key] for key in row if key in COMPACT_KEYS or key == "seq_len" or _VALIDATION_KEY.match(key)}
        return kept if isinstance(kept.get("update"), int) else None
    fields = _COMPACT_FIELD.findall(line)
    row = parse_json(b"{" + b", ".join(b'"' + name + b'": ' + value for name, value in fields) + b"}")
    return row if row is not None and isinstance(row.get("update"), int) else None


def _rank(row: dict[str, Any], key: str) -> float:
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return math.nan
    return float(value)


def extremes(indexed: list[tuple[int, dict[str, Any]]]) -> list[tuple[int, dict[str, Any]]]:
    """The rows that stand for a stretch of rows on a plot, in row order: the lowest and highest
    loss and the highest gradient norm (so a spike stays visible however far it is zoomed out);
    the first row where none has a number to rank."""
    chosen = set()
    for key, pick in (("loss", min), ("loss", max), ("grad_norm", max)):
        ranked = [(value, position) for position, (_, row) in enumerate(indexed)
                  if not math.isnan(value := _rank(row, key))]
        if ranked:
            chosen.add(pick(ranked)[1])
    return [indexed[position] for position in sorted(chosen or {0})] if indexed else []


@dataclass
class _Bucket:
    first: int
    """Its first row's index."""
    count: int
    points: list[tuple[int, dict[str, Any]]]
    """(row index, compact row) of its `extremes`."""


class RowsDigest:
    """A downsampled history of rows.jsonl whose size does not grow with the line's age.

    At most `HISTORY_BUCKETS` buckets of consecutive rows, each kept as its `extremes` (up to 3
    compact rows); when the buckets run out, neighbours merge and each covers twice as many rows.
    Plus the newest `HISTORY_VALIDATIONS` validations' headline losses. A cut back (a resume, a
    rollback) drops what follows the cut.
    """

    def __init__(self) -> None:
        self.width = 1
        """Rows per bucket."""
        self._buckets: list[_Bucket] = []
        self._validations: deque[tuple[int, dict[str, Any]]] = deque(maxlen=HISTORY_VALIDATIONS)

    def add(self, index: int, row: dict[str, Any]) -> None:
        if is_validation_row(row):
            self._validations.append((index, row))
        bucket = self._buckets[-1] if self._buckets else None
        if bucket is None or bucket.count >= self.width:
            self._buckets.append(_Bucket(index, 1, [(index, row)]))
            if len(self._buckets) > HISTORY_BUCKETS:
                self._merge()
            return
        bucket.count += 1
        bucket.points = extremes([*bucket.points, (index, row)])

    def _merge(self) -> None:
        merged = []
        for left, right in zip(self._buckets[::2], [*self._buckets[1::2], None], strict=True):
            if right is None:
                merged.append(left)
            else:
                merged.append(_Bucket(left.first, left.count + right.count, extremes([*left.points, *right.points])))
        self._buckets = merged
        self.width *= 2

    def cut_from(self, index: int) -> None:
        """Forget the rows from `index` on (rows.jsonl was cut back there)."""
        while self._buckets and self._buckets[-1].first >= index:
            self._buckets.pop()
        if self._buckets and self._buckets[-1].first + self._buckets[-1].count > index:
            bucket = self._buckets[-1]
            bucket.count = index - bucket.first
            bucket.points = [point for point in bucket.points if point[0] < index] or bucket.points[:0]
        while self._validations and self._validations[-1][0] >= index:
            self._validations.pop()

    def snapshot(self) -> dict[str, Any]:
        """What `restored` makes the same digest from (JSON)."""
        return {"width": self.width, "buckets": [[bucket.first, bucket.count, bucket.points] for bucket in self._buckets],
                "validations": list(self._validations)}

    @classmethod
    def restored(cls, snapshot: dict[str, Any]) -> RowsDigest:
        """The digest `snapshot` was taken of; KeyError, TypeError or ValueError for one that is not one."""
        digest = cls()
        digest.width = _whole(snapshot["width"])
        digest._buckets = [_Bucket(_whole(first), _whole(count), _points(points))
                           for first, count, points in snapshot["buckets"]]  # fmt: skip
        digest._validations.extend(_points(snapshot["validations"]))
        return digest

    def rows(self, since: int) -> list[tuple[int, dict[str, Any]]]:
        """(index, compact row) of the history from row `since` on, in row order."""
        points = {index: row for bucket in self._buckets for index, row in bucket.points if index >= since}
        points.update((index, row) for index, row in self._validations if index >= since)
        return sorted(points.items())


def _whole(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"not a count: {value!r}")
    return value


def _points(points: Any) -> list[tuple[int, dict[str, Any]]]:
    restored = [(_whole(index), row) for index, row in points]
    if not all(isinstance(row, dict) for _, row in restored):
        raise TypeError("a point's row is not an object")
    return restored


def is_validation_row(row: dict[str, Any]) -> bool:
    """A row that carries validation readings (pushed as `validation`, the others as `row`)."""
    return any(key.startswith(("val_", "ema/val_")) for key in row)
