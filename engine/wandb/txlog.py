"""Reading the W&B client's local transaction log (`run-<id>.wandb`).

wandb 0.31 keeps no Python reader of this file (its core is a Go binary), so this is ours. The
format, checked against the files wandb 0.31 writes: a 7-byte header (`:W&B`, the magic
0xBEE1 little-endian, version 0), then LevelDB-style framing in 32 KiB blocks. Each chunk has a
7-byte header (CRC-32 of the type byte and the data, as `zlib.crc32`, not masked; data length,
2 bytes little-endian; type: 1 full, 2 first, 3 middle, 4 last) and a block tail shorter than a
header is zero padding. A whole record is one `wandb_internal_pb2.Record` protobuf.

The offline backend reads it to learn which steps are durably in the local log (the offline
equivalent of "the server acknowledged it"), and the tests read it to check what was mirrored.
The reader is incremental: it remembers where the last whole record ended, so a file that is
still being written is read a little at a time, and a torn tail is simply read again later.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from wandb.proto import wandb_internal_pb2

FILE_HEADER = b":W&B\xe1\xbe\x00"
BLOCK_SIZE = 32768
CHUNK_HEADER = struct.Struct("<IHB")  # crc32, data length, chunk type
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


class TransactionLogError(Exception):
    """The file is not a W&B transaction log, or a chunk's checksum does not match."""


@dataclass
class HistoryRow:
    """One `run.log` call as the log holds it: its step and its values (JSON-decoded)."""

    step: int
    values: dict[str, Any]


@dataclass
class TransactionLogReader:
    """Reads the records of one `.wandb` file, picking up where the previous call stopped."""

    path: Path
    offset: int = 0
    """Byte offset just after the last whole record read (0: the file header is still to check)."""

    def read_records(self) -> Iterator[wandb_internal_pb2.Record]:
        """Yield every whole record written since the previous call."""
        # Imported here: wandb takes seconds to import, and only a running mirror needs it.
        from wandb.proto import wandb_internal_pb2

        # Only what follows the last whole record is read: the log of a weeks-long run is large.
        with self.path.open("rb") as handle:
            handle.seek(self.offset)
            data = handle.read()
        base = self.offset  # the file offset of data[0]; block boundaries count from the file's start
        if self.offset == 0:
            if len(data) < len(FILE_HEADER):
                return
            if data[: len(FILE_HEADER)] != FILE_HEADER:
                raise TransactionLogError(f"{self.path}: not a W&B transaction log (bad header)")
            self.offset = len(FILE_HEADER)
        end = base + len(data)
        position = self.offset
        chunks: list[bytes] = []
        while True:
            room_in_block = BLOCK_SIZE - position % BLOCK_SIZE
            if room_in_block < CHUNK_HEADER.size:
                position += room_in_block  # zero padding at a block's end
                continue
            if position + CHUNK_HEADER.size > end:
                break
            checksum, length, chunk_type = CHUNK_HEADER.unpack_from(data, position - base)
            start = position + CHUNK_HEADER.size
            if chunk_type == 0 or start + length > end:
                break  # not written yet (or torn): read again next time
            chunk = data[start - base : start - base + length]
            if zlib.crc32(bytes([chunk_type]) + chunk) != checksum:
                raise TransactionLogError(f"{self.path}: checksum mismatch at byte {position}")
            position = start + length
            if chunk_type == FULL:
                chunks = [chunk]
            elif chunk_type == FIRST:
                chunks = [chunk]
                continue
            elif chunk_type == MIDDLE:
                chunks.append(chunk)
                continue
            elif chunk_type == LAST:
                chunks.append(chunk)
            else:
                raise TransactionLogError(f"{self.path}: unknown chunk type {chunk_type} at byte {position}")
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            chunks = []
            # Only a whole record moves the resume point: a record split over blocks whose
            # last chunk is not written yet is read again from its first chunk next time.
            self.offset = position
            yield record

    def read_history(self) -> Iterator[HistoryRow]:
        """Yield the history rows written since the previous call, in the order logged."""
        for record in self.read_records():
            if record.WhichOneof("record_type") != "history":
                continue
            values: dict[str, Any] = {}
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                values[key] = json.loads(item.value_json)
            yield HistoryRow(step=int(record.history.step.num), values=values)


def transaction_log_of(run_directory: Path) -> Path | None:
    """The `.wandb` file inside one of the client's run directories, if it was created."""
    logs = sorted(Path(run_directory).glob("run-*.wandb"))
    return logs[0] if logs else None
