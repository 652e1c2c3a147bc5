"""A pin that a supervisor killed with SIGKILL left in `checkpoints/pinned` goes at the next start.

The fork queue pins `cycle-end N` before it saves the queue in supervisor.json, and a branch asked
of an ended cycle is forked at once with its cycle end pinned, never queued; a rollback pins its
target. A supervisor killed in one of those windows left the pin, no restored queue took it back,
and retention kept that checkpoint for good. The next supervisor's start drops every such pin;
the pins of the forks it restores, and a checkpoint pinned by hand, stay.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
from helpers.lines import copy_data_line, make_data_line, make_line
from helpers.supervise import kill_line_processes, start_supervisor, stop_supervisor, wait_for

from engine.checkpoints.format import (
    PINNED_NAME,
    pin_checkpoint,
    pin_cycle_end,
    read_pinned,
    restore_queue_pins,
    unpin_checkpoint,
)
from engine.errors import LineError
from engine.layout import LineLayout
from engine.ops.branch_records import BRANCHES_LOCK
from engine.supervisor import registry
from engine.supervisor.forks import ForkQueue, new_fork
from nsconsole.client import SupervisorClient

PLAN = "decay:1024"


def test_a_start_keeps_the_restored_queues_pins_and_hand_pins_and_drops_the_rest(tmp_path: Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    (checkpoints / PINNED_NAME).write_text(
        "cycle-end 1\ncycle-end 2\nu00000030  # rollback\nu00000020\nu00000010  # the best one so far\nu12\n"
    )
    queue = ForkQueue(LineLayout(tmp_path), on_forked=print, on_failed=print, on_change=lambda: None)
    forks = [dataclasses.asdict(new_fork(tmp_path / name, cycle, PLAN, tmp_path)) for name, cycle in (("b1", 1), ("b3", 3))]
    notes = queue.restore(forks)
    assert [fork["at_cycle"] for fork in queue.export()] == [1, 3]
    assert (checkpoints / PINNED_NAME).read_text() == (
        "cycle-end 1\nu00000020\nu00000010  # the best one so far\nu12\ncycle-end 3\n"
    )
    assert [note.split(": ", 1)[1].split(",")[0] for note in notes] == [
        'dropped the pin "cycle-end 2"', 'dropped the pin "u00000030  # rollback"',
        '"u12" pins nothing (a pin is a checkpoint\'s name'
    ]  # fmt: skip
    assert read_pinned(checkpoints) == {"cycle-end 1", "cycle-end 3", "u00000020", "u00000010"}

    # A rollback's pin of a checkpoint pinned by hand takes back its own pin only.
    pin_checkpoint(checkpoints, "u00000020")
    unpin_checkpoint(checkpoints, "u00000020")
    assert "u00000020" in read_pinned(checkpoints)
    # No queue and no hand pin: the file goes.
    (checkpoints / PINNED_NAME).write_text("cycle-end 4\n")
    assert restore_queue_pins(checkpoints, set()) == ["cycle-end 4"]
    assert not (checkpoints / PINNED_NAME).exists()
    pin_cycle_end(checkpoints, 5)
    assert restore_queue_pins(checkpoints, {5}) == [] and read_pinned(checkpoints) == {"cycle-end 5"}


def test_a_pin_file_that_cannot_be_read_is_named_and_left_as_it_is(tmp_path: Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    (checkpoints / PINNED_NAME).write_bytes(b"u00000020\n\xff\xfe\n")
    queue = ForkQueue(LineLayout(tmp_path), on_forked=print, on_failed=print, on_change=lambda: None)
    assert queue.restore([]) == [f"{checkpoints / PINNED_NAME}: not UTF-8 text; make it one pin a line, or remove it"]
    assert (checkpoints / PINNED_NAME).read_bytes() == b"u00000020\n\xff\xfe\n"  # nothing in it is lost
    with pytest.raises(LineError, match="pinned: not UTF-8 text"):
        pin_cycle_end(checkpoints, 1)  # a branch queued now is refused, saying why


def _wait(condition: object, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.usefixtures("private_host")  # conftest: an empty host.json, a private runtime dir
def test_the_pin_of_a_supervisor_killed_while_forking_goes_at_the_next_start(tmp_path: Path) -> None:
    """The real window: a branch of an ended cycle is forked at once, its cycle end pinned meanwhile;
    the fork is held (the trunk's branches.lock, which the fork takes last) and the supervisor is
    killed with SIGKILL. Its queued branch of cycle 2 is in supervisor.json; the fork of cycle 0 is
    not. Before, `cycle-end 0` stayed pinned for good."""
    data = make_data_line(tmp_path / "data_root", prepare=1)  # cycle 0 only: the trainer then waits, alive
    line = make_line(tmp_path, data, **{"wandb.mode": "disabled"})
    layout = LineLayout(line)
    branch_data = {name: str(copy_data_line(data, tmp_path / f"{name}_data")) for name in ("b0", "b2")}
    supervisor = start_supervisor(tmp_path, line, run_preparer=False)
    try:
        _wait(lambda: registry.find_supervisor(line), "the supervisor to register")
        with SupervisorClient(line / "supervisor.sock", timeout=120) as client:
            client.subscribe(since_seq=0)
            wait_for(client, "heartbeat", lambda beat: beat["stage"] == "waiting-data" and beat["cycle"] == 1)
            reply = client.call("branch", request_id="b2", path=str(tmp_path / "b2"), at_cycle=2, plan=PLAN,
                                data=branch_data["b2"])  # fmt: skip
            assert reply["state"] == "queued" and read_pinned(layout.checkpoints) == {"cycle-end 2"}
            trainer = client.call("status")["trainer_pid"]

        with open(line / BRANCHES_LOCK, "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the fork of cycle 0 waits here, its cycle end pinned

            def fork_at_once() -> None:
                try:
                    with SupervisorClient(line / "supervisor.sock", timeout=120) as client:
                        client.call("branch", request_id="b0", path=str(tmp_path / "b0"), at_cycle=0, plan=PLAN,
                                    data=branch_data["b0"])  # fmt: skip
                except Exception:  # noqa: BLE001 - the supervisor is killed before it answers
                    pass

            asking = threading.Thread(target=fork_at_once, daemon=True)
            asking.start()
            _wait(lambda: "cycle-end 0" in read_pinned(layout.checkpoints) and (tmp_path / "b0").is_dir(),
                  "the fork of cycle 0 to be under way")
            os.kill(supervisor.pid, signal.SIGKILL)
            supervisor.wait()
        asking.join(timeout=60)
        psutil.Process(trainer).wait(timeout=120)  # it saw its supervisor die
        _wait(lambda: registry.find_supervisor(line) is None, "the killed supervisor's entry to go stale")
        assert read_pinned(layout.checkpoints) == {"cycle-end 0", "cycle-end 2"}  # the stale pin
        with open(layout.checkpoints / PINNED_NAME, "a") as pins:
            pins.write("u00000005  # kept by hand\n")

        supervisor = start_supervisor(tmp_path, line, run_preparer=False)
        _wait(lambda: registry.find_supervisor(line), "the next supervisor to register")
        assert read_pinned(layout.checkpoints) == {"cycle-end 2", "u00000005"}
        log = (line / "run.log").read_text()
        assert f'{layout.checkpoints / PINNED_NAME}: dropped the pin "cycle-end 0", left by a supervisor' in log
        with SupervisorClient(line / "supervisor.sock", timeout=120) as client:
            assert [fork["at_cycle"] for fork in client.call("status")["queued_forks"]] == [2]
        stop_supervisor(line)
        assert json.loads((line / "supervisor.json").read_text())["queued_forks"][0]["at_cycle"] == 2
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
        kill_line_processes(tmp_path)
