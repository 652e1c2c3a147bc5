"""Starting a line's supervisor in the background, as `nsconsole run`, the console and a trunk do.

`start_detached` runs `python -m engine.supervisor.supervisor LINE --detached-child` in a session of
its own (`engine/supervisor/detach.py`), after the checks a terminal should see (a broken run.json,
a supervisor already running, a held line, a logind that would end it at logout), and waits until
it answers on the registry.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from engine.config.run import RunConfig
from engine.errors import LineError
from engine.layout import LineLayout
from engine.logrotate import rotate_if_needed
from engine.ops import lines as ops
from engine.supervisor import registry
from engine.supervisor.detach import foreground_argv, gather_logind_facts, logind_refusal, spawn_detached
from engine.supervisor.reads import file_size
from engine.supervisor.rows_tail import RowsTail
from engine.supervisor.settings import SupervisorSettings
from engine.training.line_lock import refuse_a_held_line

INDEX_BYTES_PER_S = 25 * 2**20
"""The pace a start is allowed for indexing rows.jsonl before it answers: it read 3 GB in 43 s
(about 70 MB/s) on the 2-core development machine; a slower disk or a busy host reads slower."""


class SupervisorSilent(LineError):
    """`start_detached` started a supervisor that has not answered in time. It may still come up,
    and it is the caller's child: `pid` lets a caller that lives on (the console) reap it."""

    def __init__(self, message: str, pid: int) -> None:
        super().__init__(message)
        self.pid = pid


def start_detached(line: Path, settings: SupervisorSettings, answer_timeout: float = 60.0) -> int:
    """Start the line's supervisor in the background and wait until it answers; its pid.

    `SupervisorSilent` (with the pid) when it runs but has not answered within answer_timeout."""
    layout = ops.open_line(line)
    RunConfig.load(layout.run_json)  # a broken run.json is reported here, in the terminal
    running = registry.find_supervisor(layout.root)
    if running is not None:
        raise LineError(f"{layout.root}: a supervisor already runs this line (pid {running.pid})")
    refuse_a_held_line(layout)  # refused here, not in supervisor.out, while another holds the line
    options = ["--engine", settings.engine]
    if settings.stop_at is not None:
        options += ["--stop-at", str(settings.stop_at)]
    refusal = logind_refusal(gather_logind_facts(), layout.root, [*foreground_argv(layout.root), *options])
    if refusal is not None:
        raise LineError(refusal)
    rotate_if_needed(layout.supervisor_out)
    started_at = file_size(layout.supervisor_out)
    argv = [sys.executable, "-m", "engine.supervisor.supervisor", str(layout.root), "--detached-child", *options]
    pid = spawn_detached(argv, layout.supervisor_out)
    answer_timeout = answer_wait(layout, answer_timeout)
    deadline = time.monotonic() + answer_timeout
    while time.monotonic() < deadline:
        entry = registry.find_supervisor(layout.root)
        if entry is not None and entry.pid == pid:
            return pid
        finished, status = os.waitpid(pid, os.WNOHANG)
        if finished:
            output = layout.supervisor_out.read_bytes()[started_at:].decode("utf-8", errors="replace").strip()
            last = output.splitlines()[-1].removeprefix("nsconsole: ") if output else \
                f"exit status {os.waitstatus_to_exitcode(status)}"
            raise LineError(f"{layout.supervisor_out}: the supervisor did not start: {last}")
        time.sleep(0.1)
    raise SupervisorSilent(f"{layout.supervisor_out}: the supervisor (pid {pid}) has not answered within "
                           f"{answer_timeout:.0f} s; see that file", pid)


def answer_wait(layout: LineLayout, base: float) -> float:
    """How long a start waits for its supervisor to answer: `base`, and the time its start takes to
    index what of rows.jsonl the saved index does not cover (`INDEX_BYTES_PER_S`): the first start
    on a line of months reads gigabytes before it serves, and would be reported silent meanwhile."""
    unindexed = file_size(layout.rows_jsonl) - RowsTail.indexed_bytes(layout.rows_index)
    return base + max(0, unindexed) / INDEX_BYTES_PER_S
