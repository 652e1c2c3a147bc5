"""Detached starts: a process that survives its session's end, and the systemd-logind refusal."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from engine.supervisor.detach import LogindFacts, foreground_argv, logind_refusal, spawn_detached


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_detached_process_survives_its_parents_session_ending(tmp_path: Path) -> None:
    output = tmp_path / "supervisor.out"
    survivor = tmp_path / "survivor.py"
    survivor.write_text("import sys, time\nprint('started', flush=True)\ntime.sleep(600)\n")
    parent = tmp_path / "parent.py"
    parent.write_text(
        "import sys, time\n"
        "from engine.supervisor.detach import spawn_detached\n"
        f"pid = spawn_detached([sys.executable, {str(survivor)!r}], {str(output)!r})\n"
        "print(f'detached {pid}', flush=True)\n"
        "time.sleep(600)\n"
    )
    # The parent runs as a login would: a session of its own with a terminal (the pty).
    login_pid, terminal = pty.fork()
    if login_pid == 0:  # pragma: no cover - the child execs at once
        os.execv(sys.executable, [sys.executable, str(parent)])
    detached_pid = None
    try:
        received = b""
        while b"\n" not in received.split(b"detached ")[-1]:
            received += os.read(terminal, 1024)
        detached_pid = int(received.split(b"detached ")[-1].split()[0])
        wait_for(lambda: output.exists() and output.read_text() == "started\n")
        detached = psutil.Process(detached_pid)
        assert os.getsid(detached_pid) == detached_pid != os.getsid(login_pid)
        assert detached.terminal() is None

        # The login ends: the terminal hangs up and the session's processes are killed.
        os.close(terminal)
        terminal = -1
        os.killpg(login_pid, signal.SIGHUP)
        os.killpg(login_pid, signal.SIGKILL)
        os.waitpid(login_pid, 0)
        time.sleep(0.3)
        assert detached.is_running() and detached.status() != psutil.STATUS_ZOMBIE
    finally:
        if terminal >= 0:
            os.close(terminal)
        with_suppressed_kill(login_pid)
        if detached_pid is not None:
            with_suppressed_kill(detached_pid)


def with_suppressed_kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    with contextlib.suppress(psutil.Error):
        psutil.Process(pid).wait(timeout=5)


def test_the_detached_process_has_no_stdin_and_appends_its_output(tmp_path: Path) -> None:
    output = tmp_path / "supervisor.out"
    output.write_text("earlier start\n")
    program = "import sys; print(repr(sys.stdin.read())); print('err', file=sys.stderr)"
    pid = spawn_detached([sys.executable, "-c", program], output)
    wait_for(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    os.waitpid(pid, 0)  # a test process is its parent: reap it
    assert output.read_text() == "earlier start\n''\nerr\n"


def test_the_detached_process_holds_none_of_its_parents_inheritable_descriptors(tmp_path: Path) -> None:
    # `nsconsole run` under a runner that waits for a pipe's end (ssh, CI, `cmd | tee`): a supervisor
    # holding its write end for weeks would keep that runner waiting for weeks.
    output = tmp_path / "supervisor.out"
    read_end, write_end = os.pipe()
    os.set_inheritable(write_end, True)
    program = "import os, time; print(sorted(int(fd) for fd in os.listdir('/proc/self/fd')), flush=True); time.sleep(30)"
    pid = spawn_detached([sys.executable, "-c", program], output)
    try:
        wait_for(lambda: output.exists() and output.read_text().endswith("\n"))
        assert write_end not in json.loads(output.read_text())
        os.close(write_end)
        assert os.read(read_end, 1) == b""  # the pipe's end came, with the detached process still running
        assert psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    finally:
        os.close(read_end)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


FACTS = LogindFacts(
    systemd=True,
    cgroup="/user.slice/user-1000.slice/session-4.scope",
    linger=False,
    kill_user_processes=False,
    kill_exclude_users=("root",),
    kill_only_users=(),
    stop_idle_session=False,
    user="alice",
)


def refusal(**changes: object) -> str | None:
    facts = LogindFacts(**{**FACTS.__dict__, **changes})
    argv = ["nsconsole", "run", "/data/lines/trunk", "--foreground"]
    return logind_refusal(facts, "/data/lines/trunk", argv)


def test_a_login_session_that_logind_leaves_alone_is_fine() -> None:
    assert refusal() is None
    assert refusal(systemd=False, kill_user_processes=True) is None
    assert refusal(kill_user_processes=True, kill_exclude_users=("alice",)) is None
    assert refusal(kill_user_processes=True, kill_only_users=("bob",)) is None
    user_manager = "/user.slice/user-1000.slice/user@1000.service/app.slice/x.scope"
    assert refusal(cgroup=user_manager, linger=True) is None


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"kill_user_processes": True}, "KillUserProcesses=yes"),
        ({"stop_idle_session": True}, "StopIdleSessionSec"),
        ({"cgroup": "/user.slice/user-1000.slice/user@1000.service/app.slice/tmux.scope"}, "Linger=no"),
    ],
)
def test_logind_that_would_end_the_line_gets_the_service_command(changes: dict, reason: str) -> None:
    message = refusal(**changes)
    assert message is not None and reason in message
    command = message.split("start it as a service instead: ")[1]
    assert command.startswith("loginctl enable-linger alice && systemd-run --user --unit=nsconsole-trunk ")
    assert "--property=KillMode=mixed" in command
    assert command.endswith("nsconsole run /data/lines/trunk --foreground")


def test_with_linger_the_command_is_systemd_run_alone() -> None:
    message = refusal(kill_user_processes=True, linger=True)
    assert message is not None
    assert message.split("instead: ")[1].startswith("systemd-run --user --unit=nsconsole-trunk ")


def test_the_service_runs_the_supervisor_in_the_foreground(tmp_path: Path) -> None:
    expected = [sys.executable, "-m", "engine.supervisor.supervisor", str(tmp_path), "--foreground"]
    assert foreground_argv(tmp_path) == expected
