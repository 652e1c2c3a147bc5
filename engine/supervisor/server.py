"""The supervisor's Unix-socket server: the protocol of `engine/protocol/wire.py`, served to local clients.

The socket is `<line>/supervisor.sock`, mode 0600 from the moment it has its name (bound under a
temporary name, chmod-ed, renamed into place), and every connection's peer uid (SO_PEERCRED) must
be the supervisor's own. The server runs its asyncio loop in a thread of its own, so the
supervisor's main loop stays plain synchronous code: `publish()` may be called from any thread.

Calls other than `hello` and `subscribe` go to a handler object: `handler.<method>(**params)`
runs in a worker thread (mutations one at a time, in arrival order) and returns a JSON-able
result; after each mutation, before its reply, `handler.requests_changed()` (when the handler has
one) keeps the request log where the next supervisor finds it. A connection's calls are answered as each is done, not in the order they came: a `status`
sent behind a rollback or a tune (which replies only once done, minutes later) is answered at
once, and the JSON-RPC id pairs each reply with its call. While mutations are taken and not yet
answered, the `status` reply carries them as `under_way`, oldest first (`[{"method", "since"}]`:
the line is pausing for a tune, a rollback waits for the trainer's checkpoint...). A `LineError` the handler
raises is the line refusing (`REFUSED`, its message sent as is), any other exception an internal
error (logged, answered, the server stays up). Nothing a client sends can crash the server or
reach the handler without passing `wire.parse_request`.

Under load: a connection idle `idle_timeout_s` (nothing read, no call in flight, not subscribed)
is closed; a subscribed one never is, as a console watching sends nothing for hours (one that stops
reading is dropped by its buffer limit instead). Past `max_connections` a new connection waits for
a slot, and takes the one of the longest-idle connection once that has been quiet a second, so a
fresh `hello` and `status` get through however many idle clients hold connections open.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import stat
import struct
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from datalines.errors import DataLineError
from engine.errors import LineError
from engine.protocol import wire
from engine.protocol.wire import ProtocolError

logger = logging.getLogger("nsconsole.server")

READ_CHUNK = 64 * 1024
SHUTDOWN_REPLY_GRACE_S = 2.0
"""At close, how long calls in flight get to send the replies they are about to send."""
MAX_CONNECTIONS = 64
"""Connections served at once; past this, a new one waits for a slot (see `ADMISSION_WAIT_S`)."""
IDLE_TIMEOUT_S = 300.0
"""A connection that sends nothing this long, with no call in flight and no subscription, is closed."""
EVICTABLE_AFTER_S = 1.0
"""At the cap, a connection quiet this long (no call in flight, not subscribed) gives its slot to a new one."""
ADMISSION_WAIT_S = 10.0
"""How long a new connection waits for a slot at the cap before it is refused as busy."""
LISTEN_BACKLOG = 1024
"""Connections the kernel queues before accepting: a burst past it is refused (EAGAIN) unseen by the server."""
SUBSCRIBER_BUFFER_LIMIT = 4 * 1024 * 1024
"""A live subscriber that lets this much go unread is dropped (it reconnects and catches up from the ring)."""
REPLAY_CHUNK_BYTES = 256 * 1024
"""A replay of the ring waits for the client to read past this much buffered."""
MAX_CALLS_IN_FLIGHT = 32
"""Calls of one connection answered at the same time; past this, its next lines wait to be read."""


def peer_uid(connection: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (SO_PEERCRED: pid, uid, gid)."""
    credentials = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", credentials)
    return uid


class _Connection:
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


class SupervisorServer:
    """Serves one line's supervisor socket; see the module docstring."""

    def __init__(
        self,
        socket_path: Path | str,
        handler: Any,
        identity: dict[str, Any] | None = None,
        ring_capacity: int = 8192,
        expected_uid: int | None = None,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.socket_path = Path(socket_path)
        self.idle_timeout_s = idle_timeout_s
        self.max_connections = max_connections
        self.handler = handler
        self.identity = dict(identity or {})
        self.epoch = uuid.uuid4().hex[:16]
        """Names this server's life: notification seqs restart from 1 in a new one."""
        self.expected_uid = os.getuid() if expected_uid is None else expected_uid
        # The handler may keep its own log (the supervisor persists it across restarts).
        self.request_log: wire.RequestLog = getattr(handler, "request_log", None) or wire.RequestLog()
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=ring_capacity)
        self._ring_lock = threading.Lock()
        self._last_seq = 0
        self._connections: set[_Connection] = set()
        self._serving: set[asyncio.Task[None]] = set()  # every connection's task, admitted or waiting for a slot
        self._slot_freed: asyncio.Condition | None = None  # made on the loop, in _listen
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._socket_inode: int | None = None
        self._readers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="rpc-read")
        # One worker: mutations are applied one at a time, in the order they arrived.
        self._mutator = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rpc-mutate")
        self._under_way: dict[int, dict[str, Any]] = {}  # mutations taken, not yet answered (loop thread only)
        self._mutation_numbers = itertools.count()

    # ---- life cycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Bind the socket and serve in a background thread; raise `LineError` if it cannot."""
        self._thread = threading.Thread(target=self._run_loop, name="supervisor-server", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            raise self._start_error

    def close(self) -> None:
        """Stop serving, drop every connection and remove the socket (if it is still ours)."""
        loop = self._loop
        if loop is not None and loop.is_running():
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(timeout=10)
            loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._readers.shutdown(wait=False, cancel_futures=True)
        self._mutator.shutdown(wait=False, cancel_futures=True)
        self._remove_socket()

    def __enter__(self) -> SupervisorServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _run_loop(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._listen())
        except BaseException as error:  # reported to start()'s caller
            self._start_error = error
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def _listen(self) -> None:
        listener = bind_private_socket(self.socket_path)
        self._socket_inode = os.stat(self.socket_path).st_ino
        self._slot_freed = asyncio.Condition()
        self._server = await asyncio.start_unix_server(
            self._serve, sock=listener, limit=READ_CHUNK, backlog=LISTEN_BACKLOG
        )

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        in_flight = [call for connection in self._connections for call in connection.calls if not call.done()]
        if in_flight:
            # Replies already decided (work refused as the supervisor ends) reach their clients before
            # the connections close; a call still waiting on work past the grace is dropped.
            await asyncio.wait(in_flight, timeout=SHUTDOWN_REPLY_GRACE_S)
        for connection in list(self._connections):
            connection.writer.close()
        self._connections.clear()
        # Connections still waiting for a slot (or closing) end here, on the running loop: left
        # pending when it stops, each would be finalized later, outside it, and its cleanup would
        # await a condition of a loop that is gone.
        serving = [task for task in self._serving if task is not asyncio.current_task()]
        for task in serving:
            task.cancel()
        if serving:
            await asyncio.wait(serving, timeout=SHUTDOWN_REPLY_GRACE_S)

    def _remove_socket(self) -> None:
        # A newer supervisor may have replaced the socket; only remove the one we bound.
        with contextlib.suppress(FileNotFoundError):
            if os.stat(self.socket_path).st_ino == self._socket_inode:
                self.socket_path.unlink()

    # ---- notifications ----------------------------------------------------------------------

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

    def _push(self, connection: _Connection, seq: int, line: bytes) -> None:
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

    async def _replay_then_go_live(self, connection: _Connection, after_seq: int) -> None:
        """Send the ring after `after_seq` (waiting for the client to read it), then fan out live.

        Whatever is published meanwhile lands in the ring and is sent by the next round; the
        switch to live happens with no await after the last check, so nothing is lost or repeated.
        """
        connection.last_sent_seq = after_seq
        while True:
            with self._ring_lock:
                pending = [(seq, line) for seq, line in self._ring if seq > connection.last_sent_seq]
            if not pending:
                connection.subscribed = True
                return
            for seq, line in pending:
                connection.send(line)
                connection.last_sent_seq = seq
                if connection.writer.transport.get_write_buffer_size() > REPLAY_CHUNK_BYTES:
                    await connection.writer.drain()
            await connection.writer.drain()

    # ---- connections ------------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = _Connection(writer, asyncio.get_running_loop().time())
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

    async def _take_slot(self, connection: _Connection) -> bool:
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

    async def _read_calls(self, reader: asyncio.StreamReader, connection: _Connection) -> None:
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

    async def _read_unless_idle(self, reader: asyncio.StreamReader, connection: _Connection) -> bytes:
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

    async def _reply(self, connection: _Connection, message: dict[str, Any]) -> None:
        try:
            line = wire.encode(message)
        except ProtocolError as error:
            line = wire.encode(wire.make_error(message.get("id"), error))
        except (TypeError, ValueError) as error:
            logger.error("unserialisable reply to call %r: %s", message.get("id"), error)
            internal = ProtocolError(wire.INTERNAL_ERROR, f"internal error: bad reply: {error}")
            line = wire.encode(wire.make_error(message.get("id"), internal))
        connection.send(line)
        await connection.writer.drain()

    async def _handle_line(self, connection: _Connection, line: bytes) -> bool:
        """Answer one line; False when the connection must close (a refused hello)."""
        try:
            request = wire.parse_request(line)
        except ProtocolError as error:
            await self._reply(connection, wire.make_error(wire.request_id_of(error), error))
            return True
        if request.method == "hello":
            try:
                wire.check_hello(request.params["protocol"])
            except ProtocolError as error:
                await self._reply(connection, wire.make_error(request.id, error))
                return False
            connection.greeted = True
            await self._reply(connection, wire.make_result(request.id, self._hello_result()))
            return True
        if not connection.greeted:
            refusal = ProtocolError(wire.HELLO_REQUIRED, "call hello {protocol} first")
            await self._reply(connection, wire.make_error(request.id, refusal))
            return True
        if request.method == "subscribe":
            since_seq = request.params["since_seq"]
            result = self._subscribe_result(since_seq)
            connection.replaying = True
            try:
                await self._reply(connection, wire.make_result(request.id, result))
                await self._replay_then_go_live(connection, result["seq"] if since_seq is None else since_seq)
            finally:
                connection.replaying = False
            return True
        if len(connection.calls) >= MAX_CALLS_IN_FLIGHT:
            await asyncio.wait(connection.calls, return_when=asyncio.FIRST_COMPLETED)
        call = asyncio.create_task(self._answer(connection, request))
        connection.calls.add(call)
        call.add_done_callback(connection.calls.discard)
        return True

    async def _answer(self, connection: _Connection, request: wire.Request) -> None:
        """One call's reply, sent whenever it is ready (the connection reads on meanwhile)."""
        try:
            result = await self._dispatch(request)
            reply = wire.make_result(request.id, result)
        except ProtocolError as error:
            reply = wire.make_error(request.id, error)
        connection.quiet_since = asyncio.get_running_loop().time()
        with contextlib.suppress(ConnectionError, OSError):
            await self._reply(connection, reply)

    def _hello_result(self) -> dict[str, Any]:
        return {
            **self.identity,
            "protocol": wire.PROTOCOL_VERSION,
            "epoch": self.epoch,
            "pid": os.getpid(),
            "methods": sorted(wire.METHODS),
        }

    async def _dispatch(self, request: wire.Request) -> Any:
        loop = asyncio.get_running_loop()
        if request.method in wire.MUTATIONS:
            # Taken, it is carried out even if its client goes away meanwhile (a retry gets its outcome).
            number = next(self._mutation_numbers)
            self._under_way[number] = {"method": request.method, "since": time.time()}
            applied = self._mutator.submit(self._request_log_run, request)
            applied.add_done_callback(lambda _: self._call_in_loop(self._under_way.pop, number, None))
            return await asyncio.shield(asyncio.wrap_future(applied))
        result = await loop.run_in_executor(self._readers, self._call_handler, request)
        if request.method == "status" and isinstance(result, dict) and self._under_way:
            result = {**result, "under_way": list(self._under_way.values())}
        return result

    def _call_in_loop(self, function: Callable[..., object], *args: object) -> None:
        """`function(*args)` on the server's loop, from any thread (nothing once the server has closed)."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # closed between the check and the call
                loop.call_soon_threadsafe(function, *args)

    def _request_log_run(self, request: wire.Request) -> Any:
        assert request.request_id is not None
        try:
            return self.request_log.run(
                request.request_id, request.method, request.params, lambda: self._call_handler(request)
            )
        finally:
            # Kept before the reply leaves: a client that retries after a supervisor's kill -9 must
            # find its request_id with the next supervisor, or the mutation is applied twice.
            persist = getattr(self.handler, "requests_changed", None)
            if persist is not None:
                try:
                    persist()
                except Exception:  # the mutation is done: its reply goes out even if the record failed
                    logger.exception("the request log of %s was not kept", request.request_id)

    def _call_handler(self, request: wire.Request) -> Any:
        method = getattr(self.handler, request.method, None)
        if method is None:
            raise ProtocolError(wire.METHOD_NOT_FOUND, f"this supervisor does not serve {request.method}")
        try:
            return method(**request.params)
        except ProtocolError:
            raise
        except (LineError, DataLineError) as error:
            raise ProtocolError(wire.REFUSED, str(error)) from None
        except Exception as error:
            logger.exception("%s failed", request.method)
            message = f"internal error in {request.method}: {type(error).__name__}: {error}"
            raise ProtocolError(wire.INTERNAL_ERROR, message[:1000]) from None


def bind_private_socket(socket_path: Path) -> socket.socket:
    """A listening Unix socket at `socket_path`, mode 0600 from the moment it has that name.

    An existing socket there is replaced only when nothing answers on it (a crashed supervisor's
    leftover); one that answers means another supervisor serves the line: `LineError`.
    """
    directory = socket_path.parent
    info = os.stat(directory)
    if info.st_uid != os.getuid():
        raise LineError(f"{directory}: owned by uid {info.st_uid}, not by this user; refusing to serve there")
    if socket_path.exists() or socket_path.is_symlink():
        if not stat.S_ISSOCK(os.lstat(socket_path).st_mode):
            raise LineError(f"{socket_path}: exists and is not a socket; remove it")
        if _answers(socket_path):
            raise LineError(f"{socket_path}: another supervisor is serving this line")
    temporary_name = f".{socket_path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    directory_fd = os.open(directory, os.O_PATH | os.O_DIRECTORY)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(f"/proc/self/fd/{directory_fd}/{temporary_name}")
        os.chmod(temporary_name, 0o600, dir_fd=directory_fd)
        os.rename(temporary_name, socket_path.name, src_dir_fd=directory_fd, dst_dir_fd=directory_fd)
        listener.listen(LISTEN_BACKLOG)
        listener.setblocking(False)
    except BaseException:
        listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary_name, dir_fd=directory_fd)
        raise
    finally:
        os.close(directory_fd)
    return listener


def _answers(socket_path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2)
    try:
        with wire.unix_address(socket_path) as address:
            probe.connect(address)
        return True
    except OSError:
        return False
    finally:
        probe.close()
