"""Discovery: supervisors register under the run dir; stale entries are dropped."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from engine.errors import LineError
from engine.supervisor import registry


@pytest.fixture(autouse=True)
def runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(registry.RUN_ENV_VARIABLE, str(tmp_path / "run"))
    return registry.runtime_dir()


def test_register_list_unregister(tmp_path: Path, runtime: Path) -> None:
    line = tmp_path / "lines" / "trunk"
    line.mkdir(parents=True)
    entry = registry.register(line, line / "supervisor.sock")
    assert stat.S_IMODE(os.stat(runtime).st_mode) == 0o700
    record = json.loads((runtime / f"{entry.id}.json").read_text())
    assert record["line"] == str(line) and record["socket"] == str(line / "supervisor.sock")
    assert record["pid"] == os.getpid() and record["create_time"] > 0 and record["started"] > 0
    assert entry.id.startswith("trunk-")
    assert registry.list_supervisors() == [entry]
    assert registry.find_supervisor(line) == entry
    registry.unregister(entry)
    assert registry.list_supervisors() == [] and registry.find_supervisor(line) is None


def test_stale_entries_are_dropped(tmp_path: Path, runtime: Path) -> None:
    live_line, dead_line, reused_line = (tmp_path / name for name in ("live", "dead", "reused"))
    for line in (live_line, dead_line, reused_line):
        line.mkdir()
    live = registry.register(live_line, live_line / "supervisor.sock")
    finished = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    dead_pid = int(finished.stdout)
    registry.register(dead_line, dead_line / "supervisor.sock", pid=os.getpid())
    dead_file = runtime / f"{registry.line_id(dead_line)}.json"
    record = json.loads(dead_file.read_text())
    dead_file.write_text(json.dumps({**record, "pid": dead_pid}))
    # Our own pid, but recorded with another start time: the pid was reused by another process.
    reused = registry.register(reused_line, reused_line / "supervisor.sock")
    reused_file = runtime / f"{reused.id}.json"
    reused_record = json.loads(reused_file.read_text())
    reused_file.write_text(json.dumps({**reused_record, "create_time": 1000.0, "boot_start": reused_record["boot_start"] - 5}))
    (runtime / "garbage.json").write_text("{not json")

    assert registry.list_supervisors() == [live]
    assert sorted(path.name for path in runtime.iterdir()) == [f"{live.id}.json"]


def test_a_wall_clock_step_does_not_make_a_live_supervisor_look_stale(
    tmp_path: Path, runtime: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    line = tmp_path / "trunk"
    line.mkdir()
    entry = registry.register(line, line / "supervisor.sock")
    # The clock stepped an hour forward (an NTP step, a resumed VM): the boot time the kernel reports,
    # and with it every wall-clock start time psutil derives, moved by the step.
    booted = psutil.boot_time()
    monkeypatch.setattr(psutil._psplatform, "boot_time", lambda: booted + 3600.0)
    assert abs(psutil.Process().create_time() - entry.create_time - 3600.0) < 1.0
    assert registry.list_supervisors() == [entry] and registry.find_supervisor(line) == entry
    assert (runtime / f"{entry.id}.json").exists()  # not removed as stale, as it was before


def test_an_entry_of_an_older_version_is_judged_by_its_wall_clock_start(tmp_path: Path, runtime: Path) -> None:
    line = tmp_path / "trunk"
    line.mkdir()
    entry = registry.register(line, line / "supervisor.sock")
    path = runtime / f"{entry.id}.json"
    record = json.loads(path.read_text())
    del record["boot_start"]
    path.write_text(json.dumps(record))
    assert [found.pid for found in registry.list_supervisors()] == [os.getpid()]
    path.write_text(json.dumps({**record, "create_time": record["create_time"] - 5}))  # reused pid
    assert registry.list_supervisors() == [] and not path.exists()


def test_a_newer_registration_is_not_removed_by_the_older_supervisor(tmp_path: Path) -> None:
    line = tmp_path / "line"
    line.mkdir()
    older = registry.register(line, line / "supervisor.sock")
    newer = registry.register(line, line / "supervisor.sock")
    newer_file = registry.runtime_dir() / f"{newer.id}.json"
    record = json.loads(newer_file.read_text())
    newer_file.write_text(json.dumps({**record, "create_time": older.create_time + 1}))
    registry.unregister(older)
    assert newer_file.exists()


def test_a_runtime_dir_owned_by_another_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to create a directory owned by another user")
    planted = tmp_path / "planted"
    planted.mkdir()
    os.chown(planted, 65534, 65534)
    monkeypatch.setenv(registry.RUN_ENV_VARIABLE, str(planted))
    with pytest.raises(LineError, match="planted: not a directory owned by uid 0"):
        registry.runtime_dir()


def test_a_run_dir_that_is_a_file_is_a_one_line_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(registry.RUN_ENV_VARIABLE, str(tmp_path / "a-file"))
    with pytest.raises(LineError, match="a-file: cannot create the run directory"):
        registry.runtime_dir()


def test_by_default_the_run_dir_is_in_the_users_home_whatever_home_and_xdg_say(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every process of the user must find the same entries and GPU lock files: not $HOME (sudo, a
    service) nor $XDG_RUNTIME_DIR (removed at the last logout) may move them."""
    monkeypatch.delenv(registry.RUN_ENV_VARIABLE)
    home = Path(pwd.getpwuid(os.getuid()).pw_dir)
    if not os.access(home, os.W_OK):
        pytest.skip(f"{home} is not writable here")
    monkeypatch.setenv("HOME", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    directory = registry.runtime_dir()
    assert directory.parent == home / ".nsconsole" / "run" and directory.name == socket.gethostname()
    assert stat.S_IMODE(os.stat(directory.parent).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700


def test_entries_outlive_the_removal_of_the_xdg_runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    line = tmp_path / "line"
    line.mkdir()
    entry = registry.register(line, line / "supervisor.sock")
    shutil.rmtree(xdg)  # what systemd-logind does at the user's last logout
    assert registry.list_supervisors() == [entry] and registry.find_supervisor(line) == entry


def test_lines_are_remembered_in_a_history_outside_the_runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(registry.HISTORY_ENV_VARIABLE, str(tmp_path / "history"))
    trunk, branch = tmp_path / "lines" / "trunk", tmp_path / "lines" / "branch"
    for line in (trunk, branch):
        line.mkdir(parents=True)
        registry.remember_line(line)
    registry.remember_line(trunk)  # a line registered again is remembered once
    (tmp_path / "history" / "garbage.json").write_text("{not json")
    assert registry.remembered_lines() == sorted(os.path.realpath(line) for line in (trunk, branch))
    # Without the variable: ~/.nsconsole/history, which a logout leaves alone.
    monkeypatch.delenv(registry.HISTORY_ENV_VARIABLE)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert registry.history_dir() == tmp_path / "home" / ".nsconsole" / "history"
    registry.remember_line(trunk)
    assert registry.remembered_lines() == [os.path.realpath(trunk)]
    # A history that cannot be written is a one-line error naming the file.
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(registry.HISTORY_ENV_VARIABLE, str(tmp_path / "a-file" / "history"))
    with pytest.raises(LineError, match=r"a-file/history/trunk-[0-9a-f]+\.json: cannot record the line in the history"):
        registry.remember_line(trunk)
