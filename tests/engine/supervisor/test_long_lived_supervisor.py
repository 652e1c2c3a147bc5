"""A supervisor of weeks: what it keeps per event, per relaunch, per client does not grow with their number.

`bench/long_lived.py` measures a real supervisor through thousands of rows, relaunches and clients;
these hold the fixes it led to.
"""

from __future__ import annotations

import gc
import shutil
import time
import tracemalloc
from pathlib import Path

import pytest
from helpers.lines import make_data_line, make_line

from engine.protocol.facts import EventKind
from engine.supervisor.server import SupervisorServer
from engine.supervisor.supervisor import Supervisor
from nsconsole.client import SupervisorClient

pytestmark = pytest.mark.usefixtures("private_host")  # conftest: an empty host.json, a private runtime dir

EVENTS = 40
RING = 8192
"""Notifications a supervisor's ring keeps (its default): a console's first subscribe replays them all."""
LEAVING_CLIENTS = 10


def test_a_supervisor_keeps_only_the_notifications_under_way(tmp_path: Path) -> None:
    # A real supervisor of a tiny line, its notify command a real one (`cat` reads the event and exits).
    supervisor = Supervisor(make_line(tmp_path, make_data_line(tmp_path, prepare=0)))
    supervisor._notify_command = shutil.which("cat")
    for number in range(EVENTS):
        supervisor._event(EventKind.SIGNAL_RESTART, f"the trainer stopped on a SIGTERM ({number})")
    for thread in list(supervisor._notifying):
        thread.join(timeout=30)
    supervisor._event(EventKind.SIGNAL_RESTART, "one more")
    # Before: every notification's finished thread (and its event) stayed for the supervisor's life.
    assert len(supervisor._notifying) == 1
    supervisor._notifying[0].join(timeout=30)
    assert "notify signal_restart failed" not in (supervisor.layout.run_log).read_text()


def test_clients_that_leave_mid_replay_leave_no_copy_of_the_ring_behind(tmp_path: Path) -> None:
    # A real server (its loop in its own thread, a real Unix socket) with its ring full of row-sized
    # notifications, and consoles that subscribe from seq 0 (a replay of the whole ring, as every
    # console's attach is) and go after the first notification. Each broken pipe leaves the replay's
    # frame in a reference cycle (through the exception's traceback) that only a full collection
    # frees: the collector is held off, as it is between two full collections of a busy supervisor,
    # and what the server keeps of the clients gone is measured.
    server = SupervisorServer(tmp_path / "supervisor.sock", handler=None)
    server.start()
    try:
        for number in range(RING):
            server.publish("row", {"update": number, "loss": 3.0, "grads": "0.123456789," * 40})
        gc.collect()
        gc.disable()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(LEAVING_CLIENTS):
                with SupervisorClient(tmp_path / "supervisor.sock") as client:
                    client.subscribe(since_seq=0)
                    client.next_notification(timeout=0.05)  # the replay has begun: the console goes
            deadline = time.monotonic() + 30
            while server._connections or server._serving:
                assert time.monotonic() < deadline, "the server did not see its clients go"
                time.sleep(0.05)
            kept = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
            gc.enable()
    finally:
        server.close()
    # Before: each left a copy of the ring's 8,192 entries (about 0.6 MB) in the garbage.
    assert kept < LEAVING_CLIENTS * 100_000, f"{kept / 2**20:.1f} MiB kept for {LEAVING_CLIENTS} clients gone"
