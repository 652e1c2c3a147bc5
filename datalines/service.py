"""`data run-preparer`: keep the next cycles ready, unattended, for as long as the line trains.

Each round: delete the shards of consumed cycles; find the cycles the trainer needs next (the
first unconsumed one and `ahead - 1` after it, up to the last cycle); wait while free disk is
below what the next missing one needs (`disk_need`: its downloads and a reserve for shards);
prepare it. A failure that may pass (network, server, an interrupted download:
`SourceUnavailable`; anything unexpected) is retried with exponential backoff, and the retry
resumes the same cycle from its fixed plan, with the same files. A failure that cannot pass
(another `DataLineError`: a corrupted input file, a source used up) stops the preparer with the
error in the status. One process writes a line's cycles and downloads at a time (`PreparerLock`).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from datalines.dataline import DataLine
from datalines.errors import DataLineError, SourceExhausted, SourceUnavailable
from datalines.planning import files_to_read
from datalines.preparer import delete_consumed_shards, prepare_cycle
from datalines.shards import token_dtype
from datalines.status import PreparerStatus, read_status, write_status

MIN_FREE_ENV = "NSCONSOLE_DATA_MIN_FREE_GB"
"""Overrides the free disk (in GiB) kept for the shards, on top of the next cycle's downloads."""
BACKOFF_INITIAL_SECONDS = 2.0
BACKOFF_MAX_SECONDS = 300.0
POLL_SECONDS = 5.0
LOCK_NAME = "preparer.lock"
PREPARING = "preparer"
"""What the preparer's hold of `preparer.lock` is called (`PreparerLock`)."""

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


def shard_reserve_bytes(line: DataLine) -> int:
    """Three cycles of shards: the one being written, the one being trained, the one ahead."""
    return 3 * line.cycle_tokens * token_dtype(line.vocab_size).itemsize


def env_min_free_bytes() -> int | None:
    """$NSCONSOLE_DATA_MIN_FREE_GB in bytes; None when unset."""
    override = os.environ.get(MIN_FREE_ENV)
    if not override:
        return None
    try:
        return int(float(override) * GIB)
    except ValueError:
        raise DataLineError(f"${MIN_FREE_ENV}: not a number of GiB, got {override!r}") from None


@dataclass(frozen=True)
class DiskNeed:
    """The free disk the preparer waits for before it prepares a cycle: a reserve for the shards,
    and the downloads the cycle makes (one hub file can be several GiB, more than the shards)."""

    reserve: int
    """The reserve: about three cycles of shards plus 1 GiB, or the minimum given."""
    reserve_text: str
    """What the reserve is, for the waiting message."""
    downloads: int
    """The pinned sizes of the files the cycle reads that are not downloaded yet."""

    @property
    def total(self) -> int:
        return self.reserve + self.downloads

    def describe(self) -> str:
        return f"{self.reserve_text}, downloads {self.downloads / GIB:.2f} GiB"


def disk_need(line: DataLine, index: int, min_free_bytes: int | None) -> DiskNeed:
    """What cycle `index` needs free before it is prepared; `min_free_bytes` replaces the shards'
    reserve (`--min-free-gb`), never the downloads: they are the preparer's own next writes."""
    downloads = download_bytes(line, index)
    if min_free_bytes is not None:
        return DiskNeed(min_free_bytes, f"minimum {min_free_bytes / GIB:.2f} GiB", downloads)
    shards = shard_reserve_bytes(line)
    return DiskNeed(shards + GIB, f"shards {shards / GIB:.2f} GiB + 1 GiB spare", downloads)


def download_bytes(line: DataLine, index: int) -> int:
    """Bytes cycle `index`'s downloads add to the disk: the pinned size of every file it reads
    (`files_to_read`: its plan's, or an estimate before it is planned) that is not on disk yet."""
    total = 0
    for name, indices in files_to_read(line, index).items():
        source = line.source(name)
        total += sum(source.files[i].size for i in indices if source.needs_download(source.files[i]))
    return total


def wanted_cycles(line: DataLine, ahead: int) -> list[int]:
    """The first unconsumed cycle and the unconsumed ones after it, `ahead` in all, not past the last
    cycle. A consumed cycle among them is skipped, never wanted: nothing makes it ready again (a
    rollback reopens the cycles it trains again), and wanting it stalled the preparer on it."""
    last = line.last_cycle()
    wanted: list[int] = []
    index = 0
    while len(wanted) < ahead and (last is None or index <= last):
        if not line.is_consumed(index):
            wanted.append(index)
        index += 1
    return wanted


class _StopRequested(BaseException):
    """`should_stop` said stop: unwinds out of a cycle in progress (not an error, never retried)."""


class PreparerLockHeld(DataLineError):
    """`preparer.lock` is held by another process: `doing` says what it does (`PREPARING`, a rebuild)."""

    def __init__(self, message: str, doing: str) -> None:
        super().__init__(message)
        self.doing = doing


class PreparerLock:
    """One process writes a line's cycles and downloads at a time: an exclusive flock on
    `preparer.lock`, held by the preparer for its life, by `data rebuild` while it rebuilds and by
    a stopping line's last deletion of consumed shards; released when the process dies.

    Two of them would write the same cycle directory and the same downloads, one deleting a file
    the other reads. The holder writes its pid and what it does into the file, so the one it
    refuses says who holds it (`PreparerLockHeld`, one line).
    """

    def __init__(self, line: DataLine, doing: str) -> None:
        path = line.path / LOCK_NAME
        self.handle = open(path, "a+")  # noqa: SIM115 (held until release, the preparer's whole life)
        try:
            fcntl.flock(self.handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.handle.close()
            held, pid = _holder(line)
            article = "another" if held == doing else "a"
            who = f" (pid {pid})" if pid is not None else ""
            raise PreparerLockHeld(f"{path}: {article} {held} runs on this line{who}", held) from None
        self.handle.truncate(0)
        self.handle.write(json.dumps({"pid": os.getpid(), "doing": doing}))
        self.handle.flush()

    def release(self) -> None:
        self.handle.truncate(0)  # a process refused later reads no pid of one gone
        fcntl.flock(self.handle, fcntl.LOCK_UN)
        self.handle.close()

    def __enter__(self) -> PreparerLock:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def _holder(line: DataLine) -> tuple[str, int | None]:
    """What the holder of `preparer.lock` does and its pid, as it wrote them; a holder that wrote
    nothing (an older nsconsole's preparer, or one between its flock and its write) is taken for
    a preparer, whose pid is in its status file."""
    try:
        written = json.loads((line.path / LOCK_NAME).read_text())
        return str(written["doing"]), int(written["pid"])
    except (OSError, ValueError, TypeError, KeyError):
        status = read_status(line.path)
        pid = status.get("pid") if isinstance(status, dict) else None
        return PREPARING, pid if isinstance(pid, int) else None


def lock_for_rebuild(line: DataLine, index: int) -> PreparerLock:
    """The lock `data rebuild --cycle index` holds while it rebuilds; PreparerLockHeld in one line
    saying what to do when a preparer holds it."""
    try:
        return PreparerLock(line, f"rebuild of cycle {index}")
    except PreparerLockHeld as held:
        if held.doing != PREPARING:
            raise
        raise PreparerLockHeld(
            f"{held}; one process writes a line's cycles and downloads at a time, and the preparer rebuilds "
            f"the damaged and reopened cycles it keeps ready itself: stop it first to rebuild cycle {index} by "
            f"hand (a line's supervisor runs one while the line trains)",
            held.doing,
        ) from None


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
    if min_free_bytes is None:
        min_free_bytes = env_min_free_bytes()
    lock = PreparerLock(line, PREPARING)
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
                    status.exited = True  # `data status` tells this exit from a crash
                    write_status(line.path, status)
                    return status
                sleep(POLL_SECONDS)
                continue
            index = missing[0]
            try:
                line.refresh_recipe()  # a schedule grown meanwhile (`data schedule`): its shares plan this cycle
                need = disk_need(line, index, min_free_bytes)
                free = shutil.disk_usage(line.path).free
                if free < need.total:
                    reason = (
                        f"disk: {free / GIB:.2f} GiB free < {need.total / GIB:.2f} GiB needed "
                        f"to prepare cycle {index} ({need.describe()})"
                    )
                    publish(state="waiting", cycle=index, waiting_reason=reason, ready=ready, message=reason)
                    sleep(POLL_SECONDS)
                    continue
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
        lock = PreparerLock(line, "supervisor's deletion of consumed shards")
    except PreparerLockHeld:
        return None
    with lock:
        return delete_consumed_shards(line)


def preparer_running(line_path: Path) -> bool:
    """Whether a preparer holds the line's lock now (the supervisor's check), or a `data rebuild`:
    either writes the line's cycles, and the supervisor starts no preparer beside it."""
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
