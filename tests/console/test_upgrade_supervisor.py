"""A console of a newer nsconsole before a supervisor an older one started (users upgrade with
`pip install -U` under lines that run for weeks; found walking that path):

- a hello refused for another protocol version names the line, both versions, which side is
  older and what to do (the supervisor's own words said "restart it with the same nsconsole
  version", and the console, its keys off, could not stop the line);
- a supervisor of the same protocol with fewer methods (one of the day before had no `history`,
  `series` or `row`) is said to be older once it is attached, and a mutation failing inside it
  (after the upgrade its branch failed on `ImportError: cannot import name 'directory_lock' from
  'datalines.files'`: new modules imported into the old process) says to restart the line.

The older and newer sides are stood in for by what they send: the refusal a supervisor of the other
version sends (`wire.check_hello`'s), and a real server whose hello names the methods c997b03's did.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from engine.errors import LineError
from engine.protocol import wire
from engine.supervisor import registry
from engine.supervisor.server import SupervisorServer
from nsconsole.client import RemoteError, SupervisorClient
from nsconsole.live import LiveLines
from nsconsole.state import LineBook

OLDER_METHODS = ["branch", "gpu", "hello", "log", "rollback", "rows", "status", "stop", "subscribe", "tune"]
"""The methods the hello of a supervisor of c997b03 (a day before `history`, `series`, `row`) named."""


def refusal_of_a_supervisor_speaking(server_protocol: int, monkeypatch: pytest.MonkeyPatch) -> bytes:
    """The reply line to this client's hello (call id 1) of a supervisor of `server_protocol`."""
    with monkeypatch.context() as patch:
        patch.setattr(wire, "PROTOCOL_VERSION", server_protocol)
        with pytest.raises(wire.ProtocolError) as refused:
            wire.check_hello(2 if server_protocol == 1 else 1)
    return wire.encode(wire.make_error(1, refused.value))


def serve_one_reply(socket_path: Path, reply: bytes) -> threading.Thread:
    """A socket that answers the first line it reads with `reply`, then closes."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(socket_path))
    listener.listen(1)

    def answer() -> None:
        connection, _ = listener.accept()
        with connection, listener:
            connection.makefile("rb").readline()
            connection.sendall(reply)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("older", ["supervisor", "client"])
def test_a_protocol_mismatch_names_the_line_both_versions_and_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, older: str
) -> None:
    line = tmp_path / "trunk"
    line.mkdir()
    server_protocol, client_protocol = (1, 2) if older == "supervisor" else (2, 1)
    served = serve_one_reply(line / "supervisor.sock", refusal_of_a_supervisor_speaking(server_protocol, monkeypatch))
    monkeypatch.setattr(wire, "PROTOCOL_VERSION", client_protocol)
    with pytest.raises(RemoteError) as refused:
        SupervisorClient(line / "supervisor.sock", timeout=10).connect()
    served.join(10)
    assert refused.value.code == wire.PROTOCOL_MISMATCH
    versions = f"{line}: its supervisor speaks protocol {server_protocol} and this nsconsole {client_protocol}: "
    if older == "supervisor":
        assert str(refused.value) == versions + (
            f"an older nsconsole started it (before an upgrade); `nsconsole stop {line}` stops it with a "
            f"checkpoint (through the line's STOP file: no socket needed), then `nsconsole run {line}` "
            "runs the line on this one"
        )
    else:
        assert str(refused.value) == versions + (
            "a newer nsconsole started it: watch and steer it with that one (upgrade this one to it)"
        )


class OlderSupervisorServer(SupervisorServer):
    """A server whose hello names the methods an older supervisor's did."""

    def _hello_result(self) -> dict[str, Any]:
        return {**super()._hello_result(), "methods": OLDER_METHODS}


class UpgradedUnderIt:
    """An older supervisor's line after the upgrade: its branch imports a module of the new code."""

    def status(self) -> dict[str, Any]:
        return {"state": "training"}

    def rows(self, since: int, limit: int) -> dict[str, Any]:
        return {"rows": [], "next": 0, "total": 0}

    def branch(self, **params: Any) -> dict[str, Any]:
        raise ImportError("cannot import name 'directory_lock' from 'datalines.files'")

    def rollback(self, to: int) -> dict[str, Any]:
        raise LineError(f"checkpoints/u{to:08d}: no such checkpoint")


def test_an_older_supervisor_is_named_and_its_failing_mutation_says_to_restart_the_line(tmp_path: Path) -> None:
    line = tmp_path / "trunk"
    line.mkdir()
    server = OlderSupervisorServer(line / "supervisor.sock", UpgradedUnderIt())
    server.start()
    entry = registry.register(line, line / "supervisor.sock")
    remedy = (
        f"its supervisor (pid {entry.pid}) was started by an older nsconsole (its protocol lacks history, row, "
        f"series) and runs it still, beside this one's code installed since: stop the line (s, or `nsconsole stop "
        f"{line}`) and resume it (R, or `nsconsole run {line}`) to run it on this nsconsole"
    )

    async def scenario() -> None:
        book = LineBook()
        live = LiveLines(book, lambda line: None, discover=lambda: [entry], find_lines=lambda: [])
        await live.discover_once()
        view = book.get(entry.id)
        assert view is not None
        for _ in range(500):
            if view.connected:
                break
            await asyncio.sleep(0.01)
        assert view.connected
        assert [(event.message, event.severity) for event in view.events] == [
            (f"attached to the supervisor (pid {entry.pid})", "info"), (remedy, "warning"),
        ]
        branch = {"path": str(tmp_path / "b"), "at_cycle": 3, "plan": "decay:1e6", "data": str(tmp_path / "d")}
        with pytest.raises(LineError) as failed:
            await live.mutate(entry.id, "branch", **branch)
        assert str(failed.value) == (
            f"{line}: internal error in branch: ImportError: cannot import name 'directory_lock' from "
            f"'datalines.files'; {remedy}"
        )
        # A refusal is the line's own word, whatever the supervisor's age.
        with pytest.raises(RemoteError) as refused:
            await live.mutate(entry.id, "rollback", to=7)
        assert str(refused.value) == "checkpoints/u00000007: no such checkpoint"
        for attachment in list(live._attachments.values()):
            await attachment.stop()

    try:
        asyncio.run(scenario())
    finally:
        server.close()
        registry.unregister(entry)
