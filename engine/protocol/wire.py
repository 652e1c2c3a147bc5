"""The supervisor protocol: newline-delimited JSON-RPC 2.0 over a line's `supervisor.sock`.

One message per line, UTF-8 JSON, at most `MAX_LINE_BYTES` including the newline. A client's
first call is `hello {protocol}`; every call carries an `id` (this protocol takes no client
notifications and no batches: either gets an Invalid Request error, so nothing is ever dropped
silently). Calls that change the line (`MUTATIONS`) also carry a `request_id` the client keeps
across retries, so a retry after a lost reply is answered from `RequestLog` and applied once.

After `subscribe {since_seq}` the server pushes notifications `{"method": <kind>, "params":
{"seq", "epoch", "time", "data"}}`; `seq` counts up from 1 within one supervisor's life, which
`epoch` names, so a client reconnecting to a restarted supervisor knows its `since_seq` is moot.

This module holds the wire format only (shapes, validation, error codes, framing, the
de-duplication log); `engine/supervisor/server.py` serves it and `nsconsole/client.py` speaks it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROTOCOL_VERSION = 1
MAX_LINE_BYTES = 64 * 1024
JSONRPC = "2.0"

# Standard JSON-RPC 2.0 codes.
PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
# This protocol's own codes (the range JSON-RPC leaves to applications).
HELLO_REQUIRED = -32001
PROTOCOL_MISMATCH = -32002
LINE_TOO_LONG = -32003
REPLY_TOO_LARGE = -32004
PEER_REFUSED = -32005
REFUSED = -32010
"""The line refused the call (a `LineError`: the message says why, e.g. a branch target exists)."""
REQUEST_ID_REUSED = -32011

NOTIFICATION_KINDS = ("heartbeat", "row", "validation", "event")
"""What a subscriber is pushed: the trainer's heartbeat, a logged row, a validation, a line event."""

MAX_LOG_CHUNK = 16 * 1024
"""Largest `log` read in bytes: printable text escapes to little more, so the reply fits a line."""

MAX_ROWS_PER_CALL = 4096

MAX_SERIES_STRIDE = 1 << 30
"""Largest `series` bucket in rows."""

MAX_ROW_CHUNK = 24 * 1024
"""Largest `row` read in bytes: rows.jsonl is ASCII JSON, whose quotes and backslashes at most
double when sent as a string, so the reply fits a line."""


class ProtocolError(Exception):
    """A call that gets a JSON-RPC error reply instead of a result."""

    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data

    def to_error(self) -> dict[str, Any]:
        error: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.data is not None:
            error["data"] = self.data
        return error


@dataclass(frozen=True)
class Param:
    """One named parameter of a method."""

    types: tuple[type, ...]
    """Accepted JSON types (`bool` is never taken for `int`)."""
    required: bool = False
    """Whether the call must name it."""
    default: Any = None
    """Its value when left out."""
    check: Callable[[Any], str | None] | None = None
    """Returns what is wrong with an accepted-type value, or None when it is fine."""


def _non_negative(value: Any) -> str | None:
    return "must be >= 0" if value is not None and value < 0 else None


def _log_length(value: Any) -> str | None:
    if not 0 < value <= MAX_LOG_CHUNK:
        return f"must be in (0, {MAX_LOG_CHUNK}]"
    return None


def _rows_limit(value: Any) -> str | None:
    if not 0 < value <= MAX_ROWS_PER_CALL:
        return f"must be in (0, {MAX_ROWS_PER_CALL}]"
    return None


def _row_chunk(value: Any) -> str | None:
    if not 0 < value <= MAX_ROW_CHUNK:
        return f"must be in (0, {MAX_ROW_CHUNK}]"
    return None


def _stride(value: Any) -> str | None:
    return f"must be in [1, {MAX_SERIES_STRIDE}]" if not 0 < value <= MAX_SERIES_STRIDE else None


def _request_id(value: Any) -> str | None:
    return "must be 1 to 128 characters" if not 0 < len(value) <= 128 else None


def _non_empty(value: Any) -> str | None:
    return "must not be empty" if value is not None and not value else None


_INT = (int,)
_OPTIONAL_INT = (int, type(None))
_STR = (str,)
_OPTIONAL_STR = (str, type(None))

METHODS: dict[str, dict[str, Param]] = {
    "hello": {"protocol": Param(_INT, required=True), "client": Param(_OPTIONAL_STR)},
    "status": {},
    "rows": {
        "since": Param(_INT, default=0, check=_non_negative),
        "limit": Param(_INT, default=1000, check=_rows_limit),
    },
    "history": {"since": Param(_INT, default=0, check=_non_negative)},
    "series": {
        "name": Param(_STR, required=True, check=_non_empty),
        "since": Param(_INT, default=0, check=_non_negative),
        "stride": Param(_INT, default=1, check=_stride),
    },
    "row": {
        "index": Param(_INT, required=True, check=_non_negative),
        "offset": Param(_INT, default=0, check=_non_negative),
        "length": Param(_INT, default=MAX_ROW_CHUNK, check=_row_chunk),
    },
    "log": {
        "offset": Param(_INT, default=0, check=_non_negative),
        "length": Param(_INT, default=MAX_LOG_CHUNK, check=_log_length),
    },
    "gpu": {},
    "subscribe": {"since_seq": Param(_OPTIONAL_INT, check=_non_negative)},
    "stop": {"at_cycle_end": Param(_OPTIONAL_INT, check=_non_negative)},
    "branch": {
        "path": Param(_STR, required=True, check=_non_empty),
        "at_cycle": Param(_OPTIONAL_INT, check=_non_negative),
        "at_update": Param(_OPTIONAL_INT, check=_non_negative),
        "plan": Param(_OPTIONAL_STR, check=_non_empty),
        "data": Param(_OPTIONAL_STR, check=_non_empty),
        "long_seq_len": Param(_OPTIONAL_INT, check=_non_negative),
    },
    "rollback": {"to": Param(_INT, required=True, check=_non_negative)},
    "tune": {"shared": Param((bool,), default=False)},
}
"""Every method and its parameters. `hello` and `subscribe` are the server's own; the others
go to the line's handler (`engine/supervisor/server.py`)."""

MUTATIONS = frozenset({"stop", "branch", "rollback", "tune"})
"""Methods that change the line: they need a `request_id` and are applied at most once per id."""


@dataclass(frozen=True)
class Request:
    """A well-formed call."""

    id: int | str
    method: str
    params: dict[str, Any]
    """Validated, with defaults filled in; a mutation's `request_id` is taken out of it."""
    request_id: str | None = None
    """The client's retry-stable id of a mutation; None for the other methods."""


def parse_request(line: bytes) -> Request:
    """Decode and validate one received line (without its newline) or raise `ProtocolError`.

    The error carries the call's id where one could be read (`ProtocolError.data` is not used for
    it: see `request_id_of`), so the reply can name the call it answers.
    """
    if len(line) + 1 > MAX_LINE_BYTES:
        raise ProtocolError(LINE_TOO_LONG, f"message longer than {MAX_LINE_BYTES} bytes")
    try:
        message = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        raise ProtocolError(PARSE_ERROR, "message is not UTF-8") from None
    except (json.JSONDecodeError, RecursionError) as error:
        raise ProtocolError(PARSE_ERROR, f"message is not JSON: {error}") from None
    except ValueError:
        # Python refuses to read an integer this long (a CPU-time guard), so it cannot be a call's.
        limit = sys.get_int_max_str_digits()
        raise ProtocolError(PARSE_ERROR, f"message has an integer longer than {limit} digits") from None
    if isinstance(message, list):
        raise ProtocolError(INVALID_REQUEST, "batches are not supported: send one call per line")
    if not isinstance(message, dict):
        raise ProtocolError(INVALID_REQUEST, "a call must be a JSON object")
    if message.get("jsonrpc") != JSONRPC:
        raise ProtocolError(INVALID_REQUEST, 'a call needs "jsonrpc": "2.0"')
    if "id" not in message:
        raise ProtocolError(INVALID_REQUEST, "every call needs an id (this server takes no notifications)")
    call_id = message["id"]
    if isinstance(call_id, bool) or not isinstance(call_id, (int, str)):
        raise ProtocolError(INVALID_REQUEST, "id must be a string or an integer")
    method = message.get("method")
    if not isinstance(method, str):
        raise ProtocolError(INVALID_REQUEST, "method must be a string", data={"id": call_id})
    if method not in METHODS:
        raise ProtocolError(METHOD_NOT_FOUND, f"unknown method {method[:64]!r}", data={"id": call_id})
    raw_params = message.get("params", {})
    if not isinstance(raw_params, dict):
        raise ProtocolError(INVALID_PARAMS, "params must be an object", data={"id": call_id})
    request_id = None
    if method in MUTATIONS:
        request_id = raw_params.get("request_id")
        if not isinstance(request_id, str) or _request_id(request_id):
            raise ProtocolError(
                INVALID_PARAMS, f"{method}: request_id must be a string of 1 to 128 characters",
                data={"id": call_id},
            )
        raw_params = {key: value for key, value in raw_params.items() if key != "request_id"}
    try:
        params = validate_params(method, raw_params)
    except ProtocolError as error:
        raise ProtocolError(error.code, error.message, data={"id": call_id}) from None
    return Request(id=call_id, method=method, params=params, request_id=request_id)


def validate_params(method: str, params: dict[str, Any]) -> dict[str, Any]:
    """Check `params` against `METHODS[method]`; return them with defaults filled in."""
    spec = METHODS[method]
    unknown = sorted(set(params) - set(spec))
    if unknown:
        raise ProtocolError(INVALID_PARAMS, f"{method}: unknown parameter {unknown[0][:64]!r}")
    validated: dict[str, Any] = {}
    for name, param in spec.items():
        if name not in params:
            if param.required:
                raise ProtocolError(INVALID_PARAMS, f"{method}: missing parameter {name!r}")
            validated[name] = param.default
            continue
        value = params[name]
        type_ok = isinstance(value, param.types) and not (isinstance(value, bool) and bool not in param.types)
        if not type_ok:
            expected = " or ".join("null" if t is type(None) else t.__name__ for t in param.types)
            raise ProtocolError(
                INVALID_PARAMS, f"{method}: {name} must be {expected}, got {type(value).__name__}"
            )
        problem = param.check(value) if param.check is not None else None
        if problem:
            raise ProtocolError(INVALID_PARAMS, f"{method}: {name} {problem}, got {value!r}"[:200])
        validated[name] = value
    return validated


def request_id_of(error: ProtocolError) -> int | str | None:
    """The id of the call an error answers (None when the call's id could not be read)."""
    data = error.data
    return data.get("id") if isinstance(data, dict) else None


def encode(message: dict[str, Any]) -> bytes:
    """One message as a line; raises `ProtocolError(REPLY_TOO_LARGE)` past the line cap.

    Non-finite floats (a NaN loss in a row) are not JSON: they are sent as null.
    """
    try:
        text = json.dumps(message, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except ValueError:
        text = json.dumps(_finite(message), separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    # A lone surrogate (a path's non-UTF-8 byte, as os.fsdecode gives it) can only sit in a string:
    # written as its JSON escape (\udcff), it reads back as the same str instead of failing the reply.
    line = text.encode("utf-8", "backslashreplace") + b"\n"
    if len(line) > MAX_LINE_BYTES:
        raise ProtocolError(REPLY_TOO_LARGE, f"message would exceed {MAX_LINE_BYTES} bytes; ask for less")
    return line


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def make_request(call_id: int | str, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"jsonrpc": JSONRPC, "id": call_id, "method": method, "params": params or {}}


def make_result(call_id: int | str | None, result: Any) -> dict[str, Any]:
    return {"jsonrpc": JSONRPC, "id": call_id, "result": result}


def make_error(call_id: int | str | None, error: ProtocolError) -> dict[str, Any]:
    payload = error.to_error()
    # The call's id travels in `id`, not in `data`.
    if isinstance(payload.get("data"), dict) and set(payload["data"]) == {"id"}:
        del payload["data"]
    return {"jsonrpc": JSONRPC, "id": call_id, "error": payload}


def make_notification(kind: str, seq: int, epoch: str, time: float, data: dict[str, Any]) -> dict[str, Any]:
    params = {"seq": seq, "epoch": epoch, "time": time, "data": data}
    return {"jsonrpc": JSONRPC, "method": kind, "params": params}


UNIX_PATH_MAX = 107
"""Longest socket path `bind`/`connect` take (108 bytes with the terminating NUL on Linux)."""


@contextmanager
def unix_address(socket_path: Path | str) -> Iterator[str]:
    """An address for `socket_path` that fits AF_UNIX's 108 bytes however deep the line is.

    A longer path is reached through an open descriptor of its directory
    (`/proc/self/fd/<fd>/supervisor.sock`), valid while the context is open.
    """
    path = Path(socket_path)
    if len(os.fsencode(path)) <= UNIX_PATH_MAX:
        yield str(path)
        return
    directory = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{directory}/{path.name}"
    finally:
        os.close(directory)


def check_hello(client_protocol: int) -> None:
    """Refuse a client that speaks another protocol version, saying which side to upgrade."""
    if client_protocol != PROTOCOL_VERSION:
        newer = "the supervisor" if client_protocol > PROTOCOL_VERSION else "this client"
        raise ProtocolError(
            PROTOCOL_MISMATCH,
            f"protocol mismatch: client speaks {client_protocol}, supervisor speaks {PROTOCOL_VERSION}; "
            f"{newer} is older: restart it with the same nsconsole version",
            data={"server_protocol": PROTOCOL_VERSION},
        )


def params_digest(method: str, params: dict[str, Any]) -> str:
    """A stable fingerprint of a mutation, so a reused request_id with other params is caught."""
    canonical = json.dumps([method, params], sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(canonical.encode(), digest_size=16).hexdigest()


@dataclass
class _Entry:
    digest: str
    outcome: Future = field(default_factory=Future)


class RequestLog:
    """Mutations by request_id: the first call runs, a retry gets the first call's outcome.

    Thread-safe; a retry arriving while the first call still runs waits for it. Bounded (the
    oldest completed entries are forgotten past `capacity`); `export`/`restore` carry the
    completed entries across a supervisor restart (the supervisor keeps them in supervisor.json).
    """

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._lock = threading.Lock()

    def run(self, request_id: str, method: str, params: dict[str, Any], apply: Callable[[], Any]) -> Any:
        """Return `apply()`'s result (or raise its `ProtocolError`), applying it once per id."""
        digest = params_digest(method, params)
        with self._lock:
            entry = self._entries.get(request_id)
            first = entry is None
            if first:
                entry = _Entry(digest)
                self._entries[request_id] = entry
                self._forget_oldest()
        assert entry is not None
        if entry.digest != digest:
            raise ProtocolError(
                REQUEST_ID_REUSED, f"request_id {request_id!r} was already used for another call"
            )
        if first:
            try:
                entry.outcome.set_result(apply())
            except ProtocolError as error:
                entry.outcome.set_exception(error)
            except BaseException as error:
                # An internal failure is not an answer worth replaying: forget it so a retry runs.
                with self._lock:
                    self._entries.pop(request_id, None)
                entry.outcome.set_exception(error)
                raise
        return entry.outcome.result()

    def _forget_oldest(self) -> None:
        while len(self._entries) > self.capacity:
            oldest_id, oldest = next(iter(self._entries.items()))
            if not oldest.outcome.done():
                break
            del self._entries[oldest_id]

    def export(self) -> list[dict[str, Any]]:
        """The completed entries as JSON: [{request_id, digest, result | error}]."""
        exported = []
        with self._lock:
            items = list(self._entries.items())
        for request_id, entry in items:
            if not entry.outcome.done():
                continue
            record: dict[str, Any] = {"request_id": request_id, "digest": entry.digest}
            error = entry.outcome.exception()
            if error is None:
                record["result"] = entry.outcome.result()
            elif isinstance(error, ProtocolError):
                record["error"] = error.to_error()
            else:
                continue
            exported.append(record)
        return exported

    def restore(self, records: list[dict[str, Any]]) -> None:
        """Take back what `export` gave (malformed records are skipped: they only cost a replay)."""
        with self._lock:
            for record in records:
                if not isinstance(record, dict) or not isinstance(record.get("request_id"), str):
                    continue
                entry = _Entry(str(record.get("digest", "")))
                if isinstance(record.get("error"), dict):
                    error = record["error"]
                    code = error.get("code")
                    # A hand-edited or damaged code replays as a refusal; it must not stop the start.
                    known = isinstance(code, int) and not isinstance(code, bool) and abs(code) < 2**31
                    entry.outcome.set_exception(ProtocolError(code if known else REFUSED, str(error.get("message", ""))))
                else:
                    entry.outcome.set_result(record.get("result"))
                self._entries[record["request_id"]] = entry
            self._forget_oldest()
