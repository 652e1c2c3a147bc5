"""rows.jsonl as a line's supervisor (and the console, for a line at rest) reads it while the
trainer appends: `RowsTail` indexes whole rows only, in memory that does not grow with the line's
age (every one of the newest rows, every `SPARSE_STRIDE`-th before them), notices a cut back (a
resume, a rollback) by each row's digest, and keeps a downsampled history (`RowsDigest`) whose size
is fixed, so a client attaching to a line of months is answered as fast as to one of a day.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import threading
from array import array
from collections import deque
from pathlib import Path
from typing import Any, BinaryIO

from engine.atomic import write_text_atomic
from engine.errors import LineError
from engine.protocol import wire
from engine.supervisor.reads import parse_json, read_json, whole_characters
from engine.supervisor.rows_digest import JSON_NUMBER, RowsDigest, compact_row

REPLY_BUDGET_BYTES = wire.MAX_LINE_BYTES - 4096
"""What the rows of one reply may take, leaving room for the envelope."""

RECENT_INDEX = 8192
"""Newest rows whose offset and digest `RowsTail` keeps one by one (a resume cuts back within them)."""
SPARSE_STRIDE = 1024
"""Older rows are indexed every this many: a read seeks there and skips at most this many lines."""
INDEX_FORMAT = 1
"""The format of a saved index (`RowsTail.save`); one of another format is not read."""
READ_CHUNK = 8 << 20
"""Bytes read at a time while indexing: a months-long rows.jsonl is never held whole."""
SERIES_SCAN_BYTES = 64 << 20
"""Bytes of rows.jsonl one `series` call reads at most (0.16-0.19 s of
ns-2b-sized rows on the 2-core development machine): a reading that few rows hold
is found in several calls, each answered before the client's timeout, not in one scan of 3 GB."""


class RowsTail:
    """rows.jsonl as far as it has whole lines: new rows since the last look, random access, and a
    downsampled history (`digest`), in memory that does not grow with the line's age.

    Each of the newest `RECENT_INDEX` rows has its offset and a digest; older rows are indexed
    every `SPARSE_STRIDE` rows. The trainer cuts rows.jsonl back on a resume and writes the
    replayed updates again, perhaps before the next look: the last row read is checked against its
    digest, and on a mismatch the rows are walked back to the last one still intact (older than the
    newest rows: the last intact sparse entry); what follows it is news again.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.digest = RowsDigest()
        self._recent: deque[tuple[int, int]] = deque(maxlen=RECENT_INDEX)  # (offset, digest) of the newest rows
        self._sparse_offsets = array("q")  # offset of row k * SPARSE_STRIDE
        self._sparse_digests = array("q")
        self._count = 0
        self._end = 0  # bytes consumed (the end of the last whole row)
        self._lock = threading.Lock()
        self.rows_read = 0
        """Rows this tail has read from the file (not restored from a saved index)."""

    def save(self, index_path: Path) -> None:
        """Write what has been indexed to `index_path` (atomically; about a MiB whatever the line's
        age): a later tail of the same file starts from it (`load`) and reads only the rows after it.
        A months-long rows.jsonl (3 GB for a million ns-2b rows) takes a minute to read through."""
        with self._lock:
            document = {"format": INDEX_FORMAT, "rows": self._count, "end": self._end,
                        "sparse_offsets": list(self._sparse_offsets), "sparse_digests": list(self._sparse_digests),
                        "recent": list(self._recent), "history": self.digest.snapshot()}  # fmt: skip
        write_text_atomic(index_path, json.dumps(document, separators=(",", ":")))

    @classmethod
    def load(cls, path: Path, index_path: Path) -> RowsTail:
        """A tail of `path` that starts where the index `save` wrote to `index_path` left off; a fresh
        one where that file is missing, damaged or of another format (it is a cache). Nothing in it is
        trusted: the next look checks the saved rows' digests against the file and walks back past
        any row that changed (a rollback or a resume cut the file), as it does between two looks."""
        tail = cls(path)
        document = read_json(index_path)
        if document is None or document.get("format") != INDEX_FORMAT:
            return tail
        try:
            tail._restore(document)
        except (KeyError, TypeError, ValueError):
            return cls(path)
        return tail

    @staticmethod
    def indexed_bytes(index_path: Path) -> int:
        """How much of rows.jsonl the index saved at `index_path` covers (0: none, or not an index)."""
        document = read_json(index_path)
        end = document.get("end") if document is not None and document.get("format") == INDEX_FORMAT else 0
        return end if isinstance(end, int) and not isinstance(end, bool) and end > 0 else 0

    def _restore(self, document: dict[str, Any]) -> None:
        count, end = document["rows"], document["end"]
        offsets, digests = array("q", document["sparse_offsets"]), array("q", document["sparse_digests"])
        recent = [(int(offset), int(digest)) for offset, digest in document["recent"]]
        whole = all(isinstance(value, int) and not isinstance(value, bool) and value >= 0 for value in (count, end))
        if not whole or len(offsets) != len(digests) or len(offsets) != -(-count // SPARSE_STRIDE) \
                or len(recent) > min(count, RECENT_INDEX):
            raise ValueError("an index whose counts disagree")
        self.digest = RowsDigest.restored(document["history"])
        self._count, self._end = count, end
        self._sparse_offsets, self._sparse_digests = offsets, digests
        self._recent.extend(recent)

    @property
    def count(self) -> int:
        return self._count

    def poll(self) -> list[dict[str, Any]]:
        """The rows appended since the last poll (unparsable lines are skipped, not raised)."""
        return [row for _, row in self._take(keep=True)]

    def poll_indexed(self) -> list[tuple[int, dict[str, Any]]]:
        """`poll`'s rows with their indices in rows.jsonl (what a client names to `row`)."""
        return self._take(keep=True)

    def catch_up(self) -> None:
        """Index what rows.jsonl holds now without returning it (a supervisor's start: history, not news)."""
        self._take(keep=False)

    def _take(self, keep: bool) -> list[tuple[int, dict[str, Any]]]:
        with self._lock:
            try:
                handle = open(self.path, "rb")  # noqa: SIM115 - closed below, after the reads
            except OSError:
                # Gone, or no file to read (a directory in its place: the line's start and `status`
                # name that); no rows, rather than a traceback in the console that reads it.
                self._drop_from(0)
                return []
            rows: list[tuple[int, dict[str, Any]]] = []
            with handle:
                size = os.fstat(handle.fileno()).st_size
                self._walk_back_to_intact_rows(handle, size)
                handle.seek(self._end)
                while self._end < size:
                    data = handle.read(min(READ_CHUNK, size - self._end))
                    whole = data[: data.rfind(b"\n") + 1]
                    if not whole:
                        if len(data) < READ_CHUNK:
                            break  # a torn last line
                        whole = data + handle.readline()  # a line longer than a chunk
                        if not whole.endswith(b"\n"):
                            break
                    for line in whole.splitlines(keepends=True):
                        self._index(line, rows if keep else None)
                    handle.seek(self._end)
            return rows

    def _index(self, line: bytes, rows: list[tuple[int, dict[str, Any]]] | None) -> None:
        digest = _digest(line)
        if self._count % SPARSE_STRIDE == 0:
            self._sparse_offsets.append(self._end)
            self._sparse_digests.append(digest)
        self._recent.append((self._end, digest))
        self.rows_read += 1
        compact = compact_row(line)
        if compact is not None:
            self.digest.add(self._count, compact)
        if rows is not None:
            row = parse_json(line)
            if row is not None:
                rows.append((self._count, row))
        self._count += 1
        self._end += len(line)

    def _walk_back_to_intact_rows(self, handle: BinaryIO, size: int) -> None:
        recent_first = self._count - len(self._recent)
        keep = self._count
        for offset, digest in reversed(self._recent):
            if _intact(handle, offset, digest, size):
                break
            keep -= 1
        if keep == recent_first and keep:  # none of the newest rows is intact: look further back
            stride = len(self._sparse_offsets)
            while stride and not _intact(handle, self._sparse_offsets[stride - 1], self._sparse_digests[stride - 1], size):
                stride -= 1
            keep = min(keep, stride * SPARSE_STRIDE - (SPARSE_STRIDE - 1)) if stride else 0
        if keep < self._count:
            self._drop_from(keep)

    def _drop_from(self, index: int) -> None:
        """Forget rows from `index` on (`index` is within the newest rows, or 1 past a sparse entry)."""
        if index >= self._count:
            return
        recent_first = self._count - len(self._recent)
        if index > recent_first:
            self._end = self._recent[index - recent_first][0]
            for _ in range(self._count - index):
                self._recent.pop()
        else:
            self._recent.clear()
            if index:
                entry = (index - 1) // SPARSE_STRIDE
                self._end = self._sparse_offsets[entry]
                index = entry * SPARSE_STRIDE  # the sparse row itself is read (and digested) again
            else:
                self._end = 0
        # One sparse entry per SPARSE_STRIDE rows kept: a row it named past the cut is indexed again.
        kept_entries = -(-index // SPARSE_STRIDE)
        del self._sparse_offsets[kept_entries:]
        del self._sparse_digests[kept_entries:]
        self._count = index
        self.digest.cut_from(index)

    def read(self, since: int, limit: int, budget: int | None = REPLY_BUDGET_BYTES) -> tuple[list[dict[str, Any]], int]:
        """Rows `since` .. (at most `limit` of them, within the reply `budget`; None: every row
        whole, for a reader in this process); the next index."""
        with self._lock:
            if since >= self._count:
                return [], since
            end_index = min(self._count, since + limit)
            with open(self.path, "rb") as handle:
                self._seek_row(handle, since)
                lines = []
                used = 0
                while since + len(lines) < end_index:
                    line = handle.readline()
                    if lines and budget is not None and used + len(line) > budget:
                        break
                    lines.append(line)
                    used += len(line)
        rows: list[dict[str, Any]] = []
        for line in lines:
            row = parse_json(line)
            if budget is not None and len(line) > budget:
                row = {"index": since + len(rows), "omitted": f"row of {len(line)} bytes is past the reply cap"}
            rows.append(row if row is not None else {"index": since + len(rows), "omitted": "unparsable"})
        return rows, since + len(rows)

    def row_text(self, index: int, offset: int, length: int) -> dict[str, Any]:
        """The `row {index, offset, length}` reply: row `index` as JSON text, at most `length` bytes
        of it from `offset` (whole UTF-8 characters), its `size` in bytes without the newline, and
        `next`: how a client reads a row too large for one message (an ns-2b validation, with its
        probes and samples, is about 350 KB) in pieces. LineError for a row not read yet."""
        with self._lock:
            if index >= self._count:
                raise LineError(f"row {index}: rows.jsonl has {self._count} rows")
            with open(self.path, "rb") as handle:
                self._seek_row(handle, index)
                line = handle.readline().rstrip(b"\n")
        chunk = whole_characters(line[offset:offset + length])
        text = chunk.decode("utf-8", errors="replace")
        return {"index": index, "offset": offset, "text": text, "next": offset + len(chunk), "size": len(line)}

    def _seek_row(self, handle: BinaryIO, index: int) -> None:
        """Put `handle` at row `index`: its offset if it is among the newest rows, else the sparse
        entry before it and the lines between skipped."""
        recent_first = self._count - len(self._recent)
        if index >= recent_first:
            handle.seek(self._recent[index - recent_first][0])
            return
        handle.seek(self._sparse_offsets[index // SPARSE_STRIDE])
        for _ in range(index % SPARSE_STRIDE):
            handle.readline()

    def history(self, since: int) -> tuple[list[dict[str, Any]], int]:
        """The downsampled history's rows from row `since` on that fit a reply; the next index."""
        with self._lock:
            points = self.digest.rows(since)
        rows: list[dict[str, Any]] = []
        used = 0
        for position, (_, row) in enumerate(points):
            cost = len(json.dumps(row)) + 2
            if rows and used + cost > REPLY_BUDGET_BYTES:
                return rows, points[position - 1][0] + 1
            rows.append(row)
            used += cost
        return rows, max(since, self._count)

    def series(self, name: str, since: int, stride: int) -> tuple[list[list[Any]], int]:
        """The `series {name, since, stride}` reply: reading `name` from row `since` on, in buckets of
        `stride` rows, each bucket as the rows of its lowest and highest value, `[index, update,
        tokens, time, value]` in row order (rows without it left out), as many buckets as fit a
        reply and `SERIES_SCAN_BYTES` of the file; and the first row of the next bucket. How a client
        draws one reading of a line of months (a pinned gradient norm) from about 2,000 points, not
        from a million rows fetched whole: the file is read here, once, a line at a time.

        The lock is held only to find where row `since` starts: the rows up to the count then are
        whole and a trainer only appends after them, so the scan needs no lock, and the supervisor's
        pump (`poll_indexed`) does not wait for it. A cut back meanwhile (a resume, a rollback) may
        hand the client rows it is about to be told were rolled back, as a `rows` reply can."""
        pattern = _series_pattern(name)
        points: list[list[Any]] = []
        used, index = 0, since
        with open(self.path, "rb") as handle:
            with self._lock:
                count = self._count
                if since >= count:
                    return [], since
                self._seek_row(handle, since)
            scan_end = handle.tell() + SERIES_SCAN_BYTES
            while index < count and used < REPLY_BUDGET_BYTES - 4096 and handle.tell() < scan_end:
                bucket: list[list[Any]] = []
                for _ in range(min(stride, count - index)):
                    found = _series_point(index, handle.readline(), pattern, name)
                    if found is not None:
                        bucket.append(found)
                    index += 1
                chosen = _lowest_and_highest(bucket)
                points += chosen
                used += sum(len(json.dumps(point)) + 1 for point in chosen)
        return points, index


def _series_pattern(name: str) -> re.Pattern[bytes]:
    keys = b"|".join(re.escape(json.dumps(key).encode()) for key in ("update", "tokens", "time", name))
    return re.compile(rb"(" + keys + rb"): (" + JSON_NUMBER + rb")")


def _series_point(index: int, line: bytes, pattern: re.Pattern[bytes], name: str) -> list[Any] | None:
    fields = {key.decode(): value for key, value in pattern.findall(line)}
    value = fields.get(json.dumps(name))
    if value is None:
        return None
    numbers = [float(fields[f'"{key}"']) if f'"{key}"' in fields else None for key in ("update", "tokens", "time")]
    return [index, *numbers, float(value)]


def _lowest_and_highest(bucket: list[list[Any]]) -> list[list[Any]]:
    """The points of a bucket's lowest and highest value (NaN sorts as neither), in row order."""
    numbers = [point for point in bucket if not math.isnan(point[-1])] or bucket[:1]
    if not numbers:
        return []
    chosen = {id(point): point for point in (min(numbers, key=lambda p: p[-1]), max(numbers, key=lambda p: p[-1]))}
    return sorted(chosen.values(), key=lambda point: point[0])


def _intact(handle: BinaryIO, offset: int, digest: int, size: int) -> bool:
    handle.seek(offset)
    line = handle.readline()
    return offset + len(line) <= size and line.endswith(b"\n") and _digest(line) == digest


def _digest(line: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(line, digest_size=8).digest(), "little", signed=True)
