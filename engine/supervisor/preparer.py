"""The line's data preparer, kept running beside the trainer by the supervisor.

`nsconsole data run-preparer --work DATA` keeps the next cycles of the line's data line ready;
the supervisor starts it, restarts it with backoff when it exits with a failure (it resumes the
cycle with the same files), tells the operator (`preparer_failing`) when it keeps failing, and
stops it (SIGTERM: its status then says `stopped`) when the line stops, then deletes the shards
of the cycles consumed since the preparer's last round. A preparer that exits
`PreparerExitCode.STOPPED_FOR_GOOD` met a failure that does not pass by itself (a source used up,
a pinned file changed or gone, a dataline.json that no longer parses): it is not restarted, which
run.log says once with its reason and fix, and the operator is told at once (`preparer_failing`,
`stopped_for_good`); the trainer trains the cycles already prepared, then waits. The keeper then
watches the files the preparer reads (`datalines.inputs.input_stamp`, every `recheck_delay`): once
the operator's fix has changed them and they have held still for one look (a file copied back is
not taken half-copied), it starts the preparer again by itself; a preparer that stops for good
again for the same reason is said in run.log only. A preparer
already running on the data line (another line's supervisor, or one started by hand) is left alone: the
data line's lock allows one. Its output goes to `<data line>/preparer.log`, rotated like run.log.

The preparer runs in a session of its own: a Ctrl-C in the terminal of `nsconsole run LINE
--foreground` reaches the terminal's process group, and the supervisor, which stops the line (and
its preparer) for it. In that group the preparer took the SIGINT itself and exited 130 as the line
stopped, and the supervisor reported a failed preparer, "restarting in 5 s", that it never restarted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from datalines.dataline import open_data_line
from datalines.errors import DataLineError
from datalines.inputs import input_stamp
from datalines.service import delete_consumed_shards_unless_preparing, preparer_running
from datalines.status import read_status
from engine.logrotate import rotate_if_needed
from engine.protocol.facts import PreparerExitCode
from engine.supervisor.children import preparer_command

LOG_NAME = "preparer.log"
FAILING_AFTER = 3
"""Failures in a row (exits, or retries within one run) after which the operator is told."""
MAX_RESTART_DELAY_S = 300.0


class PreparerKeeper:
    """Starts, watches and stops one data line's preparer; `tick()` at every supervisor poll."""

    def __init__(
        self,
        data_path: Path,
        say: Callable[[str], None],
        notify_failing: Callable[[str], None],
        command: list[str] | None = None,
        restart_delay: float = 5.0,
        notify_stopped: Callable[[str], None] | None = None,
        recheck_delay: float = 15.0,
    ) -> None:
        self.data_path = data_path
        self.say = say
        self.notify_failing = notify_failing
        self.notify_stopped = notify_stopped or notify_failing
        """Told once when the preparer stops for good (not restarted): run.log has it through it."""
        # It gets SIGTERM if the supervisor dies (engine.supervisor.children).
        self.command = command or preparer_command()
        self.restart_delay = restart_delay
        """Pause before the first restart after a failed exit; doubles with each in a row (to 5 min)."""
        self.recheck_delay = recheck_delay
        """How often the files of a preparer stopped for good are looked at for the operator's fix."""
        self._process: subprocess.Popen[bytes] | None = None
        self._exits_in_a_row = 0  # exits with a failure since the last good run
        self._next_start = 0.0
        self._finished = False  # exited 0: every cycle of the data line is consumed
        self._told_failing = False
        self._told_other = False
        self._stopped_for_good: str | None = None  # its reason and fix, once it stopped for good
        self._told_for_good: str | None = None  # the last stop for good the operator was notified of
        self._inputs_at_stop: tuple[Any, ...] = ()  # the preparer's files as it stopped for good
        self._inputs_seen: tuple[Any, ...] = ()  # ... and at the last look since
        self._next_input_check = 0.0
        self._told_status_problem: str | None = None  # the damage of preparer.json last said in run.log

    def tick(self) -> None:
        if self._process is not None:
            code = self._process.poll()
            if code is None:
                self._watch_retries()
            else:
                self._exited(code)
            return
        if self._stopped_for_good is not None:
            self._restart_once_fixed()
        if self._finished or self._stopped_for_good is not None or time.monotonic() < self._next_start:
            return
        if preparer_running(self.data_path):
            if not self._told_other:
                self.say(f"a data preparer already runs on {self.data_path}: leaving it to do the work")
                self._told_other = True
            return
        self._start()

    def _start(self) -> None:
        log = self.data_path / LOG_NAME
        rotate_if_needed(log)
        output = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            self._process = subprocess.Popen(
                [*self.command, "--work", str(self.data_path)],
                stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT, close_fds=True,
                start_new_session=True,  # no terminal's signal: the supervisor stops it (see the module docstring)
            )
        finally:
            os.close(output)
        self._told_other = False
        self.say(f"data preparer started (pid {self._process.pid}) on {self.data_path}")

    def _watch_retries(self) -> None:
        status = self._status()
        retries = status.get("consecutive_failures")
        if self._process is None or not self._written_by(status, self._process.pid) or not isinstance(retries, int):
            return  # an earlier process's status (this one has not written its own yet)
        if self._did_work(status):
            self._exits_in_a_row = 0
            self._told_failing = False
        elif retries >= FAILING_AFTER:
            last_error = status.get("last_error")
            self._tell_failing(f"the data preparer has failed {retries} times in a row: {last_error}")

    @staticmethod
    def _written_by(status: dict[str, Any], pid: int | None) -> bool:
        """The status is that process's (one without a pid, from a stand-in preparer, is taken as such)."""
        return status.get("pid") in (None, pid)

    @staticmethod
    def _did_work(status: dict[str, Any]) -> bool:
        """The running preparer has shown a good run: the cycles wanted are ready, or it made one.
        Its first statuses (`starting`, `preparing` with no failure yet) are no such proof: a
        preparer that crashes after them every time must be backed off and reported."""
        prepared = status.get("prepared")
        made_one = isinstance(prepared, int) and prepared > 0 and status.get("consecutive_failures") == 0
        return status.get("state") in ("ready", "finished") or made_one

    def _exited(self, code: int) -> None:
        pid = self._process.pid if self._process is not None else None
        self._process = None
        if code == PreparerExitCode.OK:
            self._finished = True
            self.say("the data preparer finished: every cycle of the data line is consumed")
            return
        if code == PreparerExitCode.STOPPED_FOR_GOOD:
            self._stop_for_good(pid)
            return
        self._exits_in_a_row += 1
        delay = min(self.restart_delay * 2 ** (self._exits_in_a_row - 1), MAX_RESTART_DELAY_S)
        status = self._status()
        # A crash (a traceback, a kill) leaves no status of its own: its log's last line says more.
        last_error = status.get("last_error") if self._written_by(status, pid) else None
        last_error = last_error or last_log_line(self.data_path / LOG_NAME) or "no message"
        self.say(f"the data preparer exited with status {code} ({last_error}); restarting in {delay:g} s")
        self._next_start = time.monotonic() + delay
        if self._exits_in_a_row >= FAILING_AFTER:
            self._tell_failing(
                f"the data preparer exited with a failure {self._exits_in_a_row} times in a row: {last_error}"
            )

    def _stop_for_good(self, pid: int | None) -> None:
        """The preparer met a failure that does not pass by itself: say why and what to do, once,
        and restart it no more until its files change (`_restart_once_fixed`)."""
        status = self._status()
        written = self._written_by(status, pid) and status.get("state") == "failed"
        reason = status.get("last_error") if written else None
        reason = reason or last_log_line(self.data_path / LOG_NAME) or "no message"
        fix = status.get("fix") if written else None
        self._stopped_for_good = f"{reason}; {fix}" if fix else reason
        self._inputs_at_stop = self._inputs_seen = input_stamp(self.data_path)
        self._next_input_check = time.monotonic() + self.recheck_delay
        if self._stopped_for_good == self._told_for_good:
            # The operator's change did not mend it: the notification they have still says all.
            self.say(f"the data preparer stopped for good again: {self._stopped_for_good}")
            return
        message = (f"the data preparer stopped for good: {self._stopped_for_good}; it is not restarted (the failure "
                   f"does not pass by itself): once it is fixed, this supervisor starts it again (it looks at the "
                   f"data line's files every {self.recheck_delay:g} s; meanwhile the trainer trains the cycles already "
                   "prepared, then waits for data)")  # fmt: skip
        self._told_for_good = self._stopped_for_good
        self.notify_stopped(message)  # an event: run.log has it, once

    def _restart_once_fixed(self) -> None:
        """Start the preparer again once its files changed since it stopped for good, and held still
        since the last look (a file being copied back is not taken half-copied)."""
        now = time.monotonic()
        if now < self._next_input_check:
            return
        self._next_input_check = now + self.recheck_delay
        stamp = input_stamp(self.data_path)
        settled, self._inputs_seen = stamp == self._inputs_seen, stamp
        if stamp == self._inputs_at_stop or not settled:
            return
        self.say(f"the data line's files changed since the preparer stopped for good ({self._stopped_for_good}): "
                 "starting it again")  # fmt: skip
        self._stopped_for_good = None
        self._exits_in_a_row, self._next_start = 0, 0.0

    def _tell_failing(self, message: str) -> None:
        if not self._told_failing:
            self.notify_failing(message)
            self._told_failing = True

    def stop(self, timeout: float = 60.0) -> None:
        """Stop the preparer this keeper started (SIGTERM, then SIGKILL after `timeout`), then
        delete the shards of the cycles consumed since its last round: a line that stops or ends
        leaves no consumed shards (their manifests stay, so a rollback's rebuild is exact)."""
        process = self._process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            self.say(f"data preparer stopped (pid {process.pid})")
        self._delete_consumed_shards()

    def _delete_consumed_shards(self) -> None:
        try:
            cleaned = delete_consumed_shards_unless_preparing(open_data_line(self.data_path))
        except (DataLineError, OSError) as error:
            self.say(f"consumed cycles' shards not deleted: {error}")
            return
        if cleaned:
            self.say(f"deleted the shards of consumed cycles {', '.join(map(str, cleaned))}")

    def snapshot(self) -> dict[str, Any]:
        """For `status`: the preparer's pid (when this supervisor runs it) and its status file."""
        running = self._process is not None and self._process.poll() is None
        status, problem = read_status(self.data_path)
        return {
            "pid": self._process.pid if running and self._process is not None else None,
            "exits_in_a_row": self._exits_in_a_row,
            "stopped_for_good": self._stopped_for_good,
            "status": status,
            # One line naming preparer.json and its damage, where it is no preparer's status: else the
            # status above reads as none, as if no preparer had run.
            "status_problem": problem,
        }

    def _status(self) -> dict[str, Any]:
        """preparer.json; {} when there is none or it is damaged (this keeper then decides as with
        none: a crash's log line stands in for its error). Damage is said in run.log, once until it
        changes: taken for "no status", it went without a word."""
        status, problem = read_status(self.data_path)
        if problem is not None and problem != self._told_status_problem:
            self.say(f"the data preparer's state is unknown: {problem}")
        self._told_status_problem = problem
        return status or {}


def last_log_line(log: Path) -> str | None:
    """The last non-empty line of preparer.log (a crash's exception), or None."""
    try:
        with open(log, "rb") as handle:
            handle.seek(max(0, os.fstat(handle.fileno()).st_size - 4096))
            tail = handle.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    return lines[-1][:500] if lines else None
