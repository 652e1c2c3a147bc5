"""One host running many lines (a walkthrough: a trunk and its branch, another experiment on its
own data line, a line finished, one failed, one never started), as the user sees them:

- the console lists a branch right after its trunk, not scattered by name among the other lines;
- a finished branch whose directory the user removed by hand leaves the console's table (it stayed
  listed, read from files no longer there, until the console was restarted), and the others stay;
- `nsconsole status` with no LINE (a usage error before) or with a directory of lines reports every
  line in one line each, and exits 3 when any needs the user;
- a line whose data preparer waits for free disk (one other lines filled) says so in `status` and in
  the console, not only in `data status`; so does one whose preparer.json is damaged;
- the console's `R` refuses what `nsconsole run` refuses (a data line another line trains on).

The lines are real: the trunk trains (in this process) past its first cycle's end, `nsconsole
branch` forks the branch there, and each line's supervisor is a real one, run with a stand-in
trainer that ends at once (0: the line is finished; 2: a line error, it fails) or waits for data.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.console import until
from helpers.lines import make_data_line, make_line, one_torch_thread
from helpers.supervise import RUNNER, end_line_processes, stop_supervisor

from engine.supervisor import registry
from engine.supervisor.registry import line_id
from engine.training.trainer import Trainer
from nsconsole.app import ConsoleApp
from nsconsole.cli import main
from nsconsole.state import LineView
from nsconsole.widgets.lines_table import LinesTable

pytestmark = pytest.mark.usefixtures("private_host")  # conftest: a host.json and a runtime dir of the test's own

STAND_IN = "import sys; sys.exit(int(sys.argv[1]))"
"""The trainer a line's supervisor launches here: it exits with its first argument at once."""


def supervise_at_once(root: Path, ends: dict[Path, int]) -> None:
    """A real supervisor for each line, all at once, each until its line is over: its trainer exits
    with the line's code once (0: the line finishes; 2: a line error, it fails)."""
    (root / "runner.py").write_text(RUNNER)
    (root / "stand_in.py").write_text(STAND_IN)
    supervisors = []
    for line, code in ends.items():
        settings = {"poll_seconds": 0.05, "relaunch_delay_seconds": 0.05, "run_preparer": False,
                    "trainer_command": [sys.executable, str(root / "stand_in.py"), str(code)]}  # fmt: skip
        supervisors.append(subprocess.Popen([sys.executable, str(root / "runner.py"), str(line), json.dumps(settings)]))
    for supervisor in supervisors:
        supervisor.wait(timeout=60)
    for line, code in ends.items():
        state = json.loads((line / "supervisor.json").read_text())["state"]
        assert state == ("finished" if code == 0 else "failed"), (line, state)


def line_at(work: Path, name: str, data: Path) -> Path:
    """A tiny training line `work/name` on `data`."""
    made = make_line(work / f".{name}", data, **{"wandb.mode": "disabled"})
    return made.rename(work / name)


@pytest.fixture
def host_lines(tmp_path: Path, private_host: Path) -> dict[str, Path]:
    """The walkthrough's lines in host.json's work root: `trunk` (finished) and its branch `b1`
    (finished), `exp` on a data line of its own (failed), `fresh` (never started)."""
    work = tmp_path / "lines"
    work.mkdir()
    private_host.write_text(json.dumps({"work_root": str(work)}))
    data = {name: make_data_line(tmp_path / f"data-{name}", files=2) for name in ("trunk", "b1", "exp")}
    lines = {name: line_at(work, name, data[name]) for name in ("trunk", "exp")}
    lines["fresh"] = line_at(work, "fresh", data["exp"])  # made, never started: nothing took its data line
    with one_torch_thread():
        assert Trainer(lines["trunk"], stop_at=12, echo=None).run() == 0  # past the end of cycle 0
    branch = ["branch", str(work / "b1"), "--from", str(lines["trunk"]), "--at-cycle", "0", "--plan", "decay:1024",
              "--data", str(data["b1"])]  # fmt: skip
    assert main(branch) == 0
    lines["b1"] = work / "b1"
    supervise_at_once(tmp_path, {lines["trunk"]: 0, lines["b1"]: 0, lines["exp"]: 2})
    return lines


def test_the_console_lists_a_branch_after_its_trunk_and_drops_a_line_removed_by_hand(
    host_lines: dict[str, Path],
) -> None:
    keys = {name: line_id(path) for name, path in host_lines.items() if name != "fresh"}

    async def scenario() -> None:
        app = ConsoleApp(refresh_interval=0.1)
        assert app.live is not None
        app.live.history_interval = 0.1  # ended lines are looked for at every discovery, not every 10 s
        async with app.run_test(size=(160, 40)) as pilot:
            table = app.screen.query_one(LinesTable)
            await until(pilot, lambda: set(keys.values()) <= set(table.rows), "every line's row", 60)
            # By path, a branch after the line it was forked from: exp, trunk, then trunk's b1.
            assert [row.key.value for row in table.ordered_rows] == [keys["exp"], keys["trunk"], keys["b1"]]
            assert str(table.get_cell(keys["b1"], "kind")) == "branch of trunk"
            await pilot.press("down", "down")
            assert table.selected_key == keys["b1"]
            shutil.rmtree(host_lines["b1"])
            await until(pilot, lambda: keys["b1"] not in table.rows, "the removed branch's row to go", 30)
            assert app.book.get(keys["b1"]) is None
            assert [row.key.value for row in table.ordered_rows] == [keys["exp"], keys["trunk"]]
            assert table.selected_key == keys["trunk"]  # the cursor on a line still there
            assert str(table.get_cell(keys["trunk"], "state")) == "✓ finished"
            assert str(table.get_cell(keys["exp"], "state")) == "✗ failed"

    asyncio.run(scenario())


def test_status_with_no_line_reports_every_line_of_the_host_in_one_line_each(
    host_lines: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    trunk, b1, exp, fresh = (host_lines[name] for name in ("trunk", "b1", "exp", "fresh"))
    assert main(["status"]) == 3  # exp failed: it needs the user
    report = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in report[:-1]] == [
        str(exp), str(fresh), f"{trunk} (update 12)", f"{b1} (update 10)"
    ]
    assert report[0] == f"{exp}: failed (last: the trainer refused to run the line)"
    assert report[1] == f"{fresh}: no supervisor has run this line (no supervisor.json)"
    assert report[2] == f"{trunk} (update 12): finished"
    assert report[3] == f"{b1} (update 10): finished; branch of {trunk}"  # its fork checkpoint
    assert report[-1] == "4 line(s): 0 running, 1 need you (`nsconsole status LINE` gives one line's whole report)"
    # A directory of lines: those lines. One removed by hand is no longer reported.
    shutil.rmtree(b1)
    assert main(["status", str(trunk.parent)]) == 3
    assert [line.split(" ")[0].rstrip(":") for line in capsys.readouterr().out.splitlines()[:-1]] == [
        str(exp), str(fresh), str(trunk)
    ]
    shutil.rmtree(exp)
    assert main(["status"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("2 line(s): 0 running (")


def test_status_with_no_line_loads_no_torch(tmp_path: Path) -> None:
    """Like `nsconsole status LINE`, the report of every line is a light command (no torch)."""
    from test_cli_startup import imported_heavy

    environment = {**os.environ, "HOME": str(tmp_path), "PYTHONPATH": os.pathsep.join(sys.path)}
    status, heavy, messages = imported_heavy(["status"], environment)
    assert (status, heavy) == (0, []), messages


WAITING_TRAINER = r'''
import json, os, signal, sys, time
line, stopping = sys.argv[1], []
signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
while not stopping and not os.path.exists(os.path.join(line, "STOP")):  # waits for data cycle 0
    beat = {"time": time.time(), "update": 0, "stage": "waiting-data", "cycle": 0, "pid": os.getpid()}
    with open(os.path.join(line, ".heartbeat.tmp"), "w") as handle:
        json.dump(beat, handle)
    os.replace(os.path.join(line, ".heartbeat.tmp"), os.path.join(line, "heartbeat"))
    time.sleep(0.1)
if os.path.exists(os.path.join(line, "STOP")):
    os.remove(os.path.join(line, "STOP"))  # served, as the trainer serves it
'''


def test_a_line_whose_preparer_waits_for_disk_says_why_it_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A disk that other lines filled: the data preparer waits for free space and the trainer for its
    cycle. `status` and the console said only that the line trains and waits for data; the reason
    (and what to free) was in `data status` alone."""
    monkeypatch.setenv("NSCONSOLE_DATA_MIN_FREE_GB", "1e9")  # more than any disk has: the preparer waits
    data = make_data_line(tmp_path / "data", files=1, prepare=0)
    line = make_line(tmp_path, data, **{"wandb.mode": "disabled"})
    (tmp_path / "runner.py").write_text(RUNNER)
    (tmp_path / "trainer.py").write_text(WAITING_TRAINER)
    settings = {"poll_seconds": 0.05, "relaunch_delay_seconds": 0.05,
                "trainer_command": [sys.executable, str(tmp_path / "trainer.py")]}  # fmt: skip
    supervisor = subprocess.Popen([sys.executable, str(tmp_path / "runner.py"), str(line), json.dumps(settings)])
    try:
        deadline = time.monotonic() + 60
        while '"waiting"' not in read_or_empty(data / "preparer.json") or registry.find_supervisor(line) is None:
            assert time.monotonic() < deadline and supervisor.poll() is None, "the preparer never waited"
            time.sleep(0.1)
        why = f"the trainer waits for data cycle 0; the data preparer of {data} waits: disk: "
        assert main(["status", str(line)]) == 0  # it runs: nothing to do but free the disk
        assert f"\ndata: {why}" in capsys.readouterr().out
        assert main(["status"]) == 0
        assert f"training (supervisor pid {supervisor.pid}); {why}" in capsys.readouterr().out

        async def scenario() -> None:
            app = ConsoleApp(refresh_interval=0.1)
            async with app.run_test(size=(160, 40)) as pilot:
                view = await until(pilot, lambda: app.book.get(line_id(line)), "the line's row", 30)
                flag = await until(pilot, lambda: next((f for f in view.health if f.kind == "data"), None),
                                   "the data flag", 30)
                assert "; the preparer waits: disk: " in flag.detail
                assert any("the preparer waits: disk: " in event.message for event in view.events)

        asyncio.run(scenario())
        stop_supervisor(line)
    finally:
        left_running = end_line_processes([supervisor], tmp_path)
    assert left_running == []


def test_a_line_waiting_for_data_names_a_damaged_preparer_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The console's data flag said only that the line waits for data: the supervisor took the
    damaged file for no status at all. Its preparer here is a stand-in that runs and writes nothing,
    so the damage stays as the user left it."""
    data = make_data_line(tmp_path / "data", files=1, prepare=0)
    line = make_line(tmp_path, data, **{"wandb.mode": "disabled"})
    damaged = data / "preparer.json"
    damaged.write_text('{"state": "wai')  # cut short
    (tmp_path / "runner.py").write_text(RUNNER)
    (tmp_path / "trainer.py").write_text(WAITING_TRAINER)
    (tmp_path / "preparer.py").write_text("import time\ntime.sleep(600)\n")
    settings = {"poll_seconds": 0.05, "relaunch_delay_seconds": 0.05,
                "preparer_command": [sys.executable, str(tmp_path / "preparer.py")],
                "trainer_command": [sys.executable, str(tmp_path / "trainer.py")]}  # fmt: skip
    supervisor = subprocess.Popen([sys.executable, str(tmp_path / "runner.py"), str(line), json.dumps(settings)])
    unknown = f"the preparer's state is unknown: {damaged}: not valid JSON"
    try:
        deadline = time.monotonic() + 60
        while registry.find_supervisor(line) is None or "waiting-data" not in read_or_empty(line / "heartbeat"):
            assert time.monotonic() < deadline and supervisor.poll() is None, "the line never waited for data"
            time.sleep(0.1)
        assert main(["status", str(line)]) == 0
        assert f"\nproblem: data preparer: {damaged}: not valid JSON" in capsys.readouterr().out

        async def scenario() -> None:
            app = ConsoleApp(refresh_interval=0.1)
            async with app.run_test(size=(160, 40)) as pilot:
                view = await until(pilot, lambda: app.book.get(line_id(line)), "the line's row", 30)
                flag = await until(pilot, lambda: next((f for f in view.health if f.kind == "data"), None),
                                   "the data flag", 30)
                assert unknown in flag.detail, flag.detail

        asyncio.run(scenario())
        assert f"the data preparer's state is unknown: {damaged}: not valid JSON" in (line / "run.log").read_text()
        stop_supervisor(line)
    finally:
        left_running = end_line_processes([supervisor], tmp_path)
    assert left_running == []


def read_or_empty(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def test_r_refuses_a_line_whose_data_line_another_line_trains_as_run_does(tmp_path: Path) -> None:
    """Two lines made on one data line; the first started takes it. `nsconsole run` and `resume`
    refuse the second (a start check); the console's `R` started its supervisor anyway, which ran the
    data line's preparer until its trainer was refused and the line failed again."""
    from test_console_history import resume_with_r

    data = make_data_line(tmp_path / "data_root", files=1, prepare=1)
    first = make_line(tmp_path / "first", data, **{"wandb.mode": "disabled"})
    second = make_line(tmp_path / "second", data, **{"wandb.mode": "disabled"})
    with one_torch_thread():
        assert Trainer(first, stop_at=1, echo=None).run() == 0  # its start takes the data line
    (data / "preparer.json").unlink(missing_ok=True)

    async def refused(pilot: Any, line: LineView, line_path: Path) -> None:
        event = await until(pilot, lambda: next((e for e in line.events if e.kind == "refused"), None),
                            "the refusal", 60)
        assert event.message.startswith(f"resume: {second}: not started, a start check fails: ")
        assert f"{data}: trained by {first}, the first line that started on it" in event.message

    resume_with_r(tmp_path, refused, second)
    assert registry.find_supervisor(second) is None and not (second / "supervisor.json").exists()
    assert not (data / "preparer.json").exists()  # no preparer ran for it
