"""The server's notifications: the ring of the last ones, the fan-out to subscribers, the replay.

A mixin of `engine.supervisor.server.SupervisorServer`, sharing its state: `publish` (from any
thread) numbers each notification (`_last_seq`, under `_ring_lock`) within this server's life
(`epoch`), keeps it in `_ring` and hands it to the loop (`_loop`), which pushes it to every
subscribed connection of `_connections`; a `subscribe` is answered from the ring
(`_subscribe_result`), which is replayed before the connection goes live (`_replay_then_go_live`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import TYPE_CHECKING, Any

from engine.protocol import wire
from engine.protocol.wire import ProtocolError

if TYPE_CHECKING:
    from engine.supervisor.server_connections import Connection

logger = logging.getLogger("nsconsole.server")

SUBSCRIBER_BUFFER_LIMIT = 4 * 1024 * 1024
"""A live subscriber that lets this much go unread is dropped (it reconnects and catches up from the ring)."""
REPLAY_CHUNK_BYTES = 256 * 1024
"""A replay of the ring sends this much at a time, and waits for the client to read it."""
REPLAY_STALL_S = 60.0
"""A replaying client that reads too little of a chunk for this long is dropped: a replay is not
idle, so a console that stopped reading mid-replay would otherwise hold its slot for good (64 such
lock every console out)."""


class Subscriptions:
    """The server's notifications (mixed into `SupervisorServer`: its ring, its loop, its connections)."""

    def publish(self, kind: str, data: dict[str, Any], index: int | None = None) -> int:
        """Push a notification to every subscriber and keep it in the ring; returns its seq. `index`:
        the row's in rows.jsonl, named in its place when it is too large for one line."""
        if kind not in wire.NOTIFICATION_KINDS:
            raise ValueError(f"unknown notification kind {kind!r}")
        with self._ring_lock:
            self._last_seq += 1
            seq = self._last_seq
            now = time.time()
            try:
                line = wire.encode(wire.make_notification(kind, seq, self.epoch, now, data))
            except ProtocolError:
                # Too large for one line: say so, so the subscriber can fetch it with a call.
                omitted = {"omitted": f"{kind} larger than {wire.MAX_LINE_BYTES} bytes",
                           **({} if index is None else {"index": index})}
                line = wire.encode(wire.make_notification(kind, seq, self.epoch, now, omitted))
            self._ring.append((seq, line))
        loop = self._loop
        if loop is not None and loop.is_running():
            loop.call_soon_threadsafe(self._fan_out, seq, line)
        return seq

    @property
    def last_seq(self) -> int:
        return self._last_seq

    def _fan_out(self, seq: int, line: bytes) -> None:
        for connection in list(self._connections):
            if connection.subscribed and seq > connection.last_sent_seq:
                self._push(connection, seq, line)

    def _push(self, connection: Connection, seq: int, line: bytes) -> None:
        """One live notification (a subscriber that stopped reading is dropped)."""
        connection.send(line)
        connection.last_sent_seq = seq
        transport = connection.writer.transport
        if transport.get_write_buffer_size() > SUBSCRIBER_BUFFER_LIMIT:
            logger.warning("dropping a subscriber that stopped reading")
            transport.abort()

    def _subscribe_result(self, since_seq: int | None) -> dict[str, Any]:
        """The reply to `subscribe`: the newest seq, this life's epoch, how many were missed."""
        with self._ring_lock:
            oldest = self._ring[0][0] if self._ring else self._last_seq + 1
            last = self._last_seq
            missed = 0 if since_seq is None else sum(1 for seq, _ in self._ring if seq > since_seq)
        gap = since_seq is not None and since_seq < last and oldest > since_seq + 1
        return {"seq": last, "epoch": self.epoch, "replayed": missed, "gap": gap, "oldest_seq": oldest}

    async def _replay_then_go_live(self, connection: Connection, after_seq: int) -> None:
        """Send the ring after `after_seq` (waiting for the client to read it), then fan out live.

        Whatever is published meanwhile lands in the ring and is sent by the next round; the
        switch to live happens with no await after the last check, so nothing is lost or repeated.
        The ring is taken a chunk at a time (`_ring_chunk`), never copied whole: a client that goes
        away mid-replay leaves its broken pipe's traceback in a reference cycle with this frame,
        freed only by a full garbage collection. With a copy of the ring in it, a thousand consoles
        attaching and leaving grew a supervisor by 60-90 MiB; with a chunk, by a few.
        """
        connection.last_sent_seq = after_seq
        while True:
            chunk = self._ring_chunk(connection.last_sent_seq)
            if not chunk:
                connection.subscribed = True
                return
            for seq, line in chunk:
                connection.send(line)
                connection.last_sent_seq = seq
            try:
                await asyncio.wait_for(connection.writer.drain(), timeout=REPLAY_STALL_S)
            except TimeoutError:
                logger.warning("dropping a subscriber that read nothing of its replay for %.0f s", REPLAY_STALL_S)
                connection.writer.transport.abort()
                return

    def _ring_chunk(self, after_seq: int) -> list[tuple[int, bytes]]:
        """The ring's notifications after `after_seq`, oldest first, about `REPLAY_CHUNK_BYTES` of them."""
        chunk: list[tuple[int, bytes]] = []
        size = 0
        with self._ring_lock:
            if not self._ring:
                return chunk
            # Seqs in the ring are consecutive (`publish` numbers and appends under the lock).
            start = max(0, after_seq + 1 - self._ring[0][0])
            for entry in itertools.islice(self._ring, start, None):
                chunk.append(entry)
                size += len(entry[1])
                if size >= REPLAY_CHUNK_BYTES:
                    break
        return chunk
