"""What an operator finds on coming back to a line left unattended (found walking a line's life
through kills, stops and notifications), driven by test_supervise's scripted stand-in trainer with
the real supervisor process, socket and notify command around it."""

from __future__ import annotations

import json
import shlex
import sys
import time

import test_supervise
from test_supervise import Rig

from engine.ops.stop import request_stop

rig, run_json = test_supervise.rig, test_supervise.run_json  # its fixtures, for these tests too


def test_a_trainer_hung_while_it_waits_for_data_is_the_watchdogs_not_a_data_wait(rig: Rig) -> None:
    # It stopped beating while it waited: a data_wait sent the operator to the data line, wrongly.
    rig.start(["hang-waiting-data", "finish"], watchdog_seconds=1.0)
    assert rig.finish() == 0
    assert rig.launches() == ["hang-waiting-data", "finish"]
    assert [event["event"] for event in rig.notified("finished")] == ["watchdog_restart", "finished"]


def test_a_notify_command_that_fails_is_said_in_run_log(rig: Rig) -> None:
    # Said only in supervisor.out before: an operator who heard nothing looked in run.log and found nothing.
    failing = "import sys; sys.stdin.read(); print('no route to the pager', file=sys.stderr); sys.exit(3)"
    (rig.root / "host.json").write_text(json.dumps({"notify": shlex.join([sys.executable, "-c", failing])}))
    rig.start(["sigterm", "finish"])
    assert rig.finish() == 0
    assert rig.state()["state"] == "finished"  # a failing notifier stops nothing
    run_log = (rig.line / "run.log").read_text()
    for kind in ("signal_restart", "finished"):
        assert f"supervisor: notify {kind} failed: {sys.executable} exited with status 3: no route to the pager" \
            in run_log


def test_a_stop_pending_from_before_a_start_is_discarded_and_the_line_runs(rig: Rig) -> None:
    # `nsconsole stop` beside the orphan trainer of a killed supervisor left a STOP nothing served: the
    # next start stopped at once, and `nsconsole run` said "the supervisor did not start: exit status 0".
    request_stop(rig.line)
    rig.start(["train-until-stop", "finish"])
    deadline = time.monotonic() + 30
    while not (rig.line / "rows.jsonl").exists():  # its trainer trains, not stopped by the old STOP
        assert time.monotonic() < deadline, "the line never trained"
        time.sleep(0.05)
    with rig.wait_for_socket() as client:
        client.mutate("stop")  # a stop asked of this supervisor is served
    assert rig.finish() == 0
    assert rig.launches() == ["train-until-stop"]
    assert rig.state()["state"] == "stopped" and not (rig.line / "STOP").exists()
    assert "was pending from before this start, with nothing to serve it: discarded" in \
        (rig.line / "run.log").read_text()


def test_a_stop_at_a_cycle_end_pending_at_a_start_stays(rig: Rig) -> None:
    request_stop(rig.line, at_cycle_end=4)
    rig.start(["finish"])
    assert rig.finish() == 0
    assert rig.launches() == ["finish"]
    assert json.loads((rig.line / "STOP").read_text())["at_cycle_end"] == 4
    assert "discarded" not in (rig.line / "run.log").read_text()
