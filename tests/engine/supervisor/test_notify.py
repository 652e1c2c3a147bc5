"""The operator's notify command: the event JSON on stdin, bounded time, never an exception."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.protocol.facts import NOTIFIED_EVENTS
from engine.supervisor.notify import make_event, notify


def script(tmp_path: Path, body: str) -> list[str]:
    path = tmp_path / "notify.py"
    path.write_text(body)
    return [sys.executable, str(path)]


def test_the_command_gets_the_event_on_stdin(tmp_path: Path) -> None:
    received = tmp_path / "received.json"
    command = script(tmp_path, f"import sys; open({str(received)!r}, 'w').write(sys.stdin.read())")
    event = make_event("watchdog_restart", "/lines/trunk", "no heartbeat for 30 min", update=1234)
    result = notify(command, event)
    assert result.delivered and result.detail == ""
    assert json.loads(received.read_text()) == event
    assert event["event"] == "watchdog_restart" and event["update"] == 1234 and event["host"]


def test_a_command_line_string_is_split_like_a_shell_would(tmp_path: Path) -> None:
    received = tmp_path / "received with space.json"
    command = script(tmp_path, "import sys; open(sys.argv[1], 'w').write(sys.stdin.read())")
    line = " ".join(f"'{part}'" for part in [*command, str(received)])
    assert notify(line, make_event("finished", "/l", "done")).delivered
    assert json.loads(received.read_text())["event"] == "finished"


def test_failures_are_reported_never_raised(tmp_path: Path) -> None:
    event = make_event("failed", "/l", "5 failures in a row")
    assert notify(None, event).detail == "no notify command configured"
    missing = notify(str(tmp_path / "no-such-command"), event)
    assert not missing.delivered and "cannot run" in missing.detail
    body = "import sys; sys.stdin.read(); print('boom', file=sys.stderr); sys.exit(3)"
    failing = notify(script(tmp_path, body), event)
    assert not failing.delivered and "exited with status 3: boom" in failing.detail
    assert notify(script(tmp_path, "pass"), event).delivered  # exits without reading: still fine
    assert not notify("'unterminated", event).delivered
    # Reported to the caller alone, which says it once: `nsconsole resume` printed a failure twice,
    # its own line and a warning of the notify logger that Python's last-resort handler wrote.
    code = ("from engine.supervisor.notify import make_event, notify; "
            "print(notify('false', make_event('failed', '/l', 'x')).detail)")  # fmt: skip
    alone = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})  # fmt: skip
    assert (alone.stdout, alone.stderr) == ("false exited with status 1\n", "")


def test_a_failure_s_stderr_is_told_on_one_line(tmp_path: Path) -> None:
    # The detail is a run.log line: a notifier's traceback made lines of its own there, with no
    # time stamp or `supervisor:` to say whose they were.
    body = "import sys; sys.stdin.read(); sys.exit('Traceback (most recent call last):\\n  File x\\n\\nOSError: pager down')"
    result = notify(script(tmp_path, body), make_event("failed", "/l", "x"))
    assert "\n" not in result.detail
    assert result.detail.endswith("exited with status 1: Traceback (most recent call last): | File x | OSError: pager down")
    long = "import sys; sys.stdin.read(); sys.exit('x' * 1000 + '\\nthe reason')"
    assert notify(script(tmp_path, long), make_event("failed", "/l", "x")).detail.endswith("x | the reason")


def test_a_hanging_command_is_killed_with_its_children(tmp_path: Path) -> None:
    marker = tmp_path / "grandchild-alive"
    grandchild = tmp_path / "grandchild.py"
    grandchild.write_text(f"import time\ntime.sleep(1)\nopen({str(marker)!r}, 'w').close()\n")
    body = (
        f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, {str(grandchild)!r}])\n"
        "time.sleep(60)\n"
    )
    started = time.monotonic()
    result = notify(script(tmp_path, body), make_event("stuck", "/l", "hung"), timeout=0.5)
    assert not result.delivered and "did not finish within 0.5 s" in result.detail
    assert time.monotonic() - started < 10
    time.sleep(1.5)
    assert not marker.exists()  # the whole process group went


def test_every_spec_event_kind_exists_and_others_are_refused() -> None:
    assert set(NOTIFIED_EVENTS) == {
        "finished", "failed", "stuck", "watchdog_restart", "signal_restart", "disk_full",
        "data_wait", "gpu_wait", "preparer_failing", "supervisor_failed",
        "branch_failed",  # not the spec's: a branch queued hours before fails while nobody watches
    }
    with pytest.raises(ValueError):
        make_event("made_up", "/l", "")
