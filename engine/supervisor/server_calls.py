"""The server's calls: each line a client sends, parsed and answered.

A mixin of `engine.supervisor.server.SupervisorServer`, sharing its state: `hello` is answered
with its `identity` and `epoch`, `subscribe` by `Subscriptions` (`_subscribe_result`,
`_replay_then_go_live`), every other call by its `handler`, in a worker thread: a read in one of
`_readers`, a mutation in `_mutator` (one at a time, in arrival order) through its `request_log`,
listed meanwhile in `_under_way` (numbered by `_mutation_numbers`). Replies go out as each is
ready, on the server's loop (`_loop`); a connection's calls in flight are its `calls`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from datalines.errors import DataLineError
from engine.errors import LineError
from engine.protocol import wire
from engine.protocol.wire import ProtocolError

if TYPE_CHECKING:
    from engine.supervisor.server_connections import Connection

logger = logging.getLogger("nsconsole.server")

MAX_CALLS_IN_FLIGHT = 32
"""Calls of one connection answered at the same time; past this, its next lines wait to be read."""


class Calls:
    """The server's calls (mixed into `SupervisorServer`, whose handler, workers and loop it uses)."""

    async def _reply(self, connection: Connection, message: dict[str, Any]) -> None:
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

    async def _handle_line(self, connection: Connection, line: bytes) -> bool:
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

    async def _answer(self, connection: Connection, request: wire.Request) -> None:
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
