"""`nsconsole resume` after a reboot, on the lines a walkthrough of unattended lines found it failing:
one whose trainer finished it before its supervisor could say so (every boot's resume failed on it,
and it read as lost for good), and one lost with a stop pending (started, it stopped at once, and the
start was reported as a supervisor that "did not start")."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import pytest
from helpers.lines import make_data_line, make_line
from helpers.supervise import gone, kill_line_processes
from test_resume_lost import dead_pid, write_supervisor_json

from engine.ops.stop import request_stop
from engine.supervisor import registry
from nsconsole.cli import main

pytestmark = pytest.mark.usefixtures("private_host")  # conftest: an empty host.json, a private runtime dir

NOTIFY = """\
import json, sys
with open(sys.argv[1], "a") as handle:
    handle.write(json.dumps(json.load(sys.stdin)) + "\\n")
"""


def line_in_work_root(tmp_path: Path, host: Path, **settings: str) -> Path:
    """A tiny line (one data cycle, prepared) in host.json's work root, where `resume` looks."""
    work_root = tmp_path / "lines"
    host.write_text(json.dumps({"work_root": str(work_root), **settings}))
    return make_line(work_root, make_data_line(tmp_path / "data_root", files=1))


def lose_its_supervisor(line: Path, pid: int) -> None:
    """supervisor.json as a supervisor leaves it when the host goes down under it: the state it was in
    (`training`), naming a process that runs no more; and its registry entry."""
    document = json.loads((line / "supervisor.json").read_text()) if (line / "supervisor.json").exists() else {}
    write_supervisor_json(line, **{**document, "pid": pid, "boot_start": None, "state": "training"})
    entry = registry.register(line, line / "supervisor.sock")  # this process's, then made the lost one's
    (registry.runtime_dir() / f"{entry.id}.json").write_text(json.dumps({**dataclasses.asdict(entry), "pid": pid}))


@pytest.mark.slow
def test_a_line_finished_before_its_supervisor_was_lost_is_recorded_as_finished(
    tmp_path: Path, private_host: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    events = tmp_path / "events.jsonl"
    (tmp_path / "notify.py").write_text(NOTIFY)
    line = line_in_work_root(tmp_path, private_host, notify=f"{sys.executable} {tmp_path / 'notify.py'} {events}")
    assert main(["run", str(line), "--no-supervisor"]) == 0  # trains it to its data line's end
    lost = dead_pid()
    lose_its_supervisor(line, lost)
    capsys.readouterr()

    assert main(["resume", "--dry-run"]) == 0
    ended = f"it had finished (it trained every cycle of its data line, 0 to 0) when its supervisor (pid {lost}) was lost"
    assert capsys.readouterr().out == f"would record {line} as finished ({ended})\n"
    assert json.loads((line / "supervisor.json").read_text())["state"] == "training"  # a dry run writes nothing

    assert main(["resume"]) == 0
    assert capsys.readouterr().out == f"{line}: recorded as finished ({ended}); nothing to resume\n"
    supervisor = json.loads((line / "supervisor.json").read_text())
    assert supervisor["state"] == "finished" and supervisor["last_event"]["event"] == "finished"
    [event] = [json.loads(text) for text in events.read_text().splitlines()]  # told once, as its supervisor would
    assert (event["event"], event["line"], event["update"]) == ("finished", str(line), supervisor["last_event"]["update"])
    assert "its data line" in event["message"]
    assert registry.find_supervisor(line) is None and list((registry.runtime_dir()).glob("*.json")) == []

    assert main(["status", str(line)]) == 0
    assert "state: finished\n" in capsys.readouterr().out
    assert main(["resume"]) == 0  # the next boot's resume has nothing to do
    assert capsys.readouterr().out == "no line's supervisor was lost (1 line(s) looked at)\n"
    assert len(events.read_text().splitlines()) == 1

    # A notifier that fails is one line on stderr naming the line and the event, as run.log's would.
    (tmp_path / "failing.py").write_text("import sys\nsys.stdin.read()\nsys.exit('Traceback:\\nOSError: pager down')\n")
    host = json.loads(private_host.read_text())
    private_host.write_text(json.dumps({**host, "notify": f"{sys.executable} {tmp_path / 'failing.py'}"}))
    lose_its_supervisor(line, lost)
    assert main(["resume"]) == 0
    told = capsys.readouterr()
    assert told.out == f"{line}: recorded as finished ({ended}); nothing to resume\n"
    assert told.err == (f"nsconsole: {line}: notify finished failed: {sys.executable} exited with status 1: "
                        "Traceback: | OSError: pager down\n")


@pytest.mark.slow
def test_a_line_lost_with_a_stop_pending_is_left_alone_and_run_starts_it(
    tmp_path: Path, private_host: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = line_in_work_root(tmp_path, private_host)
    lose_its_supervisor(line, dead_pid())
    stop = request_stop(line)  # asked of the orphan trainer finishing its checkpoint, or just before the reboot
    try:
        assert main(["resume"]) == 0
        assert capsys.readouterr().out == (
            f"{line}: left alone, a stop was pending (requested {stop.requested}) when its supervisor (pid "
            f"{json.loads((line / 'supervisor.json').read_text())['pid']}) was lost; `nsconsole run {line}` starts it\n"
        )
        assert registry.find_supervisor(line) is None

        assert main(["run", str(line), "--stop-at", "2"]) == 0  # was 2: "the supervisor did not start: exit status 0"
        supervisor_pid = int(capsys.readouterr().out.split("(pid ", 1)[1].split(")", 1)[0])
        deadline = time.monotonic() + 240
        while not gone(supervisor_pid):  # it ends the line at update 2, then exits
            assert time.monotonic() < deadline, "the line never reached --stop-at 2"
            time.sleep(0.2)
        assert json.loads((line / "supervisor.json").read_text())["state"] == "finished"
        assert (line / "checkpoints" / "latest").read_text().strip() == "u00000002"
        assert "was pending from before this start, with nothing to serve it: discarded" in (line / "run.log").read_text()
    finally:
        assert kill_line_processes(tmp_path) == []
