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

Its parts: the socket itself (`engine/supervisor/server_socket.py`), the connections
(`server_connections.py`), the notifications (`server_subscriptions.py`) and the calls
(`server_calls.py`); this module holds the server's state and its life cycle.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import threading
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from engine.protocol import wire
from engine.supervisor.server_calls import Calls
from engine.supervisor.server_connections import READ_CHUNK, Connection, Connections
from engine.supervisor.server_socket import LISTEN_BACKLOG, bind_private_socket
from engine.supervisor.server_subscriptions import Subscriptions

SHUTDOWN_REPLY_GRACE_S = 2.0
"""At close, how long calls in flight get to send the replies they are about to send."""
MAX_CONNECTIONS = 64
"""Connections served at once; past this, a new one waits for a slot (see `ADMISSION_WAIT_S`)."""
IDLE_TIMEOUT_S = 300.0
"""A connection that sends nothing this long, with no call in flight and no subscription, is closed."""


class SupervisorServer(Subscriptions, Connections, Calls):
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
        self._connections: set[Connection] = set()
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
