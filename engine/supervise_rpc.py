"""What a line's supervisor answers on its socket: the handler behind `engine/server.py`.

Reads (`status`, `rows`, `log`, `gpu`) come from the supervisor's own view of the line: it tails
rows.jsonl as the trainer appends (whole lines only, an index of their offsets kept), so a
client never reads a file mid-write. Mutations change the line through the same engine
functions the commands use (`engine.ops`); the server applies each request_id once.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from array import array
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from engine import ops, protocol
from engine.errors import LineError
from engine.gpu import gpu_snapshot, lease_holder
from engine.layout import LineLayout

REPLY_BUDGET_BYTES = protocol.MAX_LINE_BYTES - 4096
"""What the rows of one reply may take, leaving room for the envelope."""


class RowsTail:
    """rows.jsonl as far as it has whole lines: new rows since the last look, and random access.

    The trainer cuts rows.jsonl back on a resume and writes the replayed updates again, perhaps
    before the next look: the last row read is checked against a digest of it, and on a mismatch
    the rows are walked back to the last one still intact; what follows it is news again.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offsets = array("q")  # byte offset of every whole row read so far
        self._digests = array("q")  # a digest of every such row, to notice a cut back
        self._end = 0  # bytes consumed (the end of the last whole row)
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        return len(self._offsets)

    def poll(self) -> list[dict[str, Any]]:
        """The rows appended since the last poll (unparsable lines are skipped, not raised)."""
        with self._lock:
            try:
                handle = open(self.path, "rb")  # noqa: SIM115 - closed below, after the reads
            except FileNotFoundError:
                self._drop_from(0)
                return []
            with handle:
                size = os.fstat(handle.fileno()).st_size
                self._walk_back_to_intact_rows(handle, size)
                if size == self._end:
                    return []
                handle.seek(self._end)
                data = handle.read(size - self._end)
            whole = data[: data.rfind(b"\n") + 1]
            rows = []
            offset = self._end
            for line in whole.splitlines(keepends=True):
                self._offsets.append(offset)
                self._digests.append(_digest(line))
                offset += len(line)
                row = _parse_row(line)
                if row is not None:
                    rows.append(row)
            self._end = offset
            return rows

    def _walk_back_to_intact_rows(self, handle: BinaryIO, size: int) -> None:
        keep = len(self._offsets)
        while keep:
            start = self._offsets[keep - 1]
            handle.seek(start)
            line = handle.readline()
            whole = start + len(line) <= size and line.endswith(b"\n")
            if whole and _digest(line) == self._digests[keep - 1]:
                break
            keep -= 1
        if keep < len(self._offsets):
            self._drop_from(keep)

    def _drop_from(self, index: int) -> None:
        if index < len(self._offsets):
            self._end = self._offsets[index]
        del self._offsets[index:]
        del self._digests[index:]
        if not self._offsets:
            self._end = 0

    def read(self, since: int, limit: int) -> tuple[list[dict[str, Any]], int]:
        """Rows `since` .. (at most `limit` of them, within the reply budget); the next index."""
        with self._lock:
            if since >= len(self._offsets):
                return [], since
            end_index = min(len(self._offsets), since + limit)
            start = self._offsets[since]
            stop = self._offsets[end_index] if end_index < len(self._offsets) else self._end
            with open(self.path, "rb") as handle:
                handle.seek(start)
                data = handle.read(stop - start)
        rows: list[dict[str, Any]] = []
        used = 0
        for line in data.splitlines():
            cost = len(line) + 1
            if rows and used + cost > REPLY_BUDGET_BYTES:
                break
            row = _parse_row(line)
            if cost > REPLY_BUDGET_BYTES:
                row = {"index": since + len(rows), "omitted": f"row of {cost} bytes is past the reply cap"}
            rows.append(row if row is not None else {"index": since + len(rows), "omitted": "unparsable"})
            used += cost
        return rows, since + len(rows)


def _digest(line: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(line, digest_size=8).digest(), "little", signed=True)


def _parse_row(line: bytes) -> dict[str, Any] | None:
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) else None


def is_validation_row(row: dict[str, Any]) -> bool:
    """A row that carries validation readings (pushed as `validation`, the others as `row`)."""
    return any(key.startswith(("val_", "ema/val_")) for key in row)


class SupervisorView(Protocol):
    """What the handler needs from the supervisor it serves."""

    layout: LineLayout
    rows_tail: RowsTail
    request_log: protocol.RequestLog

    def state_for_status(self) -> dict[str, Any]: ...

    def request_stop(self, at_cycle_end: int | None) -> None: ...


class LineHandler:
    """The supervisor's RPC methods (see `engine/protocol.py` for their parameters)."""

    def __init__(self, supervisor: SupervisorView) -> None:
        self.supervisor = supervisor
        self.request_log = supervisor.request_log

    def status(self) -> dict[str, Any]:
        return self.supervisor.state_for_status()

    def rows(self, since: int, limit: int) -> dict[str, Any]:
        rows, next_index = self.supervisor.rows_tail.read(since, limit)
        return {"rows": rows, "next": next_index, "total": self.supervisor.rows_tail.count}

    def log(self, offset: int, length: int) -> dict[str, Any]:
        path = self.supervisor.layout.run_log
        try:
            with open(path, "rb") as handle:
                size = os.fstat(handle.fileno()).st_size
                handle.seek(offset)
                chunk = handle.read(min(length, max(0, size - offset)))
        except FileNotFoundError:
            size, chunk = 0, b""
        chunk = _whole_characters(chunk)
        text = chunk.decode("utf-8", errors="replace")
        return {"offset": offset, "text": text, "next": offset + len(chunk), "size": size}

    def gpu(self) -> dict[str, Any]:
        snapshot = gpu_snapshot().to_json()
        leases = []
        for device in snapshot["devices"]:
            holder = lease_holder(device["index"])
            held = None if holder is None else {"line": holder.line, "pid": holder.pid, "since": holder.since}
            leases.append(held)
        snapshot["leases"] = leases
        return snapshot

    def stop(self, at_cycle_end: int | None) -> dict[str, Any]:
        request = ops.request_stop(self.supervisor.layout.root, at_cycle_end)
        self.supervisor.request_stop(at_cycle_end)
        when = request.when()
        return {"stopping": True, "when": when, "requested": request.requested, "at_cycle_end": at_cycle_end}

    def branch(
        self, path: str, at_cycle: int | None, at_update: int | None, plan: str | None, data: str | None
    ) -> dict[str, Any]:
        raise LineError("branch through the supervisor is not built yet: `engine.ops` has no branch")

    def rollback(self, to: int) -> dict[str, Any]:
        raise LineError("rollback through the supervisor is not built yet: `engine.ops` has no rollback")

    def tune(self, shared: bool) -> dict[str, Any]:
        raise LineError("tune through the supervisor is not built yet: `engine.ops` has no tune")


def _whole_characters(chunk: bytes) -> bytes:
    """`chunk` without a UTF-8 character cut at its end (the next read starts with it whole)."""
    for back in range(1, min(4, len(chunk)) + 1):
        byte = chunk[-back]
        if byte < 0x80:
            return chunk
        if byte >= 0xC0:  # a lead byte: is its character complete?
            needed = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return chunk if back >= needed else chunk[:-back]
    return chunk
