"""`data run-preparer`: keep the next cycles ready, unattended, for as long as the line trains.

Each round: delete the shards of consumed cycles; find the cycles the trainer needs next (the
first unconsumed one and `ahead - 1` after it, up to the last cycle); wait while free disk is
below the threshold; prepare the next missing one. A failure that may pass (network, server,
an interrupted download: `SourceUnavailable`; anything unexpected) is retried with exponential
backoff, and the retry resumes the same cycle from its fixed plan, with the same files. A failure
that cannot pass (another `DataLineError`: a corrupted input file, a source used up) stops the
preparer with the error in the status.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from datalines.dataline import DataLine
from datalines.errors import DataLineError, SourceExhausted, SourceUnavailable
from datalines.preparer import delete_consumed_shards, prepare_cycle
from datalines.shards import token_dtype
from datalines.status import PreparerStatus, write_status

MIN_FREE_ENV = "NSCONSOLE_DATA_MIN_FREE_GB"
"""Overrides the free-disk threshold (in GB, decimal) below which the preparer waits."""
BACKOFF_INITIAL_SECONDS = 2.0
BACKOFF_MAX_SECONDS = 300.0
POLL_SECONDS = 5.0
LOCK_NAME = "preparer.lock"

StatusCallback = Callable[[PreparerStatus], None]
GIB = 1 << 30
"""2**30 bytes: every `*_gb` setting is GiB. (engine.units holds the same for the layers above;
datalines sits below them and imports nothing of theirs.)"""


class StatusLines:
    """A status callback that prints one line per change of the preparer's status (for a log or a
    pipe; a terminal gets a progress bar instead). Progress within a cycle is not a change."""

    def __init__(self) -> None:
        self.last_line = ""

    def __call__(self, status: PreparerStatus) -> None:
        line = f"{status.state}: {status.waiting_reason or status.message}"
        if (status.state != "preparing" or status.progress in (0.0, 1.0)) and line != self.last_line:
            print(f"preparer: {line}", flush=True)
        self.last_line = line


def default_min_free_bytes(line: DataLine) -> int:
    """Room for about three cycles of shards plus 1 GiB, or the env override."""
    override = os.environ.get(MIN_FREE_ENV)
    if override:
        try:
            return int(float(override) * GIB)
        except ValueError:
            raise DataLineError(f"${MIN_FREE_ENV}: not a number of GiB, got {override!r}") from None
    return 3 * line.cycle_tokens * token_dtype(line.vocab_size).itemsize + GIB


def wanted_cycles(line: DataLine, ahead: int) -> list[int]:
    """The first unconsumed cycle and the ones after it, `ahead` in all, not past the last cycle."""
    first = 0
    while line.is_consumed(first):
        first += 1
    last = line.last_cycle()
    wanted = range(first, first + ahead)
    return [index for index in wanted if last is None or index <= last]


class _StopRequested(BaseException):
    """`should_stop` said stop: unwinds out of a cycle in progress (not an error, never retried)."""


class _Lock:
    """One preparer per line: an exclusive flock on `preparer.lock`, released when the process dies."""

    def __init__(self, line: DataLine) -> None:
        self.handle = open(line.path / LOCK_NAME, "a+")  # noqa: SIM115 (held for the process's life)
        try:
            fcntl.flock(self.handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.handle.close()
            raise DataLineError(f"{line.path / LOCK_NAME}: another preparer runs on this line") from None

    def release(self) -> None:
        fcntl.flock(self.handle, fcntl.LOCK_UN)
        self.handle.close()


def run_preparer(
    line: DataLine,
    ahead: int = 2,
    min_free_bytes: int | None = None,
    once: bool = False,
    on_status: StatusCallback | None = None,
    should_stop: Callable[[PreparerStatus], bool] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> PreparerStatus:
    """Run until the last cycle is consumed (or, with `once`, until the wanted cycles are ready).

    `should_stop(status)` is asked after every status change, mid-cycle too (tests and
    in-process use); the final status is returned. A cycle stopped mid-way leaves only its
    partial directory, removed by the next preparer. Raises DataLineError for a failure that
    cannot pass, after writing it to the status file.
    """
    if ahead < 1:
        raise DataLineError(f"--ahead must be >= 1, got {ahead}")
    threshold = default_min_free_bytes(line) if min_free_bytes is None else min_free_bytes
    lock = _Lock(line)
    status = PreparerStatus()
    backoff = BACKOFF_INITIAL_SECONDS

    def publish(**changes: object) -> None:
        for key, value in changes.items():
            setattr(status, key, value)
        # Said on screen before the status file shows it: whoever reads the file (the supervisor,
        # a test) and then stops the preparer finds the line already printed (the other order
        # lost "waiting: disk: ..." to a SIGTERM right after the file changed, on a loaded machine).
        if on_status is not None:
            on_status(status)
        write_status(line.path, status)
        if should_stop is not None and should_stop(status):
            raise _StopRequested

    try:
        while True:
            delete_consumed_shards(line)
            wanted = wanted_cycles(line, ahead)
            missing = [index for index in wanted if not line.cycle_ready(index)]
            ready = [index for index in wanted if index not in missing]
            if not wanted:
                publish(state="finished", cycle=None, progress=1.0, ready=[], waiting_reason=None,
                        message=f"every cycle up to the last ({line.last_cycle()}) is consumed")
                return status
            if not missing:
                publish(state="ready", cycle=None, progress=1.0, ready=ready, waiting_reason=None,
                        message=f"cycles {ready[0]}..{ready[-1]} ready")
                if once:
                    return status
                sleep(POLL_SECONDS)
                continue
            index = missing[0]
            free = shutil.disk_usage(line.path).free
            if free < threshold:
                reason = (
                    f"disk: {free / GIB:.2f} GiB free < {threshold / GIB:.2f} GiB needed "
                    f"to prepare cycle {index}"
                )
                publish(state="waiting", cycle=index, waiting_reason=reason, ready=ready, message=reason)
                sleep(POLL_SECONDS)
                continue
            try:
                publish(state="preparing", cycle=index, progress=0.0, waiting_reason=None, ready=ready,
                        message=f"preparing cycle {index}")

                def progress(fraction: float, message: str) -> None:
                    publish(progress=fraction, message=message)

                prepare_cycle(line, index, progress)
                backoff = BACKOFF_INITIAL_SECONDS
                publish(consecutive_failures=0, progress=1.0, prepared=status.prepared + 1,
                        message=f"cycle {index} ready")
                continue
            except SourceUnavailable as error:  # said in its own words (it names the source and file)
                failure = str(error)
            except (SourceExhausted, DataLineError) as error:
                publish(state="failed", last_error=str(error), failures=status.failures + 1,
                        consecutive_failures=status.consecutive_failures + 1, message=str(error))
                raise
            except Exception as error:  # anything else may pass too
                failure = f"{type(error).__name__}: {error}"
            # Retried with backoff, the same cycle from its fixed plan.
            reason = f"cycle {index} failed ({failure}); retrying in {backoff:.0f} s"
            publish(state="retrying", last_error=failure,
                    failures=status.failures + 1, consecutive_failures=status.consecutive_failures + 1,
                    waiting_reason=reason, message=reason)
            sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX_SECONDS)
    except _StopRequested:
        return status
    except KeyboardInterrupt:  # SIGINT, or SIGTERM as `data run-preparer` maps it: say so, then go
        status.state, status.message, status.waiting_reason = "stopped", "stopped by a signal", None
        write_status(line.path, status)
        raise
    finally:
        lock.release()


def delete_consumed_shards_unless_preparing(line: DataLine) -> list[int] | None:
    """The last pass of a stopping line: delete consumed cycles' shards under the preparer lock.

    A line that stops right after a cycle end marks that cycle consumed after its preparer's last
    round; without this pass its shards would outlive the line. None when another preparer holds
    the lock: that one deletes them at its next round. Returns the cycles cleaned now.
    """
    try:
        lock = _Lock(line)
    except DataLineError:
        return None
    try:
        return delete_consumed_shards(line)
    finally:
        lock.release()


def preparer_running(line_path: Path) -> bool:
    """Whether a preparer holds the line's lock now (the supervisor's check)."""
    path = line_path / LOCK_NAME
    if not path.exists():
        return False
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False
