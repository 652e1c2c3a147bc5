"""Tell the operator: run the host's `notify` command with an event in JSON on its stdin.

host.json's `notify` names a command (a path, or a command line split like a shell would, or a
list). It is run in its own session with a bounded time; a command that hangs is killed with its
whole process group, one that fails is reported to the caller, which says it once (the supervisor in
run.log, `nsconsole resume` on stderr). Nothing here ever raises into the caller: a broken notifier
must not stop a training line.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.protocol.facts import NOTIFIED_EVENTS

DEFAULT_TIMEOUT_S = 30.0
STDERR_TAIL_CHARS = 300
"""How much of a failed command's stderr its failure keeps (the end: where the reason usually is)."""


@dataclass(frozen=True)
class NotifyResult:
    """What happened to one notification."""

    delivered: bool
    """The command ran and exited 0 within the time allowed."""
    detail: str
    """Why not, when it was not ("" when delivered)."""


def make_event(kind: str, line: str, message: str, **details: Any) -> dict[str, Any]:
    """An event as the notify command receives it."""
    if kind not in NOTIFIED_EVENTS:
        raise ValueError(f"unknown event kind {kind!r}")
    return {
        "event": kind,
        "line": line,
        "message": message,
        "time": time.time(),
        "host": socket.gethostname(),
        **details,
    }


def notify(
    command: str | Sequence[str] | None, event: dict[str, Any], timeout: float = DEFAULT_TIMEOUT_S
) -> NotifyResult:
    """Run `command` with `event` as JSON on stdin; wait at most `timeout` seconds. Never raises."""
    try:
        return _run_notify(command, event, timeout)
    except Exception as error:  # a notifier must never take the line down with it
        return NotifyResult(False, f"unexpected failure: {type(error).__name__}: {error}")


def _run_notify(command: str | Sequence[str] | None, event: dict[str, Any], timeout: float) -> NotifyResult:
    if not command:
        return NotifyResult(False, "no notify command configured")
    try:
        argv = shlex.split(command) if isinstance(command, str) else [str(part) for part in command]
        payload = json.dumps(event, default=str).encode() + b"\n"
    except (ValueError, TypeError) as error:
        return NotifyResult(False, f"cannot prepare the notification: {error}")
    try:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,  # so a timeout can kill whatever the command started
            close_fds=True,
        )
    except OSError as error:
        return NotifyResult(False, f"cannot run {argv[0]!r}: {error.strerror or error}")
    try:
        _, stderr = process.communicate(payload, timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(process)
        return NotifyResult(False, f"{argv[0]} did not finish within {timeout:g} s and was killed")
    except OSError as error:  # e.g. the command exited without reading stdin (EPIPE)
        process.wait()
        if process.returncode == 0:
            return NotifyResult(True, "")
        return NotifyResult(False, f"{argv[0]}: {error}")
    if process.returncode != 0:
        tail = _stderr_tail(stderr)
        detail = f"{argv[0]} exited with status {process.returncode}"
        return NotifyResult(False, f"{detail}: {tail}" if tail else detail)
    return NotifyResult(True, "")


def _stderr_tail(stderr: bytes, limit: int = STDERR_TAIL_CHARS) -> str:
    """The end of a failed command's stderr on one line: the detail becomes a run.log line (and
    `nsconsole resume`'s one line on stderr), and a traceback's own lines would read there as lines
    of their own, without the time stamp and `supervisor:` that say whose they are."""
    lines = [line.strip() for line in stderr.decode(errors="replace").splitlines()]
    return " | ".join(line for line in lines if line)[-limit:]


def notify_in_background(
    command: str | Sequence[str] | None,
    event: dict[str, Any],
    timeout: float = DEFAULT_TIMEOUT_S,
    on_failure: Callable[[str], None] | None = None,
) -> threading.Thread:
    """`notify` in a daemon thread, for callers that must not wait even `timeout` seconds.

    `on_failure` gets why a notification did not go through (the supervisor writes it in run.log:
    an operator who hears nothing looks there, not in the detached supervisor's own output)."""

    def deliver() -> None:
        result = notify(command, event, timeout)
        if not result.delivered and on_failure is not None:
            on_failure(result.detail)

    thread = threading.Thread(target=deliver, name="notify", daemon=True)
    thread.start()
    return thread


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()

