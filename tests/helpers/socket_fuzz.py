"""Fuzzing a live supervisor's socket (the test `test_socket_fuzz.py` and `bench/socket_fuzz.py`).

Clients, many at once, each on its own connection, send one message at a time and wait for its
reply: bytes that are not UTF-8 or not JSON, nesting and integers past the parser's limits,
lines past the 64 KiB cap, calls of unknown methods and with parameters of every wrong type,
well-formed mutations with values the line must refuse (a rollback forward or to a checkpoint
that is not there, a branch with no cycle or a broken plan, a stop at a negative cycle, a tune
with a string for a flag), request ids repeated with the same call and reused with another, and
reads with odd arguments. Every message is one of those a line must refuse or only read, so the
line's state must not move. Counted: messages, replies, hangs (no reply within the timeout),
crashes (the supervisor gone, or not answering afterwards) and state changes (what `status`
and the line's files say before and after).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import socket
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from engine.protocol import wire

REPLY_TIMEOUT_S = 20.0
"""A message not answered within this is a hang."""

WRONG_VALUES: list[Any] = [-1, "3", 1.5, True, None, [], {}, "", 10**40, -(10**40), "\udcff", {"a": [1]}]


@dataclass
class FuzzTally:
    """What one fuzz run counted."""

    messages: int = 0
    replies: int = 0
    error_replies: int = 0
    internal_errors: int = 0
    """Replies with JSON-RPC's internal-error code: answered (no crash), but a handler let an error through."""
    hangs: int = 0
    reconnects: int = 0
    """Connections the server ended (after a refused hello, at the connection cap) and opened again."""
    connect_refusals: int = 0
    """Connection attempts the kernel refused (retried after 0.1 s)."""
    internal_messages: list[str] = field(default_factory=list)
    """The distinct internal errors' messages (what to fix)."""

    def merge(self, other: FuzzTally) -> None:
        for name, value in asdict(other).items():
            if name == "internal_messages":
                self.internal_messages = sorted(set(self.internal_messages) | set(value))
            else:
                setattr(self, name, getattr(self, name) + value)


def _call(method: str, params: Any, call_id: Any = None) -> bytes:
    message = {"jsonrpc": "2.0", "id": call_id if call_id is not None else 1, "method": method, "params": params}
    return json.dumps(message).encode("utf-8", "backslashreplace")


def _bad_mutation(rng: random.Random, request_id: str) -> bytes:
    """A well-formed mutation (valid envelope, a request_id) whose values the line refuses."""
    choice = rng.randrange(9)
    if choice == 0:
        params: dict[str, Any] = {"at_cycle_end": rng.choice([-1, "3", 1.5, True, [], {}])}
        method = "stop"
    elif choice == 1:
        params, method = {"when": "now"}, "stop"
    elif choice == 2:
        # Types right, values not: a checkpoint that is not there, or not before `latest`.
        params, method = {"to": rng.choice([0, 7, 10**18, 10**40])}, "rollback"
    elif choice == 3:
        params, method = {"to": rng.choice(WRONG_VALUES[:-1])}, "rollback"
    elif choice == 4:
        params, method = {"path": rng.choice(["branch-x", "/nonexistent/b", "b\udcff"])}, "branch"  # no at_cycle
    elif choice == 5:
        params = {"path": "b", "at_cycle": 1, "at_update": 3, "plan": "long:100", "data": "d"}
        method = "branch"
    elif choice == 6:
        params = {"path": f"/nonexistent/{request_id}", "at_cycle": rng.choice([1, 10**6]),
                  "plan": rng.choice(["garbage", "decay:-5", "long:1e999", ":::"]), "data": "/nonexistent/data"}
        method = "branch"
    elif choice == 7:
        params, method = {"path": rng.choice(WRONG_VALUES), "at_cycle": rng.choice(WRONG_VALUES)}, "branch"
    else:
        params, method = {"shared": rng.choice(["yes", 1, None, [], 0.5])}, "tune"
    return _call(method, {**params, "request_id": request_id}, rng.randrange(1, 10**6))


def fuzz_message(rng: random.Random, request_ids: list[str]) -> tuple[str, bytes]:
    """(kind, one message line without its newline)."""
    kind = rng.choice(
        ["garbage", "not_utf8", "deep", "huge_int", "overlong", "json_junk", "bad_call", "bad_mutation",
         "repeat_id", "reuse_id", "read", "hello_again"]
    )
    if kind == "garbage":
        body = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300))).replace(b"\n", b"\x00")
        return kind, b"#" + body
    if kind == "not_utf8":
        return kind, b'{"jsonrpc":"2.0","id":1,"method":"status\xff\xfe"}'
    if kind == "deep":
        return kind, b"[" * rng.choice([1000, 60000]) + b"]" * rng.choice([0, 1000])
    if kind == "huge_int":
        return kind, b'{"jsonrpc":"2.0","id":' + b"9" * rng.choice([4301, 5000, 20000]) + b',"method":"status"}'
    if kind == "overlong":
        return kind, b'{"jsonrpc":"2.0","id":1,"method":"status","params":{"x":"' + b"a" * 70000 + b'"}}'
    if kind == "json_junk":
        junk = rng.choice([[], [1, 2], 3, "s", None, {}, {"jsonrpc": "1.0"}, {"jsonrpc": "2.0"},
                           {"jsonrpc": "2.0", "id": True, "method": "status"},
                           {"jsonrpc": "2.0", "id": 1.5, "method": "status"}])
        return kind, json.dumps(junk).encode()
    if kind == "bad_call":
        method = rng.choice([*wire.METHODS, "shutdown", "__init__", "_save", "x" * 200])
        names = list(wire.METHODS.get(method, {})) + ["zzz"]
        params = {rng.choice(names): rng.choice(WRONG_VALUES)} if rng.random() < 0.8 else rng.choice(WRONG_VALUES)
        if method in wire.MUTATIONS and isinstance(params, dict) and rng.random() < 0.5:
            params["request_id"] = rng.choice(["", "x" * 129, 5, None])
        return kind, _call(method, params, rng.randrange(10**6))
    if kind in ("bad_mutation", "repeat_id") or (kind == "reuse_id" and not request_ids):
        if kind == "repeat_id" and request_ids:
            request_id = rng.choice(request_ids)  # the same id: its first call's params are replayed below
            return kind, REPEATS.get(request_id) or _bad_mutation(rng, request_id)
        request_id = f"fuzz-{rng.randrange(10**9)}"
        message = _bad_mutation(rng, request_id)
        request_ids.append(request_id)
        REPEATS[request_id] = message
        return kind, message
    if kind == "reuse_id":
        return kind, _bad_mutation(rng, rng.choice(request_ids))  # another call under a used id
    if kind == "read":
        method = rng.choice(["status", "rows", "log", "gpu"])
        params = {"rows": {"since": rng.choice([0, 5, 10**12]), "limit": rng.choice([1, 4096])},
                  "log": {"offset": rng.choice([0, 10**15]), "length": rng.choice([1, wire.MAX_LOG_CHUNK])}}.get(method, {})
        return kind, _call(method, params, rng.choice([1, "x", -5, 10**30]))
    return kind, _call("hello", {"protocol": rng.choice([0, 2, -1])}, 1)


REPEATS: dict[str, bytes] = {}
"""Each fuzzed request_id's first message: sent again as is, it must get the same answer."""


class FuzzClient:
    """One client connection sending `count` fuzzed messages, one at a time."""

    def __init__(self, socket_path: Path, seed: int, count: int, request_ids: list[str]) -> None:
        self.socket_path = socket_path
        self.rng = random.Random(seed)
        self.count = count
        self.request_ids = request_ids
        self.tally = FuzzTally()
        self._sock: socket.socket | None = None
        self._buffer = b""

    def run(self) -> FuzzTally:
        try:
            for _ in range(self.count):
                deadline = time.monotonic() + REPLY_TIMEOUT_S
                while self._sock is None:
                    if time.monotonic() > deadline:
                        self.tally.hangs += 1  # no connection taken (or greeted) within the timeout
                        return self.tally
                    try:
                        self._connect()
                    except OSError:  # the listen backlog full under the burst: the kernel refused it
                        self.tally.connect_refusals += 1
                        time.sleep(0.1)
                kind, message = fuzz_message(self.rng, self.request_ids)
                self.tally.messages += 1
                reply = self._exchange(message + b"\n")
                if reply is None:
                    continue
                if kind == "hello_again" and "error" in reply:
                    self._close()  # the server ends a connection whose hello it refuses
        finally:
            self._close()
        return self.tally

    def _connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(REPLY_TIMEOUT_S)
        try:
            with wire.unix_address(self.socket_path) as address:
                sock.connect(address)
        except OSError:
            sock.close()
            raise
        self._sock, self._buffer = sock, b""
        hello = self._exchange(_call("hello", {"protocol": wire.PROTOCOL_VERSION, "client": "fuzz"}, 0) + b"\n", False)
        if hello is None or "result" not in hello:
            self._close()

    def _exchange(self, data: bytes, counted: bool = True) -> dict[str, Any] | None:
        """Send `data` and read its reply (notifications skipped); None after a hang or a closed connection."""
        assert self._sock is not None
        try:
            self._sock.sendall(data)
            while True:
                line = self._read_line()
                if line is None:
                    self.tally.reconnects += 1
                    self._close()
                    return None
                message = json.loads(line)
                if "method" in message:
                    continue  # a notification (the fuzz may have subscribed)
                if counted:
                    self._count(message)
                return message
        except TimeoutError:
            self.tally.hangs += 1
            self._close()
            return None
        except (ConnectionError, BrokenPipeError):
            self.tally.reconnects += 1
            self._close()
            return None

    def _count(self, reply: dict[str, Any]) -> None:
        self.tally.replies += 1
        if "error" in reply:
            self.tally.error_replies += 1
            if reply["error"].get("code") == wire.INTERNAL_ERROR:
                self.tally.internal_errors += 1
                message = str(reply["error"].get("message"))[:160]
                if message not in self.tally.internal_messages:
                    self.tally.internal_messages.append(message)

    def _read_line(self) -> bytes | None:
        assert self._sock is not None
        while b"\n" not in self._buffer:
            chunk = self._sock.recv(1 << 16)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def _close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        self._sock = None


def fuzz_concurrently(socket_path: Path, clients: int, messages_each: int, seed: int = 0) -> FuzzTally:
    """`clients` FuzzClients at once, sharing request ids (repeats land on other connections too)."""
    request_ids: list[str] = []
    fuzzers = [FuzzClient(socket_path, seed * 100_003 + index, messages_each, request_ids) for index in range(clients)]
    tallies: list[FuzzTally] = []
    lock = threading.Lock()

    def run(fuzzer: FuzzClient) -> None:
        tally = fuzzer.run()
        with lock:
            tallies.append(tally)

    threads = [threading.Thread(target=run, args=(fuzzer,)) for fuzzer in fuzzers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    total = FuzzTally()
    for tally in tallies:
        total.merge(tally)
    return total


STATE_FIELDS = ("state", "pid", "launches", "crashes", "trainer_pid", "latest_checkpoint", "queued_forks",
                "failed_forks", "stop", "stop_at", "parent")
"""What of the `status` reply a refused or read-only call must leave as it was."""


def line_state(line: Path, status: dict[str, Any]) -> dict[str, Any]:
    """The line's state as the fuzz must leave it: `status` fields and its files (not its logs)."""
    files = {}
    for name in ("run.json", "accepted_run.json", "STOP"):
        path = line / name
        files[name] = hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None
    checkpoints = sorted(path.name for path in (line / "checkpoints").iterdir()) if (line / "checkpoints").is_dir() else []
    siblings = sorted(path.name for path in line.parent.iterdir())  # no branch appeared beside it
    return {**{name: status.get(name) for name in STATE_FIELDS}, "files": files, "checkpoints": checkpoints,
            "siblings": siblings}


def state_changes(before: dict[str, Any], after: dict[str, Any]) -> int:
    return sum(before[key] != after[key] for key in before)
