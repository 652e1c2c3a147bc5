"""Branch, tune and rollback through a real supervisor's socket, on a tiny CPU line.

One scenario, because every trainer launch pays for importing torch. Only cycle 0 is prepared
and no preparer runs, so the trainer ends cycle 0 and then waits for cycle 1, alive: a branch of
cycle 0 forks at once, one of cycle 1 is queued; a tune stops the trainer, writes run.json and
relaunches it; a rollback leaves the line resumed from the checkpoint it names; once cycle 1 is
prepared and trained, the queued branch is forked at its end. Each branch's own supervisor is
started by the trunk's; the test stops it over its socket, and no process of the test's lines
outlives it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from helpers.lines import copy_data_line, make_data_line, make_line
from helpers.supervise import RUNNER, kill_line_processes, stop_supervisor, wait_for

from datalines import open_data_line
from datalines.preparer import prepare_cycle
from engine.checkpoints.format import branched_from, list_checkpoints, read_latest
from engine.config.run import RunConfig
from engine.layout import LineLayout
from engine.ops.branch_records import read_branches
from engine.ops.rollback_records import rollback_times
from engine.supervisor import registry
from nsconsole.client import RemoteError, SupervisorClient

pytestmark = pytest.mark.usefixtures("private_host")  # conftest: an empty host.json, a private runtime dir

UNTUNED_ROWS = 24
"""A micro-batch size tune never picks: more rows than an update holds (16), so tune measures the
line's current rows as the update's (it tries powers of two and those): run.json's change shows."""


def kept_reasons(line: Path) -> dict[int, str]:
    found = {}
    for directory in list_checkpoints(line / "checkpoints"):
        kept = json.loads((directory / "state.json").read_text()).get("kept")
        if kept:
            found[int(directory.name[1:])] = kept
    return found


def mutate(client: SupervisorClient, method: str, request_id: str, **params: object) -> dict:
    return client.call(method, request_id=request_id, **params)


@pytest.mark.slow
def test_branch_tune_and_rollback_through_the_socket(tmp_path: Path) -> None:
    data = make_data_line(tmp_path / "data_root", prepare=1)
    line = make_line(tmp_path, data)
    for name in ("run.json", "accepted_run.json"):
        config = RunConfig.load(line / name)
        config.lengths[0].micro_batch_rows = UNTUNED_ROWS
        config.save(line / name)
    branch_data = copy_data_line(data, tmp_path / "branch_data")  # the same tokenizer
    b1_data = copy_data_line(data, tmp_path / "b1_data")  # each branch trains on a data line of its own
    runner = tmp_path / "runner.py"
    runner.write_text(RUNNER)
    settings = {"poll_seconds": 0.1, "relaunch_delay_seconds": 0.05, "run_preparer": False}
    supervisor = subprocess.Popen([sys.executable, str(runner), str(line), json.dumps(settings)])
    try:
        deadline = time.monotonic() + 60
        while registry.find_supervisor(line) is None:
            assert time.monotonic() < deadline and supervisor.poll() is None
            time.sleep(0.05)
        with SupervisorClient(line / "supervisor.sock", timeout=120) as client:
            client.subscribe(since_seq=0)
            wait_for(client, "heartbeat", lambda beat: beat["stage"] == "waiting-data" and beat["cycle"] == 1)
            cycle_end = next(update for update, kept in kept_reasons(line).items() if kept == "cycle-end 0")
            assert client.call("status")["parent"] is None  # a trunk

            # Cycle 0 has ended: the branch is forked now.
            reply = mutate(client, "branch", "b0", path=str(tmp_path / "b0"), at_cycle=0,
                           plan="decay:1024", data=str(branch_data))  # fmt: skip
            assert reply["state"] == "forked" and reply["fork_update"] == cycle_end
            assert read_latest(tmp_path / "b0" / "checkpoints") == f"u{cycle_end:08d}"
            event = wait_for(client, "event", lambda event: event["event"] == "branched")
            assert event["path"] == str(tmp_path / "b0") and event["started"] is True
            stop_supervisor(tmp_path / "b0")
            assert branched_from(LineLayout(tmp_path / "b0")) == str(line)  # the branch's status.parent
            # A retry with the same request_id is answered, not forked twice; a new one is refused.
            assert mutate(client, "branch", "b0", path=str(tmp_path / "b0"), at_cycle=0,
                          plan="decay:1024", data=str(branch_data)) == reply  # fmt: skip
            with pytest.raises(RemoteError, match="already exists") as refused:
                mutate(client, "branch", "b0-again", path=str(tmp_path / "b0"), at_cycle=0,
                       plan="decay:1024", data=str(branch_data))  # fmt: skip
            assert refused.value.code == -32010

            # Cycle 1 has not ended: queued (in supervisor.json too), forked at its end below.
            reply = mutate(client, "branch", "b1", path="b1", at_cycle=1, plan="decay:1024",
                           data=str(b1_data))  # a relative path: beside the line  # fmt: skip
            assert reply == {"state": "queued", "path": str(tmp_path / "b1"), "at_cycle": 1}
            assert not (tmp_path / "b1").exists()
            queued = json.loads((line / "supervisor.json").read_text())["queued_forks"]
            assert [fork["path"] for fork in queued] == [str(tmp_path / "b1")]
            assert [fork["path"] for fork in client.call("status")["queued_forks"]] == [str(tmp_path / "b1")]

            # Tune: the trainer stops, run.json gets the measured shape, the trainer is relaunched.
            first_trainer = client.call("status")["trainer_pid"]
            reply = mutate(client, "tune", "tune-1", shared=False)
            [length] = reply["lengths"]
            tuned = RunConfig.load(line / "run.json").lengths[0]
            assert length == {"seq_len": tuned.seq_len, "micro_batch_rows": tuned.micro_batch_rows,
                              "recompute": tuned.recompute}  # fmt: skip
            assert tuned.micro_batch_rows != UNTUNED_ROWS
            assert wait_for(client, "event", lambda event: event["event"] == "tuned")["result"] == reply
            relaunched = wait_for(client, "event", lambda event: event["event"] == "launched")
            assert int(relaunched["message"].split("pid ")[1].rstrip(")")) != first_trainer
            assert not psutil.pid_exists(first_trainer) or psutil.Process(first_trainer).status() == "zombie"
            assert "chosen" in (line / "run.log").read_text()  # tune's table went to run.log

            # Rollback to the rolling checkpoint before the cycle end: resumed from it.
            updates = [int(directory.name[1:]) for directory in list_checkpoints(line / "checkpoints")]
            earlier = max(update for update in updates if update < cycle_end)
            reply = mutate(client, "rollback", "rollback-1", to=earlier)
            assert reply["to_update"] == earlier and 0 in reply["reopened_cycles"]
            rolled_back = wait_for(client, "event", lambda event: event["event"] == "rolled_back")
            assert rolled_back["message"] == f"rollback done; the line continues from update {earlier}"
            assert client.call("status")["rollbacks"] == rollback_times(LineLayout(line)) != []
            wait_for(client, "row", lambda row: row["update"] == earlier + 1)  # trained again from there
            assert f"resumed from u{earlier:08d}" in (line / "run.log").read_text()
            assert f"rollback: done; the line continues from update {earlier}" in (line / "run.log").read_text()
            with pytest.raises(RemoteError, match="no such checkpoint"):
                mutate(client, "rollback", "rollback-2", to=10**6)

            # Cycle 1 comes and ends: the queued branch is forked at its kept checkpoint.
            wait_for(client, "heartbeat", lambda beat: beat["stage"] == "waiting-data" and beat["cycle"] == 1)
            prepare_cycle(open_data_line(data), 1)
            event = wait_for(client, "event", lambda event: event["event"] == "branched")
            assert event["path"] == str(tmp_path / "b1") and event["at_cycle"] == 1 and event["started"] is True
            stop_supervisor(tmp_path / "b1")
            assert kept_reasons(line)[event["fork_update"]] == "cycle-end 1"
            assert client.call("status")["queued_forks"] == []
            assert [record["line"] for record in read_branches(LineLayout(line))] == [
                str(tmp_path / "b0"), str(tmp_path / "b1"),
            ]
            client.call("stop", request_id="stop-1", at_cycle_end=None)
        assert supervisor.wait(timeout=120) == 0
    finally:
        if supervisor.poll() is None:
            supervisor.send_signal(signal.SIGKILL)
            supervisor.wait()
        heartbeat = json.loads((line / "heartbeat").read_text())
        if psutil.pid_exists(heartbeat["pid"]):
            psutil.Process(heartbeat["pid"]).kill()
        left_running = kill_line_processes(tmp_path)
    assert json.loads((line / "supervisor.json").read_text())["queued_forks"] == []
    assert left_running == []
