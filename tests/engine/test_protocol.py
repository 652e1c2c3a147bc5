"""The wire format: call validation, framing, hello, request-id de-duplication."""

from __future__ import annotations

import json
import threading
import time

import pytest

from engine.protocol import wire
from engine.protocol.wire import ProtocolError, RequestLog


def call(method: str, params: object = None, call_id: object = 1, **extra: object) -> bytes:
    message = {"jsonrpc": "2.0", "id": call_id, "method": method, **extra}
    if params is not None:
        message["params"] = params
    return json.dumps(message).encode()


def error_of(line: bytes) -> ProtocolError:
    with pytest.raises(ProtocolError) as caught:
        wire.parse_request(line)
    return caught.value


def test_a_valid_call_gets_its_defaults() -> None:
    request = wire.parse_request(call("rows", {"since": 5}))
    assert request.id == 1 and request.method == "rows"
    assert request.params == {"since": 5, "limit": 1000}
    assert request.request_id is None


@pytest.mark.parametrize(
    ("line", "code"),
    [
        (b"{not json", wire.PARSE_ERROR),
        (b"\xff\xfe\x00garbage", wire.PARSE_ERROR),
        (b"[1, 2]", wire.INVALID_REQUEST),
        (b"42", wire.INVALID_REQUEST),
        (json.dumps({"id": 1, "method": "status"}).encode(), wire.INVALID_REQUEST),
        (json.dumps({"jsonrpc": "2.0", "method": "status"}).encode(), wire.INVALID_REQUEST),
        (call("status", call_id=True), wire.INVALID_REQUEST),
        (call("status", call_id=[1]), wire.INVALID_REQUEST),
        (call("nope"), wire.METHOD_NOT_FOUND),
        (call("status", params=[1]), wire.INVALID_PARAMS),
        (call("status", params={"extra": 1}), wire.INVALID_PARAMS),
        (call("rows", params={"since": "3"}), wire.INVALID_PARAMS),
        (call("rows", params={"since": True}), wire.INVALID_PARAMS),
        (call("rows", params={"since": -1}), wire.INVALID_PARAMS),
        (call("log", params={"length": wire.MAX_LOG_CHUNK + 1}), wire.INVALID_PARAMS),
        (call("rollback", params={"request_id": "r"}), wire.INVALID_PARAMS),
        (call("stop", params={}), wire.INVALID_PARAMS),
        (call("stop", params={"request_id": 7}), wire.INVALID_PARAMS),
        (call("stop", params={"request_id": ""}), wire.INVALID_PARAMS),
        (call("hello", params={"protocol": 1.0}), wire.INVALID_PARAMS),
        (b"x" * wire.MAX_LINE_BYTES, wire.LINE_TOO_LONG),
    ],
)
def test_malformed_calls_are_refused_with_the_right_code(line: bytes, code: int) -> None:
    assert error_of(line).code == code


def test_the_error_keeps_the_call_id_when_it_could_be_read() -> None:
    assert wire.request_id_of(error_of(call("nope", call_id="abc"))) == "abc"
    assert wire.request_id_of(error_of(b"{bad")) is None
    reply = wire.make_error("abc", error_of(call("nope", call_id="abc")))
    expected_error = {"code": wire.METHOD_NOT_FOUND, "message": "unknown method 'nope'"}
    assert reply == {"jsonrpc": "2.0", "id": "abc", "error": expected_error}


def test_a_mutation_carries_its_request_id_apart_from_its_params() -> None:
    request = wire.parse_request(call("branch", {"request_id": "r1", "path": "/b", "at_cycle": 2}))
    assert request.request_id == "r1"
    assert request.params == {
        "path": "/b", "at_cycle": 2, "at_update": None, "plan": None, "data": None, "long_seq_len": None,
    }


def test_hello_names_the_side_to_upgrade() -> None:
    wire.check_hello(wire.PROTOCOL_VERSION)
    with pytest.raises(ProtocolError, match="client speaks 99, supervisor speaks 1") as caught:
        wire.check_hello(99)
    assert caught.value.code == wire.PROTOCOL_MISMATCH


def test_encode_caps_the_line_and_nulls_non_finite_floats() -> None:
    line = wire.encode(wire.make_result(1, {"loss": float("nan"), "rows": [float("inf"), 1.5]}))
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert json.loads(line)["result"] == {"loss": None, "rows": [None, 1.5]}
    with pytest.raises(ProtocolError) as caught:
        wire.encode(wire.make_result(1, "x" * wire.MAX_LINE_BYTES))
    assert caught.value.code == wire.REPLY_TOO_LARGE


def test_a_mutation_is_applied_once_per_request_id() -> None:
    log = RequestLog()
    applied = []

    def apply() -> dict[str, int]:
        applied.append(1)
        return {"branched": len(applied)}

    first = log.run("r1", "branch", {"path": "/b"}, apply)
    again = log.run("r1", "branch", {"path": "/b"}, apply)
    other = log.run("r2", "branch", {"path": "/b"}, apply)
    assert first == again == {"branched": 1} and other == {"branched": 2}
    with pytest.raises(ProtocolError) as caught:
        log.run("r1", "branch", {"path": "/elsewhere"}, apply)
    assert caught.value.code == wire.REQUEST_ID_REUSED
    assert len(applied) == 2


def test_a_concurrent_retry_waits_for_the_first_call() -> None:
    log = RequestLog()
    applied = []
    results = []

    def apply() -> int:
        applied.append(1)
        time.sleep(0.2)
        return 7

    threads = [
        threading.Thread(target=lambda: results.append(log.run("r", "stop", {}, apply))) for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert applied == [1] and results == [7, 7, 7, 7]


def test_a_refusal_is_replayed_but_an_internal_failure_is_retried() -> None:
    log = RequestLog()
    calls = []

    def refuse() -> None:
        calls.append("refuse")
        raise ProtocolError(wire.REFUSED, "branch target exists")

    for _ in range(2):
        with pytest.raises(ProtocolError, match="branch target exists"):
            log.run("r", "branch", {}, refuse)
    assert calls == ["refuse"]

    def crash() -> None:
        calls.append("crash")
        raise RuntimeError("disk vanished")

    for _ in range(2):
        with pytest.raises(RuntimeError):
            log.run("c", "stop", {}, crash)
    assert calls == ["refuse", "crash", "crash"]


def test_the_log_survives_export_and_restore_and_stays_bounded() -> None:
    log = RequestLog(capacity=3)
    for number in range(5):
        log.run(f"r{number}", "stop", {}, lambda number=number: number)

    def refuse() -> None:
        raise ProtocolError(wire.REFUSED, "no")

    with pytest.raises(ProtocolError):
        log.run("r0-refused", "stop", {}, refuse)
    exported = json.loads(json.dumps(log.export()))
    assert [record["request_id"] for record in exported] == ["r3", "r4", "r0-refused"]

    restored = RequestLog(capacity=3)
    restored.restore([*exported, "junk", {"no": "id"}])
    assert restored.run("r4", "stop", {}, lambda: "applied again") == 4
    with pytest.raises(ProtocolError, match="no"):
        restored.run("r0-refused", "stop", {}, lambda: "applied again")
    assert restored.run("r0", "stop", {}, lambda: "forgotten, so applied") == "forgotten, so applied"


def test_a_long_socket_path_gets_a_usable_address(tmp_path) -> None:
    deep = tmp_path / ("d" * 100) / "supervisor.sock"
    deep.parent.mkdir()
    with wire.unix_address(deep) as address:
        assert len(address.encode()) <= wire.UNIX_PATH_MAX
        assert address.endswith("/supervisor.sock")
    with wire.unix_address(tmp_path / "s.sock") as address:
        assert address == str(tmp_path / "s.sock")
