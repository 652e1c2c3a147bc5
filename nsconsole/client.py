"""Clients of a line's supervisor socket (protocol: `engine/protocol/wire.py`).

- `SupervisorClient`: synchronous, for the command line (`status`, `stop`, ...): connect, hello,
  call; `mutate` keeps one `request_id` across reconnects, so a retry after a lost reply is
  applied once.
- `AsyncSupervisorClient`: asyncio, one connection; replies are matched to calls by id and
  notifications go to a queue.
- `SupervisorLink`: what the console holds per line: reconnects with backoff whenever the
  supervisor goes away, re-subscribes from the last seq it saw (from 0 when the supervisor was
  restarted: a new epoch) and tells its owner when it is connected, so the owner refetches state.

Failures are `LineError`s (the command line prints them as one line): `SupervisorUnavailable`
when nothing answers, `RemoteError` when the supervisor answers with a JSON-RPC error.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import LineError
from engine.protocol import wire


class SupervisorUnavailable(LineError):
    """No supervisor answers on the socket (not running, restarting, or the socket is gone)."""


class RemoteError(LineError):
    """The supervisor answered a call with a JSON-RPC error."""

    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.data = data


@dataclass(frozen=True)
class Notification:
    """One pushed notification: its kind (heartbeat, row, validation, event) and payload."""

    kind: str
    """One of `wire.NOTIFICATION_KINDS`."""
    seq: int
    """Counts up from 1 within one supervisor's life."""
    epoch: str
    """The supervisor life that numbered it."""
    time: float
    """When the supervisor published it (Unix time)."""
    data: dict[str, Any]
    """The payload (a row, a heartbeat, an event...)."""


def _notification(message: dict[str, Any]) -> Notification:
    params = message.get("params") or {}
    return Notification(
        kind=str(message["method"]),
        seq=int(params.get("seq", 0)),
        epoch=str(params.get("epoch", "")),
        time=float(params.get("time", 0.0)),
        data=params.get("data") or {},
    )


def _decode(line: bytes, socket_path: Path) -> dict[str, Any]:
    try:
        message = json.loads(line)
    except ValueError:
        raise SupervisorUnavailable(f"{socket_path}: the supervisor sent a line that is not JSON") from None
    if not isinstance(message, dict):
        raise SupervisorUnavailable(f"{socket_path}: the supervisor sent a message that is not an object")
    return message


def _result(message: dict[str, Any]) -> Any:
    if "error" in message:
        error = message["error"] or {}
        raise RemoteError(int(error.get("code", 0)), str(error.get("message", "")), error.get("data"))
    return message.get("result")


def hello_refusal(socket_path: Path, error: RemoteError) -> RemoteError:
    """A refused hello as the user reads it. A protocol mismatch names the line, both versions, which
    side is older and how to go on: the supervisor's own words ("restart it with the same nsconsole
    version") say neither how to stop a line whose socket this nsconsole cannot use nor with what."""
    server = error.data.get("server_protocol") if isinstance(error.data, dict) else None
    if error.code != wire.PROTOCOL_MISMATCH or not isinstance(server, int):
        return error
    line = socket_path.parent
    versions = f"{line}: its supervisor speaks protocol {server} and this nsconsole {wire.PROTOCOL_VERSION}"
    if server < wire.PROTOCOL_VERSION:
        advice = (f"an older nsconsole started it (before an upgrade); `nsconsole stop {line}` stops it with a "
                  f"checkpoint (through the line's STOP file: no socket needed), then `nsconsole run {line}` "
                  "runs the line on this one")  # fmt: skip
    else:
        advice = "a newer nsconsole started it: watch and steer it with that one (upgrade this one to it)"
    return RemoteError(error.code, f"{versions}: {advice}", error.data)


def missing_methods(hello: dict[str, Any]) -> list[str]:
    """The methods of this nsconsole's protocol that a supervisor's hello does not name, sorted: an
    older nsconsole, of the same protocol version with fewer methods, started it. Empty for the same
    or a newer one, and for a hello that names none."""
    methods = hello.get("methods")
    if not isinstance(methods, list):
        return []
    return sorted(set(wire.METHODS) - set(methods))


def older_supervisor_words(line: str | Path, pid: object, missing: list[str]) -> str:
    """What to know of a supervisor an older nsconsole started (`missing_methods` not empty): it runs
    that nsconsole's code, and whatever it imports from now on comes from this one, installed since
    (a mix that can fail); a stop and a resume run the line on this nsconsole."""
    return (f"its supervisor (pid {pid}) was started by an older nsconsole (its protocol lacks "
            f"{', '.join(missing)}) and runs it still, beside this one's code installed since: stop the line "
            f"(s, or `nsconsole stop {line}`) and resume it (R, or `nsconsole run {line}`) to run it on this nsconsole")


def new_request_id() -> str:
    """A request_id for a mutation: unique, and kept by the caller across its retries."""
    return uuid.uuid4().hex


class SupervisorClient:
    """A synchronous connection to one supervisor; see the module docstring."""

    def __init__(
        self, socket_path: Path | str, timeout: float = 30.0, client_name: str = "nsconsole"
    ) -> None:
        self.socket_path = Path(socket_path)
        self.timeout = timeout
        self.client_name = client_name
        self.server: dict[str, Any] = {}
        """The supervisor's hello reply (protocol, epoch, pid, line...)."""
        self._socket: socket.socket | None = None
        self._buffer = bytearray()
        self._ids = itertools.count(1)
        self._notifications: deque[Notification] = deque()

    def __enter__(self) -> SupervisorClient:
        self.connect()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def connect(self) -> dict[str, Any]:
        """Connect and say hello; returns the supervisor's hello reply."""
        self.close()
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.settimeout(self.timeout)
        try:
            with wire.unix_address(self.socket_path) as address:
                connection.connect(address)
        except OSError as error:
            connection.close()
            reason = error.strerror or type(error).__name__
            raise SupervisorUnavailable(f"{self.socket_path}: no supervisor answers ({reason})") from None
        self._socket = connection
        self._buffer.clear()
        try:
            self.server = self.call("hello", protocol=wire.PROTOCOL_VERSION, client=self.client_name)
        except RemoteError as error:
            self.close()
            raise hello_refusal(self.socket_path, error) from None
        return self.server

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    def call(self, method: str, **params: Any) -> Any:
        """One call and its result; `RemoteError` for an error reply. Mutations need `request_id`."""
        if self._socket is None:
            raise SupervisorUnavailable(f"{self.socket_path}: not connected")
        call_id = next(self._ids)
        try:
            # Closed on us (a refused connection): its last word is still there to read.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                self._socket.sendall(wire.encode(wire.make_request(call_id, method, params)))
            while True:
                message = self._read_message()
                if "id" not in message and "method" in message:
                    self._notifications.append(_notification(message))
                    continue
                if message.get("id") in (call_id, None):
                    return _result(message)
        except (OSError, ConnectionError) as error:
            self.close()
            raise SupervisorUnavailable(f"{self.socket_path}: connection lost ({error})") from None

    def mutate(self, method: str, attempts: int = 5, **params: Any) -> Any:
        """A mutation, retried over reconnects with the same request_id (applied at most once)."""
        params.setdefault("request_id", new_request_id())
        delay = 0.2
        for attempt in range(attempts):
            try:
                if self._socket is None:
                    self.connect()
                return self.call(method, **params)
            except SupervisorUnavailable:
                if attempt == attempts - 1:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
        raise AssertionError("unreachable")

    def subscribe(self, since_seq: int | None = None) -> dict[str, Any]:
        """Start receiving notifications (after `since_seq`, or only new ones when None)."""
        return self.call("subscribe", since_seq=since_seq)

    def next_notification(self, timeout: float | None = None) -> Notification | None:
        """The next pushed notification, or None when none came within `timeout` seconds."""
        if self._notifications:
            return self._notifications.popleft()
        if self._socket is None:
            raise SupervisorUnavailable(f"{self.socket_path}: not connected")
        self._socket.settimeout(timeout)
        try:
            while True:
                message = self._read_message()
                if "id" not in message and "method" in message:
                    return _notification(message)
        except TimeoutError:
            return None
        except (OSError, ConnectionError) as error:
            self.close()
            raise SupervisorUnavailable(f"{self.socket_path}: connection lost ({error})") from None
        finally:
            if self._socket is not None:
                self._socket.settimeout(self.timeout)

    def _read_message(self) -> dict[str, Any]:
        assert self._socket is not None
        while True:
            newline = self._buffer.find(b"\n")
            if newline >= 0:
                line = bytes(self._buffer[:newline])
                del self._buffer[: newline + 1]
                return _decode(line, self.socket_path)
            if len(self._buffer) > wire.MAX_LINE_BYTES:
                raise SupervisorUnavailable(f"{self.socket_path}: the supervisor sent a line past the cap")
            chunk = self._socket.recv(65536)
            if not chunk:
                raise ConnectionError("the supervisor closed the connection")
            self._buffer += chunk


class AsyncSupervisorClient:
    """One asyncio connection to a supervisor; see the module docstring."""

    def __init__(
        self, socket_path: Path | str, timeout: float = 30.0, client_name: str = "nsconsole"
    ) -> None:
        self.socket_path = Path(socket_path)
        self.timeout = timeout
        self.client_name = client_name
        self.server: dict[str, Any] = {}
        self.notifications: asyncio.Queue[Notification | None] = asyncio.Queue()
        """The supervisor's notifications in arrival order, then None once the connection ends."""
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._ids = itertools.count(1)
        self._pump: asyncio.Task[None] | None = None
        self.closed = asyncio.Event()
        """Set when the connection ends (either side)."""

    async def connect(self) -> dict[str, Any]:
        try:
            with wire.unix_address(self.socket_path) as address:
                self._reader, self._writer = await asyncio.wait_for(
                    asyncio.open_unix_connection(address, limit=wire.MAX_LINE_BYTES + 1), self.timeout
                )
        except (OSError, asyncio.TimeoutError) as error:
            reason = getattr(error, "strerror", None) or type(error).__name__
            raise SupervisorUnavailable(f"{self.socket_path}: no supervisor answers ({reason})") from None
        self.closed.clear()
        self._pump = asyncio.create_task(self._read_loop())
        try:
            self.server = await self.call("hello", protocol=wire.PROTOCOL_VERSION, client=self.client_name)
        except RemoteError as error:
            raise hello_refusal(self.socket_path, error) from None
        return self.server

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(OSError, ConnectionError):
                await self._writer.wait_closed()
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump
        self._fail_pending()

    async def call(self, method: str, reply_timeout: float | None = None, **params: Any) -> Any:
        """The result of `method`; SupervisorUnavailable when the connection fails or no reply comes
        within `reply_timeout` seconds (default: the client's timeout)."""
        if self._writer is None or self.closed.is_set():
            raise SupervisorUnavailable(f"{self.socket_path}: not connected")
        call_id = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        try:
            self._writer.write(wire.encode(wire.make_request(call_id, method, params)))
            await self._writer.drain()
            return await asyncio.wait_for(future, self.timeout if reply_timeout is None else reply_timeout)
        except (OSError, ConnectionError, asyncio.TimeoutError) as error:
            raise SupervisorUnavailable(f"{self.socket_path}: {method} got no reply ({error!r})") from None
        finally:
            self._pending.pop(call_id, None)

    async def _read_loop(self) -> None:
        assert self._reader is not None
        try:
            while True:
                line = await self._reader.readline()
                if not line:
                    return
                message = _decode(line, self.socket_path)
                if "id" not in message and "method" in message:
                    self.notifications.put_nowait(_notification(message))
                    continue
                future = self._pending.get(message.get("id"))  # type: ignore[arg-type]
                if future is None and message.get("id") is None and len(self._pending) == 1:
                    # An error the server could not tie to a call (e.g. a refused connection).
                    future = next(iter(self._pending.values()))
                if future is not None and not future.done():
                    try:
                        future.set_result(_result(message))
                    except RemoteError as error:
                        future.set_exception(error)
        except (OSError, ConnectionError, ValueError, SupervisorUnavailable):
            return
        finally:
            self.closed.set()
            self.notifications.put_nowait(None)
            self._fail_pending()

    def _fail_pending(self) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(SupervisorUnavailable(f"{self.socket_path}: connection lost"))
        self._pending.clear()


class SupervisorLink:
    """A console's lasting attachment to one supervisor: reconnect, re-subscribe, report.

    `on_connected(client)` runs after every (re)connection and subscription (refetch state there);
    `on_notification(notification)` for every notification, in seq order, without duplicates;
    `on_disconnected(reason)` when the connection is lost (dim the screen, disable mutations).
    """

    def __init__(
        self,
        socket_path: Path | str,
        on_connected: Callable[[AsyncSupervisorClient], Awaitable[None]],
        on_notification: Callable[[Notification], Awaitable[None]],
        on_disconnected: Callable[[str], Awaitable[None]],
        initial_backoff: float = 0.2,
        max_backoff: float = 5.0,
        call_timeout: float = 30.0,
    ) -> None:
        self.socket_path = Path(socket_path)
        self.call_timeout = call_timeout
        """How long a call waits for its reply unless it says otherwise (a mutation does)."""
        self.on_connected = on_connected
        self.on_notification = on_notification
        self.on_disconnected = on_disconnected
        self.initial_backoff = initial_backoff
        self.max_backoff = max_backoff
        self.client: AsyncSupervisorClient | None = None
        self.epoch: str | None = None
        self.last_seq = 0

    async def run(self) -> None:
        """Stay attached until cancelled."""
        backoff = self.initial_backoff
        while True:
            client = AsyncSupervisorClient(self.socket_path, timeout=self.call_timeout)
            try:
                hello = await client.connect()
                if hello.get("epoch") != self.epoch:
                    # A restarted supervisor numbers from 1 again: take all it still keeps.
                    self.epoch, self.last_seq = hello.get("epoch"), 0
                await client.call("subscribe", since_seq=self.last_seq)
                self.client = client
                backoff = self.initial_backoff
                await self.on_connected(client)
                await self._pump(client)
                reason = "the supervisor closed the connection"
            except (SupervisorUnavailable, RemoteError) as error:
                reason = str(error)
            finally:
                self.client = None
                await client.close()
            await self.on_disconnected(reason)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.max_backoff)

    async def _pump(self, client: AsyncSupervisorClient) -> None:
        # One awaited get a notification, nothing else created: a console watching eight lines
        # spends its idle CPU here (issue 20's budget). The None after the last ends the pump.
        while (notification := await client.notifications.get()) is not None:
            await self._deliver(notification)

    async def _deliver(self, notification: Notification) -> None:
        if notification.epoch == self.epoch and notification.seq <= self.last_seq:
            return
        self.last_seq = notification.seq
        await self.on_notification(notification)
