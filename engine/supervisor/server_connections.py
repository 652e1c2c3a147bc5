"""The server's connections: each client's state, and its admission, peer check and reading.

`Connection` is one client. `Connections` is a mixin of `engine.supervisor.server.SupervisorServer`,
running on its loop: it admits a connection (its peer uid must be `expected_uid`; past
`max_connections` it waits for a slot, taking the longest-idle connection's: `_connections`,
`_slot_freed`), closes one idle `idle_timeout_s`, and reads each line it sends into `_handle_line`
(`engine/supervisor/server_calls.py`, which also gives `_reply`). Every connection's task is kept
in `_serving`, for the server's shutdown to end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from engine.protocol import wire
from engine.protocol.wire import ProtocolError
from engine.supervisor.server_socket import peer_uid

logger = logging.getLogger("nsconsole.server")

READ_CHUNK = 64 * 1024
EVICTABLE_AFTER_S = 1.0
"""At the cap, a connection quiet this long (no call in flight, not subscribed) gives its slot to a new one."""
ADMISSION_WAIT_S = 10.0
"""How long a new connection waits for a slot at the cap before it is refused as busy."""


class Connection:
    """One client: its writer, whether it said hello, what it was last pushed, its calls in flight."""

    def __init__(self, writer: asyncio.StreamWriter, now: float) -> None:
        self.writer = writer
        self.greeted = False
        self.subscribed = False
        self.replaying = False
        self.last_sent_seq = 0
        self.calls: set[asyncio.Task[None]] = set()
        self.quiet_since = now
        """Loop time of its last read or last answered call: how long it has been idle."""

    def is_idle(self) -> bool:
        """Nothing owed to it: no call in flight, not watching notifications (nor catching up on them)."""
        return not self.calls and not self.subscribed and not self.replaying

    def send(self, line: bytes) -> None:
        if not self.writer.is_closing():
            self.writer.write(line)


class Connections:
    """The server's connections (mixed into `SupervisorServer`, whose loop, limits and calls it uses)."""

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = Connection(writer, asyncio.get_running_loop().time())
        task = asyncio.current_task()
        assert task is not None
        self._serving.add(task)
        try:
            sock = writer.get_extra_info("socket")
            uid = peer_uid(sock)
            if uid != self.expected_uid:
                refusal = ProtocolError(
                    wire.PEER_REFUSED,
                    f"connection refused: peer uid {uid} is not the supervisor's uid {self.expected_uid}",
                )
                writer.write(wire.encode(wire.make_error(None, refusal)))
                await writer.drain()
                return
            if not await self._take_slot(connection):
                busy = ProtocolError(wire.REFUSED, f"too many busy connections (at most {self.max_connections})")
                writer.write(wire.encode(wire.make_error(None, busy)))
                await writer.drain()
                return
            await self._read_calls(reader, connection)
        except (ConnectionError, OSError):
            pass  # the client went away: nothing to answer
        except asyncio.CancelledError:
            # The shutdown cancels connections still open (a console attached as the line ends).
            # Ended by cancellation, the task would make asyncio's connection callback (Python
            # 3.11's StreamReaderProtocol) log a CancelledError traceback into supervisor.out.
            pass
        finally:
            # Its replies have nowhere to go; a mutation under way goes on (a retry gets its outcome).
            for call in connection.calls:
                call.cancel()
            self._connections.discard(connection)
            writer.close()
            if self._slot_freed is not None:
                async with self._slot_freed:
                    self._slot_freed.notify_all()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()
            self._serving.discard(task)

    async def _take_slot(self, connection: Connection) -> bool:
        """Admit a connection, at the cap once a slot frees; False when none did within the wait.

        A fresh client is never locked out by idle ones: at the cap the longest-quiet idle
        connection (quiet at least `EVICTABLE_AFTER_S`, so a client of a burst between its calls
        keeps its slot) is closed to make room. Watching consoles and calls in flight are never cut.
        """
        assert self._slot_freed is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ADMISSION_WAIT_S
        async with self._slot_freed:
            while len(self._connections) >= self.max_connections:
                now = loop.time()
                idle = [other for other in self._connections if other.is_idle()]
                quietest = min(idle, key=lambda other: other.quiet_since, default=None)
                if quietest is not None and now - quietest.quiet_since >= EVICTABLE_AFTER_S:
                    logger.info("closing a connection idle %.1f s to admit a new one", now - quietest.quiet_since)
                    self._connections.discard(quietest)
                    quietest.writer.close()
                    continue
                if now >= deadline:
                    return False
                wake = deadline if quietest is None else min(deadline, quietest.quiet_since + EVICTABLE_AFTER_S)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._slot_freed.wait(), timeout=wake - now)
            connection.quiet_since = loop.time()  # its wait is not idleness: it has yet to be read
            self._connections.add(connection)
        return True

    async def _read_calls(self, reader: asyncio.StreamReader, connection: Connection) -> None:
        buffer = bytearray()
        discarding = False  # inside a line past the cap: skip to its end, then answer once
        while not connection.writer.is_closing():
            chunk = await self._read_unless_idle(reader, connection)
            if not chunk:
                return
            connection.quiet_since = asyncio.get_running_loop().time()
            buffer += chunk
            while True:
                newline = buffer.find(b"\n")
                if newline < 0:
                    if len(buffer) >= wire.MAX_LINE_BYTES:
                        discarding = True
                        buffer.clear()
                    break
                line = bytes(buffer[:newline])
                del buffer[: newline + 1]
                if discarding:
                    discarding = False
                    too_long = ProtocolError(
                        wire.LINE_TOO_LONG, f"message longer than {wire.MAX_LINE_BYTES} bytes"
                    )
                    await self._reply(connection, wire.make_error(None, too_long))
                    continue
                if line.strip():
                    keep_open = await self._handle_line(connection, line)
                    if not keep_open:
                        return

    async def _read_unless_idle(self, reader: asyncio.StreamReader, connection: Connection) -> bytes:
        """The next bytes the client sent; b"" at its end or once it has been idle `idle_timeout_s`.

        Idle time counts from the last read or answered call, and only while the connection is
        idle: a console watching notifications or waiting on a long tune is never timed out.
        """
        loop = asyncio.get_running_loop()
        while True:
            idle = connection.is_idle()
            left = connection.quiet_since + self.idle_timeout_s - loop.time() if idle else self.idle_timeout_s
            if left <= 0:
                logger.info("closing a connection idle for %.1f s", self.idle_timeout_s)
                return b""
            try:
                # A cancelled read loses nothing: what arrived stays in the reader's buffer.
                return await asyncio.wait_for(reader.read(READ_CHUNK), timeout=left)
            except TimeoutError:
                continue
