"""The console's lasting link to a supervisor: reconnect with backoff across a supervisor restart,
re-subscribe without losing or repeating notifications, and refetch on every connection."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from engine.supervisor.server import SupervisorServer
from nsconsole.client import AsyncSupervisorClient, Notification, SupervisorLink, SupervisorUnavailable


class Counter:
    def __init__(self) -> None:
        self.value = 0
        self.lock = threading.Lock()  # reads run on several worker threads

    def status(self) -> dict[str, Any]:
        with self.lock:
            self.value += 1
            return {"calls": self.value}


async def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_the_link_survives_a_supervisor_restart(tmp_path: Path) -> None:
    socket_path = tmp_path / "supervisor.sock"
    connected: list[dict[str, Any]] = []
    seen: list[tuple[str, int, Any]] = []
    losses: list[str] = []

    async def on_connected(client: AsyncSupervisorClient) -> None:
        connected.append(await client.call("status"))  # the console refetches its state here

    async def on_notification(notification: Notification) -> None:
        seen.append((notification.epoch, notification.seq, notification.data["n"]))

    async def on_disconnected(reason: str) -> None:
        losses.append(reason)

    async def scenario() -> None:
        first = SupervisorServer(socket_path, Counter())
        first.start()
        link = SupervisorLink(
            socket_path, on_connected, on_notification, on_disconnected, initial_backoff=0.05
        )
        task = asyncio.create_task(link.run())
        await wait_until(lambda: len(connected) == 1)
        for n in range(3):
            first.publish("row", {"n": n})
        await wait_until(lambda: len(seen) == 3)
        first.close()  # the supervisor goes away ...
        await wait_until(lambda: len(losses) >= 1)
        second = SupervisorServer(socket_path, Counter())
        second.publish("row", {"n": 100})  # published before the link is back: replayed from the ring
        second.start()
        await wait_until(lambda: len(connected) == 2)
        second.publish("row", {"n": 101})
        await wait_until(lambda: len(seen) == 5)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        second.close()
        assert [entry[1:] for entry in seen] == [(1, 0), (2, 1), (3, 2), (1, 100), (2, 101)]
        assert seen[0][0] == first.epoch and seen[3][0] == second.epoch
        assert connected == [{"calls": 1}, {"calls": 1}]

    asyncio.run(scenario())


def test_the_async_client_calls_and_receives(tmp_path: Path) -> None:
    async def scenario() -> None:
        with SupervisorServer(tmp_path / "supervisor.sock", Counter()) as server:
            client = AsyncSupervisorClient(server.socket_path)
            hello = await client.connect()
            assert hello["epoch"] == server.epoch
            results = await asyncio.gather(*(client.call("status") for _ in range(5)))
            assert sorted(result["calls"] for result in results) == [1, 2, 3, 4, 5]
            await client.call("subscribe", since_seq=None)
            server.publish("event", {"n": 1})
            notification = await asyncio.wait_for(client.notifications.get(), 5)
            assert notification.kind == "event" and notification.data == {"n": 1}
            await client.close()

    asyncio.run(scenario())


class SlowTuner:
    """A handler whose mutation answers only once its work is done, as the supervisor's tune does."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def tune(self, shared: bool) -> dict[str, Any]:
        time.sleep(self.seconds)
        return {"shared": shared, "lengths": []}


def test_a_mutation_may_answer_later_than_a_read_without_failing_the_call(tmp_path: Path) -> None:
    async def scenario() -> None:
        with SupervisorServer(tmp_path / "supervisor.sock", SlowTuner(0.6)) as server:
            client = AsyncSupervisorClient(server.socket_path, timeout=0.2)
            await client.connect()
            with pytest.raises(SupervisorUnavailable, match="tune got no reply"):
                await client.call("tune", shared=False, request_id="first")
            # The same request again (the first still runs: the retry waits on it), with the
            # console's patience for mutations: the answer arrives.
            result = await client.call("tune", reply_timeout=5.0, shared=False, request_id="first")
            assert result == {"shared": False, "lengths": []}
            await client.close()

    asyncio.run(scenario())
