"""The supervisors of the branches a trunk's supervisor started.

A branch forked at the end of its trunk cycle (`engine/supervisor/forks.py`) is run by its own
supervisor, started detached with the trunk's engine and no `--stop-at`; each is then a child of
the trunk's supervisor, which reaps it.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from engine.errors import LineError
from engine.supervisor.settings import SupervisorSettings
from engine.supervisor.start import SupervisorSilent, start_detached


class BranchSupervisors:
    """Starts branch supervisors (from fork worker threads) and reaps them (from the supervisor's loop)."""

    def __init__(self, engine: str) -> None:
        self._engine = engine  # the trunk's: a branch trains as its trunk did
        self._lock = threading.Lock()  # guards _pids between the fork threads and the loop
        self._pids: list[int] = []  # started and not yet reaped

    def start(self, branch: Path) -> str | None:
        """Start the branch's own supervisor detached (this one's engine, no `--stop-at`); None when
        it started, else why not (the branch stays: `nsconsole run` it by hand)."""
        try:
            pid = start_detached(branch, SupervisorSettings(engine=self._engine))
        except SupervisorSilent as silent:
            # It runs, and may still come up: this process's child all the same, reaped when it ends.
            with self._lock:
                self._pids.append(silent.pid)
            return str(silent)
        except LineError as error:
            return str(error)
        except Exception as error:  # the trunk goes on; the operator is told
            return f"internal error: {type(error).__name__}: {error}"
        with self._lock:
            self._pids.append(pid)
        return None

    def reap(self) -> None:
        # A started branch supervisor is this process's child: once it exits, collect its status, or
        # it stays a zombie for as long as the trunk runs.
        with self._lock:
            started = list(self._pids)
        ended = set()
        for pid in started:
            try:
                finished, _status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                finished = pid  # collected already
            if finished:
                ended.add(pid)
        if ended:
            with self._lock:
                self._pids = [pid for pid in self._pids if pid not in ended]
