"""The socket fuzz (issue 25, item 8): a real supervisor on a tiny line, 100 concurrent clients
sending malformed input, well-formed mutations with bad values and repeated request ids. No
crash, no hang, no change of the line's state. `bench/socket_fuzz.py` runs it longer."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from helpers.lines import make_data_line, make_line
from helpers.socket_fuzz import fuzz_concurrently, line_state, state_changes
from helpers.supervise import gone, start_supervisor, stop_supervisor

from engine.supervisor import registry
from nsconsole.client import SupervisorClient

pytestmark = pytest.mark.usefixtures("private_host")  # conftest: an empty host.json, a private runtime dir


def _status(line: Path) -> dict:
    with SupervisorClient(line / "supervisor.sock", timeout=30) as client:
        return client.call("status")


@pytest.mark.slow
def test_a_hundred_fuzzing_clients_neither_crash_nor_hang_nor_move_the_line(tmp_path: Path) -> None:
    # No cycle and no preparer: the trainer checkpoints update 0 and waits for data, so nothing
    # but the fuzz could change the line's state.
    line = make_line(tmp_path / "lines", make_data_line(tmp_path, prepare=0))
    supervisor = start_supervisor(tmp_path, line, run_preparer=False)
    try:
        deadline = time.monotonic() + 120
        while (status := _status(line) if registry.find_supervisor(line) else {}).get("trainer_pid") is None \
                or status.get("latest_checkpoint") is None:
            assert supervisor.poll() is None and time.monotonic() < deadline, "the line did not start"
            time.sleep(0.2)
        before = line_state(line, status)

        tally = fuzz_concurrently(line / "supervisor.sock", clients=100, messages_each=5, seed=25)

        assert supervisor.poll() is None, "the supervisor crashed"
        after = line_state(line, _status(line))  # it still answers
        assert tally.messages == 500 and tally.hangs == 0 and tally.internal_errors == 0, tally
        assert tally.replies >= tally.messages - tally.reconnects
        assert state_changes(before, after) == 0, (before, after)
        stop_supervisor(line)
    finally:
        if not gone(supervisor.pid):
            supervisor.kill()
