"""Lines whose supervisor was lost (the host went down, a kill -9) are started again by `nsconsole
resume`, and by the console's `R`, with the --engine and --stop-at they ran with."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from helpers.console import until
from helpers.lines import make_data_line, make_line
from helpers.supervise import RUNNER, end_line_processes, gone
from test_console_history import resume_with_r

from engine.process_start import started_since_boot
from engine.supervisor import registry
from engine.supervisor.lost import lost_line
from nsconsole.cli import main
from nsconsole.state import LineView

pytestmark = pytest.mark.usefixtures("private_host")  # conftest: an empty host.json, a private runtime dir


def dead_pid() -> int:
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(finished.stdout)


def write_supervisor_json(line: Path, **fields: Any) -> None:
    """supervisor.json as this nsconsole's supervisors write it (`engine`, `stop_at` recorded), with `fields`."""
    line.mkdir(parents=True, exist_ok=True)
    (line / "supervisor.json").write_text(json.dumps({"started": 1000.0, "engine": "auto", "stop_at": None, **fields}))


def own_record() -> dict[str, Any]:
    """pid and start of this very process, as a supervisor records its own."""
    return {"pid": os.getpid(), "boot_start": started_since_boot(psutil.Process())}


@pytest.mark.parametrize("state", ["training", "waiting-gpu", "relaunching", "starting", "stopping"])
def test_a_state_that_is_not_final_with_its_supervisor_gone_is_lost(tmp_path: Path, state: str) -> None:
    pid = dead_pid()
    write_supervisor_json(tmp_path / "line", pid=pid, state=state, engine="eager", stop_at=40)
    lost = lost_line(tmp_path / "line")
    assert lost is not None
    assert (lost.state, lost.supervisor_pid, lost.engine, lost.stop_at) == (state, pid, "eager", 40)
    assert lost.asked_to_stop is (state == "stopping")


@pytest.mark.parametrize("state", ["finished", "stopped", "failed", "stuck", "disk-full"])
def test_a_line_its_supervisor_ended_is_not_lost(tmp_path: Path, state: str) -> None:
    write_supervisor_json(tmp_path / "line", pid=dead_pid(), state=state)
    assert lost_line(tmp_path / "line") is None


def test_a_running_supervisor_or_trainer_keeps_the_line_from_being_lost(tmp_path: Path) -> None:
    line = tmp_path / "line"
    write_supervisor_json(line, state="training", **own_record())
    assert lost_line(line) is None  # its supervisor runs
    # The same pid started at another time since boot: a younger process that reused it (a reboot).
    record = own_record()
    write_supervisor_json(line, state="training", pid=record["pid"], boot_start=record["boot_start"] - 100.0)
    assert lost_line(line) is not None
    # A trainer still beats (an orphan finishing its checkpoint, or one run without a supervisor).
    beat = {"pid": os.getpid(), "pid_boot_start": record["boot_start"], "time": time.time(), "stage": "training"}
    (line / "heartbeat").write_text(json.dumps(beat))
    assert lost_line(line) is None
    (line / "heartbeat").write_text(json.dumps({**beat, "stage": "stopped"}))  # it said it stopped
    assert lost_line(line) is not None


def test_an_older_record_without_engine_or_stop_at_resumes_as_run_does(tmp_path: Path) -> None:
    write_supervisor_json(tmp_path / "line", pid=dead_pid(), state="training", stop_at=True, engine="warp")
    lost = lost_line(tmp_path / "line")
    assert lost is not None and (lost.engine, lost.stop_at) == ("auto", None)
    assert lost_line(tmp_path / "nothing") is None  # never ran under a supervisor


def kill_like_a_reboot(supervisor_pid: int) -> None:
    """SIGKILL the supervisor and every process under it at once, as a host going down does (no
    process gets to checkpoint or write a final state)."""
    supervisor = psutil.Process(supervisor_pid)
    family = [*supervisor.children(recursive=True), supervisor]
    for process in family:
        process.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not all(gone(process.pid) for process in family):
        assert time.monotonic() < deadline, "the line's processes did not die"
        time.sleep(0.05)


@pytest.mark.slow
def test_resume_starts_a_lost_line_again_with_its_stop_at_and_engine(
    tmp_path: Path, private_host: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    work_root = tmp_path / "lines"
    private_host.write_text(json.dumps({"work_root": str(work_root)}))
    # No preparer at first: only cycle 0 is prepared, so after it the trainer waits for data, alive.
    data = make_data_line(tmp_path / "data_root", prepare=1)
    line = make_line(work_root, data)  # work_root/line
    (tmp_path / "runner.py").write_text(RUNNER)
    settings = {"poll_seconds": 0.1, "relaunch_delay_seconds": 0.05, "run_preparer": False, "engine": "eager",
                "stop_at": 14}
    first = subprocess.Popen([sys.executable, str(tmp_path / "runner.py"), str(line), json.dumps(settings)])
    try:
        deadline = time.monotonic() + 180
        while (json.loads((line / "heartbeat").read_text()).get("stage") if (line / "heartbeat").exists()
               else None) != "waiting-data":
            assert time.monotonic() < deadline and first.poll() is None, "the line never reached its data's end"
            time.sleep(0.2)
        supervisor = json.loads((line / "supervisor.json").read_text())
        assert (supervisor["state"], supervisor["engine"], supervisor["stop_at"]) == ("training", "eager", 14)
        kill_like_a_reboot(first.pid)
        first.wait(timeout=30)
        latest_before = (line / "checkpoints" / "latest").read_text().strip()

        assert main(["status", str(line)]) == 3  # StatusExitCode.NEEDS_OPERATOR: nothing runs it
        assert "state: supervisor lost (it was training; its process runs no more)" in capsys.readouterr().out
        assert main(["resume", "--dry-run"]) == 0
        assert capsys.readouterr().out == (
            f"would resume {line} (it was training when its supervisor (pid {first.pid}) was lost; "
            "--engine eager; --stop-at 14)\n"
        )
        assert registry.find_supervisor(line) is None  # a dry run starts nothing

        assert main(["resume"]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[0] == (f"resuming {line} (it was training when its supervisor (pid {first.pid}) was lost; "
                          "--engine eager; --stop-at 14)")
        assert out[1].startswith(f"the supervisor of {line} runs in the background (pid ")
        assert out[-1] == "1 of 1 lost line(s) resumed"
        resumed_pid = int(out[1].split("(pid ", 1)[1].split(")", 1)[0])
        # Its preparer runs now: the line trains on from its checkpoint and stops at update 14.
        deadline = time.monotonic() + 240
        while json.loads((line / "supervisor.json").read_text())["state"] != "finished":
            assert time.monotonic() < deadline, "the resumed line never finished"
            time.sleep(0.2)
        supervisor = json.loads((line / "supervisor.json").read_text())
        assert (supervisor["engine"], supervisor["stop_at"], supervisor["crashes"]) == ("eager", 14, 1)
        assert (line / "checkpoints" / "latest").read_text().strip() == "u00000014" != latest_before
        updates = [json.loads(row)["update"] for row in (line / "rows.jsonl").read_text().splitlines()]
        assert updates == list(range(1, 15))  # each update once: the rows after the checkpoint were cut back
        deadline = time.monotonic() + 60
        while not gone(resumed_pid):
            assert time.monotonic() < deadline, "the resumed supervisor did not exit after the line's end"
            time.sleep(0.1)
        assert main(["resume"]) == 0
        assert capsys.readouterr().out == "no line's supervisor was lost (1 line(s) looked at)\n"
    finally:
        left_running = end_line_processes([first], tmp_path)
    assert left_running == []


@pytest.mark.slow
def test_r_in_the_console_resumes_a_lost_line_with_its_stop_at_and_engine(tmp_path: Path) -> None:
    line_path = make_line(tmp_path, make_data_line(tmp_path / "data_root", prepare=1))
    write_supervisor_json(line_path, pid=dead_pid(), state="training", engine="eager", stop_at=3)

    async def after_yes(pilot: Any, line: LineView, line_path: Path) -> None:
        started = await until(pilot, lambda: next(
            (event for event in line.events if "its supervisor runs" in event.message), None
        ), "the supervisor to start", 180)
        pid = int(started.message.rsplit("pid ", 1)[1].rstrip(")"))
        supervisor = json.loads((line_path / "supervisor.json").read_text())
        assert (supervisor["engine"], supervisor["stop_at"]) == ("eager", 3)
        await until(pilot, lambda: json.loads((line_path / "supervisor.json").read_text())["state"] == "finished",
                    "the line to stop at update 3", 240)
        assert (line_path / "checkpoints" / "latest").read_text().strip() == "u00000003"
        await until(pilot, lambda: not psutil.pid_exists(pid), "its supervisor to exit (the console reaps it)", 60)

    resume_with_r(tmp_path, after_yes, line_path)


def test_resume_leaves_a_line_lost_while_stopping_and_says_which_could_not_start(
    tmp_path: Path, private_host: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    work_root = tmp_path / "lines"
    private_host.write_text(json.dumps({"work_root": str(work_root)}))
    stopping, broken, ended = work_root / "stopping", work_root / "broken", work_root / "ended"
    write_supervisor_json(stopping, pid=dead_pid(), state="stopping")
    write_supervisor_json(broken, pid=dead_pid(), state="training")  # no run.json: no start check passes
    write_supervisor_json(ended, pid=dead_pid(), state="finished")
    assert main(["resume"]) == 1
    captured = capsys.readouterr()
    assert captured.out.splitlines() == [
        f"resuming {broken} (it was training when its supervisor (pid "
        f"{json.loads((broken / 'supervisor.json').read_text())['pid']}) was lost)",
        f"{stopping}: left alone, it was stopping on request when its supervisor (pid "
        f"{json.loads((stopping / 'supervisor.json').read_text())['pid']}) was lost; `nsconsole run {stopping}` starts it",
        "0 of 1 lost line(s) resumed",
    ]
    assert captured.err.startswith(f"nsconsole: {broken}") and captured.err.count("\n") == 1
    assert sorted(path.name for path in broken.iterdir()) == ["supervisor.json"]  # nothing written


def test_resume_names_a_line_whose_supervisor_json_is_damaged_as_one_it_cannot_judge(
    tmp_path: Path, private_host: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before, such a line was passed over: "no line's supervisor was lost".
    work_root = tmp_path / "lines"
    private_host.write_text(json.dumps({"work_root": str(work_root)}))
    damaged, lost = work_root / "damaged", work_root / "lost"
    damaged.mkdir(parents=True)
    (damaged / "supervisor.json").write_text("{garbage\n")  # `echo '{garbage' > LINE/supervisor.json`
    cannot = f"nsconsole: {damaged / 'supervisor.json'}: not JSON ("
    judge = "): cannot tell whether its line's supervisor was lost; mend it, or restore it from a backup"

    assert main(["resume", "--dry-run"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "no line's supervisor was lost (1 line(s) looked at, 1 of them not judged)\n"
    assert captured.err.startswith(cannot) and judge in captured.err and captured.err.count("\n") == 1

    write_supervisor_json(lost, pid=dead_pid(), state="training")
    assert main(["resume", "--dry-run"]) == 1
    captured = capsys.readouterr()
    assert captured.out.startswith(f"would resume {lost} (it was training")
    assert captured.err.startswith(cannot) and captured.err.count("\n") == 1
    assert (damaged / "supervisor.json").read_text() == "{garbage\n"  # left as it is
