"""A preparer that fails for good (a pinned local file gone) under a real supervisor: not restarted,
said once in run.log with its reason and fix, notified, shown by `nsconsole status` (exit 3 while
the trainer waits for the cycle it will not make) and `data status`; once the file is back the same
supervisor starts it again, and it prepares. A failure that may pass is still restarted."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers.lines import make_data_line, make_line
from helpers.supervise import RUNNER, kill_line_processes

from datalines import open_data_line
from datalines.status import read_status
from engine.protocol.facts import StatusExitCode
from engine.supervisor.preparer import PreparerKeeper
from nsconsole.cli import main
from nsconsole.client import SupervisorClient

pytestmark = pytest.mark.usefixtures("private_host")

WAITING_TRAINER = r'''
import json, os, signal, sys, time
from engine.supervisor.child import die_with_parent
line = sys.argv[1]
if not die_with_parent(int(sys.argv[sys.argv.index("--parent") + 1])):
    sys.exit(128 + signal.SIGTERM)
terminated = []
signal.signal(signal.SIGTERM, lambda number, frame: terminated.append(number))
def beat(stage, **extra):
    temporary = os.path.join(line, ".heartbeat.stand-in")
    with open(temporary, "w") as handle:
        json.dump({"time": time.time(), "update": 10, "stage": stage, "pid": os.getpid(), **extra}, handle)
    os.replace(temporary, os.path.join(line, "heartbeat"))
stop = os.path.join(line, "STOP")
while not terminated and not os.path.exists(stop):
    beat("waiting-data", cycle=1)  # it trained cycle 0, the one prepared, and waits for cycle 1
    time.sleep(0.05)
if terminated:
    beat("stopped", reason="signal SIGTERM")
    sys.exit(128 + signal.SIGTERM)
os.remove(stop)
beat("stopped", reason="stop requested")
'''
"""The trainer's stand-in: it waits for data cycle 1 until it is stopped."""

NOTIFY = r'''
import json, sys
with open(sys.argv[1], "a") as handle:
    handle.write(json.dumps(json.load(sys.stdin)) + "\n")
'''


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def rig(tmp_path: Path, private_host: Path) -> Iterator[dict[str, Path]]:
    data = make_data_line(tmp_path, prepare=1, validation=())
    line = make_line(tmp_path, data)
    (tmp_path / "trainer.py").write_text(WAITING_TRAINER)
    (tmp_path / "runner.py").write_text(RUNNER)
    (tmp_path / "notify.py").write_text(NOTIFY)
    events = tmp_path / "events.jsonl"
    private_host.write_text(json.dumps({"notify": f"{sys.executable} {tmp_path / 'notify.py'} {events}"}))
    yield {"root": tmp_path, "data": data, "line": line, "corpus": tmp_path / "corpus", "events": events}
    kill_line_processes(tmp_path)


def start_supervisor(rig: dict[str, Path]) -> subprocess.Popen[bytes]:
    settings = {"poll_seconds": 0.05, "relaunch_delay_seconds": 0.05, "watchdog_seconds": 60,
                "preparer_recheck_seconds": 0.3,
                "trainer_command": [sys.executable, str(rig["root"] / "trainer.py")]}  # fmt: skip
    return subprocess.Popen([sys.executable, str(rig["root"] / "runner.py"), str(rig["line"]), json.dumps(settings)])


def stop(rig: dict[str, Path], supervisor: subprocess.Popen[bytes], request_id: str) -> None:
    """`nsconsole stop` over the socket (a request id of its own: a repeated one is answered, not done again)."""
    with SupervisorClient(rig["line"] / "supervisor.sock", timeout=60) as client:
        client.call("stop", request_id=request_id, at_cycle_end=None)
    assert supervisor.wait(timeout=60) == 0


def test_a_preparer_that_fails_for_good_is_not_restarted_and_the_line_says_why(
    rig: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    corpus, data, line = rig["corpus"], rig["data"], rig["line"]
    aside = rig["root"] / "corpus-aside"
    corpus.rename(aside)  # every file cycle 1 reads is gone (cycle 0 is prepared already)
    supervisor = start_supervisor(rig)
    run_log = line / "run.log"
    wait_until(lambda: run_log.exists() and "stopped for good" in run_log.read_text(), "the preparer's stop")
    wait_until(lambda: (json.loads((line / "heartbeat").read_text()) if (line / "heartbeat").exists() else {})
               .get("stage") == "waiting-data", "the trainer's wait")  # fmt: skip
    time.sleep(0.5)  # ten restart delays: a restart would have come by now

    log = run_log.read_text()
    assert log.count("data preparer started") == 1 and "restarting in" not in log
    [stopped] = [text for text in log.splitlines() if "stopped for good" in text]
    assert "preparer_failing: the data preparer stopped for good: " in stopped
    assert f"{corpus}/part" in stopped and "is gone since init" in stopped  # the reason, naming the file
    assert "restore " in stopped and "as `data init` pinned it" in stopped  # the fix
    assert "once it is fixed, this supervisor starts it again" in stopped
    [event] = [json.loads(text) for text in rig["events"].read_text().splitlines()]
    assert event["event"] == "preparer_failing" and event["stopped_for_good"] is True
    assert "is gone since init" in event["message"]
    status = read_status(data)[0]
    assert status["state"] == "failed" and "is gone since init" in status["last_error"]
    assert status["fix"].startswith("restore ")

    # `nsconsole status`: the line waits for data that will not come, so it needs its operator.
    assert main(["status", str(line)]) == StatusExitCode.NEEDS_OPERATOR == 3
    out = capsys.readouterr().out
    assert f"problem: data preparer of {data} stopped for good" in out
    assert "the trainer waits for data cycle 1, which no preparer will make" in out
    assert "last event: preparer_failing" in out
    assert main(["data", "status", "--work", str(data)]) == 3  # the operator must act, as for `status`
    out = capsys.readouterr().out
    assert "preparer: stopped for good (pid " in out and "is gone since init; to go on: restore " in out

    # The files back: the same supervisor sees them and starts the preparer again, which prepares.
    aside.rename(corpus)
    wait_until(lambda: (read_status(data)[0] or {}).get("state") == "ready", "the preparer's cycles")
    assert open_data_line(data).cycle_ready(1)
    log = run_log.read_text()
    assert "the data line's files changed since the preparer stopped for good (" in log
    assert log.count("data preparer started") == 2
    assert main(["status", str(line)]) == StatusExitCode.OK
    assert main(["data", "status", "--work", str(data)]) == 0
    capsys.readouterr()
    stop(rig, supervisor, "first-stop")


def test_a_failure_that_may_pass_is_still_restarted(tmp_path: Path) -> None:
    """A preparer exiting with any other status (a crash, a refused start) is restarted with backoff."""
    script = tmp_path / "failing.py"
    script.write_text("import sys\nprint('OSError: [Errno 28] No space left on device', flush=True)\nsys.exit(1)\n")
    said: list[str] = []
    stopped: list[str] = []
    keeper = PreparerKeeper(tmp_path, say=said.append, notify_failing=lambda _: None,
                            command=[sys.executable, str(script)], restart_delay=0.01,
                            notify_stopped=stopped.append)  # fmt: skip
    deadline = time.monotonic() + 60
    while sum("restarting in" in text for text in said) < 2:
        assert time.monotonic() < deadline, said
        keeper.tick()
        time.sleep(0.02)
    keeper.stop(timeout=5)
    assert not stopped and keeper.snapshot()["stopped_for_good"] is None
    restarts = [text for text in said if "restarting in" in text]
    assert all("No space left on device" in text for text in restarts)


FAILS_FOR_GOOD = r'''
import json, os, sys
work = sys.argv[sys.argv.index("--work") + 1]
status = {"pid": os.getpid(), "state": "failed", "last_error": "dataline.json: not JSON", "fix": "mend it"}
with open(os.path.join(work, "preparer.json"), "w") as handle:
    json.dump(status, handle)
sys.exit(78)
'''
"""A preparer's stand-in that stops for good at once, always for the same reason."""


def test_a_change_that_does_not_mend_it_is_said_but_not_notified_again_and_a_file_in_flux_is_waited_for(
    tmp_path: Path,
) -> None:
    script = tmp_path / "fails.py"
    script.write_text(FAILS_FOR_GOOD)
    config = tmp_path / "dataline.json"
    config.write_text("{broken")
    said: list[str] = []
    notified: list[str] = []
    keeper = PreparerKeeper(tmp_path, say=said.append, notify_failing=notified.append,
                            command=[sys.executable, str(script)], notify_stopped=notified.append,
                            recheck_delay=0.05)  # fmt: skip

    def tick_until(condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + 60
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {said}"
            keeper.tick()
            time.sleep(0.01)

    tick_until(lambda: keeper.snapshot()["stopped_for_good"] is not None, "the first stop")
    assert len(notified) == 1 and "dataline.json: not JSON; mend it" in notified[0]
    # A file rewritten at every look (a copy under way) is not taken until it holds still.
    for number in range(30):
        config.write_text("{still broken" + "!" * number)  # a new size before every look
        keeper.tick()
        time.sleep(0.02)
    assert sum("data preparer started" in text for text in said) == 1
    # It holds still: started again, it stops for good for the same reason: said, not notified.
    tick_until(lambda: any("stopped for good again" in text for text in said), "the second stop")
    assert sum("data preparer started" in text for text in said) == 2
    assert any("the data line's files changed since the preparer stopped for good" in text for text in said)
    assert len(notified) == 1
