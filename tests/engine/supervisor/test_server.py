"""The supervisor socket server on real Unix sockets: hello, methods, mutations, subscriptions,
peer credentials, and 10,000 malformed messages that must change nothing."""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import stat
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from engine.errors import LineError
from engine.gpu.devices import gpu_snapshot
from engine.protocol import wire
from engine.supervisor import server_subscriptions
from engine.supervisor.server import SupervisorServer
from nsconsole.client import RemoteError, SupervisorClient, SupervisorUnavailable


class InMemoryLine:
    """A line's handler with its state in memory: what the server must pass through, and only that."""

    def __init__(self) -> None:
        self.rows_logged = [{"update": number, "loss": 5.0 - number / 10} for number in range(1, 31)]
        self.log_text = "".join(f"line {number}\n" for number in range(200)).encode()
        self.stops: list[int | None] = []
        self.branches: list[str] = []
        self.rollbacks: list[int] = []
        self.tunes = 0

    def status(self) -> dict[str, Any]:
        return {
            "state": "stopping" if self.stops else "training",
            "stops": len(self.stops),
            "branches": list(self.branches),
            "rollbacks": list(self.rollbacks),
            "tunes": self.tunes,
        }

    def rows(self, since: int, limit: int) -> dict[str, Any]:
        chosen = self.rows_logged[since : since + limit]
        return {"rows": chosen, "next": since + len(chosen), "total": len(self.rows_logged)}

    def log(self, offset: int, length: int) -> dict[str, Any]:
        chunk = self.log_text[offset : offset + length]
        size = len(self.log_text)
        return {"offset": offset, "text": chunk.decode(), "next": offset + len(chunk), "size": size}

    def gpu(self) -> dict[str, Any]:
        return gpu_snapshot().to_json()

    def stop(self, at_cycle_end: int | None) -> dict[str, Any]:
        self.stops.append(at_cycle_end)
        return {"stopping": True, "at_cycle_end": at_cycle_end}

    def branch(
        self,
        path: str,
        at_cycle: int | None,
        at_update: int | None,
        plan: str | None,
        data: str | None,
        long_seq_len: int | None,
    ) -> dict[str, Any]:
        if path in self.branches:
            raise LineError(f"{path}: already exists")
        self.branches.append(path)
        return {"branch": path, "at_cycle": at_cycle}

    def rollback(self, to: int) -> dict[str, Any]:
        if to > 30:
            raise LineError(f"no checkpoint at update {to}")
        self.rollbacks.append(to)
        return {"rolled_back_to": to}

    def tune(self, shared: bool) -> dict[str, Any]:
        self.tunes += 1
        raise ValueError("tuning crashed")  # an internal failure: answered, the server stays up


@pytest.fixture
def line() -> InMemoryLine:
    return InMemoryLine()


@pytest.fixture
def server(tmp_path: Path, line: InMemoryLine):
    with SupervisorServer(tmp_path / "supervisor.sock", line, identity={"line": str(tmp_path)}) as running:
        yield running


def raw_connection(path: Path) -> socket.socket:
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.settimeout(10)
    connection.connect(str(path))
    return connection


def read_lines(connection: socket.socket, count: int) -> list[dict[str, Any]]:
    buffer = b""
    while buffer.count(b"\n") < count:
        chunk = connection.recv(1 << 20)
        if not chunk:
            break
        buffer += chunk
    return [json.loads(line) for line in buffer.split(b"\n")[:count]]


def assert_well_formed_reply(reply: dict[str, Any]) -> None:
    assert reply["jsonrpc"] == "2.0"
    assert "id" in reply and (reply["id"] is None or isinstance(reply["id"], (int, str)))
    assert ("result" in reply) != ("error" in reply)
    if "error" in reply:
        assert isinstance(reply["error"]["code"], int) and not isinstance(reply["error"]["code"], bool)
        assert isinstance(reply["error"]["message"], str) and reply["error"]["message"]


def test_the_socket_is_private_and_removed_on_close(tmp_path: Path, line: InMemoryLine) -> None:
    socket_path = tmp_path / "supervisor.sock"
    with SupervisorServer(socket_path, line):
        mode = os.stat(socket_path).st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
        assert [entry.name for entry in tmp_path.iterdir()] == ["supervisor.sock"]
    assert not socket_path.exists()


def test_a_stale_socket_is_replaced_and_a_live_one_refused(tmp_path: Path, line: InMemoryLine) -> None:
    socket_path = tmp_path / "supervisor.sock"
    leftover = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    leftover.bind(str(socket_path))
    leftover.close()  # a crashed supervisor's socket: bound, nobody listening
    with SupervisorServer(socket_path, line):
        with pytest.raises(LineError, match="another supervisor is serving this line"):
            SupervisorServer(socket_path, line).start()
        with SupervisorClient(socket_path) as client:
            assert client.call("status")["state"] == "training"


def test_hello_with_another_protocol_is_refused_clearly(server: SupervisorServer) -> None:
    connection = raw_connection(server.socket_path)
    connection.sendall(wire.encode(wire.make_request(1, "hello", {"protocol": 99})))
    [reply] = read_lines(connection, 1)
    assert reply["error"]["code"] == wire.PROTOCOL_MISMATCH
    assert "client speaks 99, supervisor speaks 1" in reply["error"]["message"]
    assert connection.recv(10) == b""  # and the connection is closed
    connection.close()


def test_calls_before_hello_are_refused(server: SupervisorServer) -> None:
    connection = raw_connection(server.socket_path)
    connection.sendall(wire.encode(wire.make_request(1, "status")))
    [reply] = read_lines(connection, 1)
    assert reply["error"]["code"] == wire.HELLO_REQUIRED
    connection.close()


def test_every_method_replies_with_its_shape(server: SupervisorServer, line: InMemoryLine) -> None:
    with SupervisorClient(server.socket_path) as client:
        hello = client.server
        assert hello["protocol"] == wire.PROTOCOL_VERSION and hello["pid"] == os.getpid()
        assert hello["epoch"] == server.epoch and hello["line"] == str(server.socket_path.parent)
        assert set(hello["methods"]) == set(wire.METHODS)
        assert client.call("status")["state"] == "training"
        rows = client.call("rows", since=28)
        assert rows == {"rows": line.rows_logged[28:], "next": 30, "total": 30}
        log = client.call("log", offset=7, length=7)
        assert log == {"offset": 7, "text": "line 1\n", "next": 14, "size": len(line.log_text)}
        gpu = client.call("gpu")
        assert set(gpu) == {"available", "reason", "driver", "devices"}
        assert client.mutate("stop", at_cycle_end=2) == {"stopping": True, "at_cycle_end": 2}
        assert client.mutate("branch", path="/lines/b1", at_cycle=1)["branch"] == "/lines/b1"
        assert client.mutate("rollback", to=12) == {"rolled_back_to": 12}
        subscribed = client.subscribe(since_seq=None)
        assert set(subscribed) == {"seq", "epoch", "replayed", "gap", "oldest_seq"}
        with pytest.raises(RemoteError, match="no checkpoint at update 99") as refused:
            client.mutate("rollback", to=99)
        assert refused.value.code == wire.REFUSED
        with pytest.raises(RemoteError, match="internal error in tune: ValueError: tuning crash") as crashed:
            client.mutate("tune")
        assert crashed.value.code == wire.INTERNAL_ERROR
        # The server is still up and its state is what the calls made it.
        assert client.call("status") == {
            "state": "stopping", "stops": 1, "branches": ["/lines/b1"], "rollbacks": [12], "tunes": 1,
        }


def test_a_retried_mutation_is_applied_once(server: SupervisorServer, line: InMemoryLine) -> None:
    with SupervisorClient(server.socket_path) as client:
        first = client.call("branch", request_id="same", path="/lines/b2")
    # The reply was "lost": the client reconnects and sends the same call again.
    with SupervisorClient(server.socket_path) as client:
        again = client.call("branch", request_id="same", path="/lines/b2")
        assert again == first and line.branches == ["/lines/b2"]
        with pytest.raises(RemoteError) as reused:
            client.call("branch", request_id="same", path="/lines/other")
        assert reused.value.code == wire.REQUEST_ID_REUSED
        with pytest.raises(RemoteError, match="already exists"):
            client.call("branch", request_id="new", path="/lines/b2")
    assert line.branches == ["/lines/b2"]


class HeldTuneLine(InMemoryLine):
    """A line whose tune lasts until the test lets it end (a real one takes minutes)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def tune(self, shared: bool) -> dict[str, Any]:
        assert self.release.wait(30), "the test never let the tune end"
        self.tunes += 1
        return {"lengths": []}


def test_a_status_sent_behind_a_long_mutation_on_the_same_connection_is_answered_at_once(tmp_path: Path) -> None:
    line = HeldTuneLine()
    with SupervisorServer(tmp_path / "supervisor.sock", line) as server:
        connection = raw_connection(server.socket_path)
        try:
            connection.sendall(wire.encode(wire.make_request(1, "hello", {"protocol": wire.PROTOCOL_VERSION})))
            assert "result" in read_lines(connection, 1)[0]
            connection.sendall(wire.encode(wire.make_request(2, "tune", {"shared": False, "request_id": "t"})))
            connection.sendall(wire.encode(wire.make_request(3, "status", {})))
            # Served one call after another, the status waited for the tune (and timed out here).
            status = read_lines(connection, 1)[0]
            assert status["id"] == 3
            assert [entry["method"] for entry in status["result"]["under_way"]] == ["tune"]
            line.release.set()
            tuned = read_lines(connection, 1)[0]
            assert tuned == {"jsonrpc": "2.0", "id": 2, "result": {"lengths": []}}
        finally:
            line.release.set()
            connection.close()
        with SupervisorClient(server.socket_path) as client:
            assert "under_way" not in client.call("status")  # nothing under way: the handler's status as is


def test_a_reconnecting_subscriber_gets_what_it_missed_in_order(server: SupervisorServer) -> None:
    with SupervisorClient(server.socket_path) as client:
        client.subscribe(since_seq=0)
        for number in range(3):
            server.publish("row", {"update": number})
        seen = [client.next_notification(timeout=5) for _ in range(3)]
        assert [n.seq for n in seen] == [1, 2, 3] and [n.data["update"] for n in seen] == [0, 1, 2]
    # While it is away: a heartbeat, two rows, an event.
    server.publish("heartbeat", {"update": 3})
    server.publish("row", {"update": 3})
    server.publish("row", {"update": 4})
    server.publish("event", {"event": "watchdog_restart"})
    with SupervisorClient(server.socket_path) as client:
        reply = client.subscribe(since_seq=3)
        assert reply["replayed"] == 4 and reply["seq"] == 7 and not reply["gap"]
        server.publish("validation", {"update": 5})  # live after the replay
        missed = [client.next_notification(timeout=5) for _ in range(5)]
        assert [n.seq for n in missed] == [4, 5, 6, 7, 8]
        assert [n.kind for n in missed] == ["heartbeat", "row", "row", "event", "validation"]
        assert all(n.epoch == server.epoch for n in missed)
        assert client.next_notification(timeout=0.2) is None


def test_a_subscriber_that_fell_behind_the_ring_hears_of_the_gap(tmp_path: Path, line: InMemoryLine) -> None:
    with SupervisorServer(tmp_path / "s.sock", line, ring_capacity=4) as small:
        for number in range(10):
            small.publish("row", {"update": number})
        with SupervisorClient(small.socket_path) as client:
            reply = client.subscribe(since_seq=2)
            assert reply["gap"] and reply["oldest_seq"] == 7 and reply["replayed"] == 4
            assert [client.next_notification(timeout=5).seq for _ in range(4)] == [7, 8, 9, 10]


def test_a_backlog_larger_than_the_send_buffer_is_replayed_whole(server: SupervisorServer) -> None:
    row = {f"train/grad_norm/layer{layer:02d}": 0.5 for layer in range(60)}  # about 2 KB a row
    for update in range(6000):  # about 12 MB: past the limit at which a live subscriber is dropped
        server.publish("row", {**row, "update": update})
    with SupervisorClient(server.socket_path) as client:
        assert client.subscribe(since_seq=0)["replayed"] == 6000
        updates = [client.next_notification(timeout=10).data["update"] for _ in range(6000)]
    assert updates == list(range(6000))


def test_notifications_racing_a_subscribe_arrive_once_and_in_order(server: SupervisorServer) -> None:
    publishing = threading.Thread(target=lambda: [server.publish("row", {"n": n}) for n in range(2000)])
    with SupervisorClient(server.socket_path) as client:
        publishing.start()
        time.sleep(0.005)
        client.subscribe(since_seq=0)
        publishing.join()
        seqs = []
        while (notification := client.next_notification(timeout=1)) is not None:
            seqs.append(notification.seq)
    assert seqs == list(range(1, 2001))


def test_a_line_over_the_cap_is_answered_and_the_connection_goes_on(server: SupervisorServer) -> None:
    connection = raw_connection(server.socket_path)
    connection.sendall(wire.encode(wire.make_request(1, "hello", {"protocol": 1})))
    padding = b"y" * 200_000
    connection.sendall(b'{"jsonrpc":"2.0","id":2,"method":"status","params":{"x":"' + padding + b'"}}\n')
    connection.sendall(wire.encode(wire.make_request(3, "status")))
    hello, too_long, status = read_lines(connection, 3)
    assert hello["id"] == 1 and too_long["error"]["code"] == wire.LINE_TOO_LONG and too_long["id"] is None
    assert status["id"] == 3 and status["result"]["state"] == "training"
    connection.close()


def test_another_uid_is_refused(tmp_path: Path, line: InMemoryLine) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to connect as another user (nobody)")
    import pwd

    nobody = pwd.getpwnam("nobody").pw_uid
    # The socket's 0600 mode alone keeps others out; open it up to reach the uid check behind it.
    shared = Path(os.environ.get("TMPDIR", "/tmp")) / f"nsconsole-peer-test-{os.getpid()}"
    shared.mkdir(mode=0o755)
    try:
        socket_path = shared / "supervisor.sock"
        with SupervisorServer(socket_path, line):
            assert connect_as(nobody, socket_path) == "EACCES"  # the mode holds
            os.chmod(socket_path, 0o666)
            outcome = connect_as(nobody, socket_path)
            reply = json.loads(outcome)
            assert reply["error"]["code"] == wire.PEER_REFUSED
            assert f"peer uid {nobody} is not the supervisor's uid 0" in reply["error"]["message"]
            with SupervisorClient(socket_path) as client:  # our own uid still gets in
                assert client.call("status")["state"] == "training"
    finally:
        socket_path.unlink(missing_ok=True)
        shared.rmdir()


def connect_as(uid: int, socket_path: Path) -> str:
    """Connect as `uid` in a forked child, send a hello; what came back (or the errno's name)."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        outcome = b""
        try:
            os.close(read_end)
            os.setgid(65534)
            os.setuid(uid)
            connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            connection.settimeout(5)
            try:
                connection.connect(str(socket_path))
                # Refused and closed before the hello goes out: the refusal is still there to read.
                with contextlib.suppress(BrokenPipeError):
                    connection.sendall(wire.encode(wire.make_request(1, "hello", {"protocol": 1})))
                while not outcome.endswith(b"\n"):
                    chunk = connection.recv(65536)
                    if not chunk:
                        break
                    outcome += chunk
            except PermissionError:
                outcome = b"EACCES"
            except Exception as error:  # reported to the test, which fails with it
                outcome = f"child failed: {type(error).__name__}: {error}".encode()
            os.write(write_end, outcome)
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        outcome = pipe.read()
    os.waitpid(child, 0)
    return outcome.decode().strip()


# ---- 10,000 malformed messages ------------------------------------------------------------------


def malformed_messages(seed: int, count: int) -> list[bytes]:
    """Lines (without newline, never blank) that must each get one error reply and change nothing."""
    generator = random.Random(seed)
    methods = [*wire.METHODS, "shutdown", "", "__init__", "STATUS", "status ", "x" * 300]
    junk_values: list[Any] = [None, True, -1, 2**70, 1.5, "", "x", [], {}, [1, {"a": None}], {"since": "1"}]

    def random_value() -> Any:
        return generator.choice(junk_values)

    def bad_json() -> bytes:
        good = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "status"})
        cut = generator.randrange(1, len(good) - 1)
        return good[:cut].encode() + generator.choice([b"", b"}", b",,", b"\x00", b"'"])

    def garbage() -> bytes:
        raw = bytes(generator.randrange(256) for _ in range(generator.randrange(1, 200)))
        return b"#" + raw.replace(b"\n", b" ")

    def wrong_shapes() -> bytes:
        message: dict[str, Any] = {
            "jsonrpc": generator.choice(["2.0", "1.0", None, 2]),
            "id": generator.randrange(99),
            "method": generator.choice(methods),
        }
        if generator.random() < 0.8:
            message["params"] = generator.choice([
                random_value(),
                {"since": random_value(), "limit": random_value()},
                {"request_id": random_value()},
            ])
        if generator.random() < 0.3:
            message.pop("id")
        if message.get("jsonrpc") == "2.0" and message["method"] in wire.METHODS and "id" in message:
            # Keep it malformed: a valid read or hello would be a fine call, not a malformed one.
            message["params"] = {"bogus": random_value()}
        return json.dumps(message).encode()

    def mutation_without_request_id() -> bytes:
        method = generator.choice(sorted(wire.MUTATIONS))
        params = {"path": "/x", "to": 3, "at_cycle_end": 1, "request_id": generator.choice([None, 1, "", []])}
        return json.dumps({"jsonrpc": "2.0", "id": "m", "method": method, "params": params}).encode()

    def huge() -> bytes:
        padding = b"z" * generator.randrange(65_536, 300_000)
        return b'{"jsonrpc":"2.0","id":1,"method":"status","pad":"' + padding + b'"}'

    def deep_nesting() -> bytes:
        depth = generator.randrange(500, 100_000 // 2)
        return b"[" * depth + b"]" * depth

    makers = [bad_json, garbage, wrong_shapes, mutation_without_request_id]
    lines = []
    for number in range(count):
        if number % 500 == 7:
            lines.append(huge())
        elif number % 250 == 3:
            lines.append(deep_nesting())
        else:
            lines.append(generator.choice(makers)())
    return lines


def test_ten_thousand_malformed_messages_change_nothing(server: SupervisorServer, line: InMemoryLine) -> None:
    with SupervisorClient(server.socket_path) as client:
        before = client.call("status")
    messages = malformed_messages(seed=20261129, count=10_000)
    connection = raw_connection(server.socket_path)
    connection.settimeout(60)
    connection.sendall(wire.encode(wire.make_request("hi", "hello", {"protocol": 1})))

    def send_all() -> None:
        for message in messages:
            connection.sendall(message + b"\n")

    sender = threading.Thread(target=send_all)
    sender.start()
    replies = read_lines(connection, len(messages) + 1)
    sender.join()
    connection.close()

    assert replies[0]["result"]["protocol"] == 1
    assert len(replies) == len(messages) + 1
    for reply in replies[1:]:
        assert_well_formed_reply(reply)
        assert "error" in reply
    codes = {reply["error"]["code"] for reply in replies[1:]}
    assert codes == {
        wire.PARSE_ERROR, wire.INVALID_REQUEST, wire.METHOD_NOT_FOUND,
        wire.INVALID_PARAMS, wire.LINE_TOO_LONG,
    }
    with SupervisorClient(server.socket_path) as client:
        assert client.call("status") == before
    assert line.stops == [] and line.branches == [] and line.rollbacks == [] and line.tunes == 0


def test_the_sync_client_reports_a_missing_supervisor(tmp_path: Path) -> None:
    with pytest.raises(SupervisorUnavailable, match="no supervisor answers"):
        SupervisorClient(tmp_path / "supervisor.sock").connect()


def test_the_client_reports_a_refused_connection_clearly(tmp_path: Path, line: InMemoryLine) -> None:
    # A server that expects another uid refuses this process, whichever side closes first.
    with SupervisorServer(tmp_path / "supervisor.sock", line, expected_uid=os.getuid() + 1):
        for _ in range(20):
            with pytest.raises(RemoteError, match="connection refused: peer uid") as refused:
                SupervisorClient(tmp_path / "supervisor.sock").connect()
            assert refused.value.code == wire.PEER_REFUSED


# ---- under load: idle connections, the connection cap, integers Python will not read ----------------


def hello_connection(path: Path) -> socket.socket:
    """A raw connection that said hello and read its answer."""
    connection = raw_connection(path)
    connection.sendall(wire.encode(wire.make_request(0, "hello", {"protocol": wire.PROTOCOL_VERSION})))
    assert "result" in read_lines(connection, 1)[0]
    return connection


def wait_until_closed_by_server(connection: socket.socket) -> None:
    """Block until the server closes `connection` (the socket's 10 s timeout fails the test)."""
    assert connection.recv(1024) == b""
    connection.close()


def test_an_idle_connection_is_closed_but_a_watching_one_and_a_long_call_are_not(tmp_path: Path) -> None:
    line = HeldTuneLine()
    with SupervisorServer(tmp_path / "supervisor.sock", line, idle_timeout_s=0.5) as server:
        try:
            with SupervisorClient(server.socket_path, timeout=10) as watcher:
                watcher.subscribe(since_seq=None)
                tuning = hello_connection(server.socket_path)
                tuning.sendall(wire.encode(wire.make_request(1, "tune", {"shared": False, "request_id": "t"})))
                # Two idle connections closed one after the other: the watcher and the tuning one
                # have been quiet for twice the timeout by then.
                wait_until_closed_by_server(hello_connection(server.socket_path))
                wait_until_closed_by_server(hello_connection(server.socket_path))
                server.publish("row", {"update": 1})
                notification = watcher.next_notification(timeout=10)
                assert notification is not None and notification.data == {"update": 1}
                line.release.set()
                assert read_lines(tuning, 1)[0] == {"jsonrpc": "2.0", "id": 1, "result": {"lengths": []}}
                tuning.sendall(wire.encode(wire.make_request(2, "status")))
                assert read_lines(tuning, 1)[0]["result"]["tunes"] == 1
                # Once its call is answered, the tuning connection is idle like any other.
                wait_until_closed_by_server(tuning)
        finally:
            line.release.set()


def test_seventy_idle_connections_do_not_lock_out_a_fresh_client(server: SupervisorServer) -> None:
    idle = []
    with SupervisorClient(server.socket_path, timeout=10) as watcher:
        watcher.subscribe(since_seq=None)
        try:
            for _ in range(70):  # past the cap of 64: the last ones wait for a slot
                connection = raw_connection(server.socket_path)
                connection.sendall(wire.encode(wire.make_request(0, "hello", {"protocol": 1})))
                idle.append(connection)
            with SupervisorClient(server.socket_path, timeout=10) as fresh:
                assert fresh.call("status")["state"] == "training"
            # The slots were taken from the idle connections, never from the watching console.
            server.publish("event", {"event": "still watched"})
            notification = watcher.next_notification(timeout=10)
            assert notification is not None and notification.data == {"event": "still watched"}
        finally:
            for connection in idle:
                connection.close()


def test_consoles_that_stop_reading_mid_replay_do_not_lock_out_a_fresh_client(
    tmp_path: Path, line: InMemoryLine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A replay is not idle (its slot is never taken for a new client): two clients that subscribe
    # from seq 0 to a full ring and never read held both slots for good before the stall limit.
    monkeypatch.setattr(server_subscriptions, "REPLAY_STALL_S", 0.5)
    with SupervisorServer(tmp_path / "supervisor.sock", line, max_connections=2) as server:
        for number in range(4000):  # about 2 MB: more than a socket's buffers hold
            server.publish("row", {"update": number, "grads": "0.123456789," * 40})
        stalled = []
        try:
            for _ in range(2):
                connection = raw_connection(server.socket_path)
                connection.sendall(wire.encode(wire.make_request(0, "hello", {"protocol": wire.PROTOCOL_VERSION})))
                connection.sendall(wire.encode(wire.make_request(1, "subscribe", {"since_seq": 0})))
                stalled.append(connection)
            with SupervisorClient(server.socket_path, timeout=10) as fresh:
                assert fresh.call("status")["state"] == "training"
            # The stalled ones were cut: their stream ends (after what was buffered) instead of hanging.
            for connection in stalled:
                connection.settimeout(10)
                while connection.recv(1 << 20):
                    pass
        finally:
            for connection in stalled:
                connection.close()


def test_150_concurrent_clients_are_all_answered(server: SupervisorServer) -> None:
    start_together = threading.Barrier(150)
    outcomes: list[str] = []

    def hello_and_status() -> None:
        start_together.wait(timeout=30)
        try:
            with SupervisorClient(server.socket_path, timeout=20) as client:
                outcomes.append(client.call("status")["state"])
        except Exception as error:  # reported in the assertion below
            outcomes.append(f"{type(error).__name__}: {error}")

    clients = [threading.Thread(target=hello_and_status) for _ in range(150)]
    for client in clients:
        client.start()
    for client in clients:
        client.join(timeout=60)
    assert sorted(set(outcomes)) == ["training"] and len(outcomes) == 150


def test_an_integer_past_pythons_digit_limit_is_a_parse_error_and_the_connection_goes_on(
    server: SupervisorServer,
) -> None:
    connection = hello_connection(server.socket_path)
    digits = "9" * 5000
    connection.sendall(f'{{"jsonrpc":"2.0","id":1,"method":"rows","params":{{"since":{digits}}}}}\n'.encode())
    connection.sendall(f'{{"jsonrpc":"2.0","id":{digits},"method":"status"}}\n'.encode())
    connection.sendall(wire.encode(wire.make_request(3, "status")))
    in_params, in_id, status = read_lines(connection, 3)
    for reply in (in_params, in_id):
        assert reply["id"] is None and reply["error"]["code"] == wire.PARSE_ERROR
        assert "integer longer than 4300 digits" in reply["error"]["message"]
    assert status["id"] == 3 and status["result"]["state"] == "training"
    connection.close()


def test_closing_with_a_console_attached_logs_no_error(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # A console attached (subscribed, idle) when the supervisor ends: its connection task is
    # cancelled by the shutdown. A cancelled task made asyncio's connection callback (Python 3.11)
    # log "Exception in callback ... CancelledError" with a traceback into supervisor.out.
    caplog.set_level("DEBUG", logger="asyncio")
    server = SupervisorServer(tmp_path / "supervisor.sock", InMemoryLine())
    server.start()
    try:
        with SupervisorClient(server.socket_path) as client:
            client.subscribe(since_seq=0)
            server.close()
    finally:
        server.close()
    assert [record for record in caplog.records if record.levelname == "ERROR"] == []
