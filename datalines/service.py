"""`data run-preparer`: keep the next cycles ready, unattended, for as long as the line trains.

Each round: delete the shards of consumed cycles; find the cycles the trainer needs next (the
first unconsumed one and `ahead - 1` after it, up to the last cycle); wait while free disk is
below what the next missing one needs (`disk_need`: its downloads and a reserve for shards);
prepare it. A failure that may pass (network, server, an interrupted download:
`SourceUnavailable`; a full disk, anything unexpected) is retried with exponential backoff, and
the retry resumes the same cycle from its fixed plan, with the same files. A failure that cannot
pass (another `DataLineError`: a pinned input changed or gone, a dataline.json that no longer
parses, a source used up; `stops_for_good`) stops the preparer with its reason and what to do
(`datalines.failures`) in the status, state `failed`. One process writes a line's cycles and
downloads at a time (`PreparerLock`). A cycle whose documents held bytes that are not UTF-8 is
prepared all the same (they read as U+FFFD), and each such file is said in a warning.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from datalines.dataline import CONFIG_NAME, DataLine, open_data_line
from datalines.errors import DataLineError, SourceUnavailable
from datalines.failures import reason_and_fix
from datalines.planning import files_to_read
from datalines.preparer import delete_consumed_shards, invalid_utf8_bytes, prepare_cycle
from datalines.shards import token_dtype
from datalines.status import LOCK_NAME, PreparerStatus, read_status, write_status
from datalines.status import preparer_running as preparer_running  # its home before: still imported from here

MIN_FREE_ENV = "NSCONSOLE_DATA_MIN_FREE_GB"
"""Overrides the free disk (in GiB) kept for the shards, on top of the next cycle's downloads."""
BACKOFF_INITIAL_SECONDS = 2.0
BACKOFF_MAX_SECONDS = 300.0
POLL_SECONDS = 5.0
PREPARING = "preparer"
"""What the preparer's hold of `preparer.lock` is called (`PreparerLock`)."""

StatusCallback = Callable[[PreparerStatus], None]
WarningCallback = Callable[[str], None]
"""Told each warning (one line): a file whose bytes were not all UTF-8."""
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

    @staticmethod
    def warn(message: str) -> None:
        print(f"preparer: warning: {message}", flush=True)


def shard_reserve_bytes(line: DataLine) -> int:
    """Three cycles of shards: the one being written, the one being trained, the one ahead."""
    return 3 * line.cycle_tokens * token_dtype(line.vocab_size).itemsize


def env_min_free_bytes() -> int | None:
    """$NSCONSOLE_DATA_MIN_FREE_GB in bytes; None when unset."""
    override = os.environ.get(MIN_FREE_ENV)
    if not override:
        return None
    try:
        gib = float(override)
    except ValueError:
        raise DataLineError(f"${MIN_FREE_ENV}: not a number of GiB, got {override!r}") from None
    if not math.isfinite(gib) or gib < 0:
        raise DataLineError(f"${MIN_FREE_ENV}: must be a finite number of GiB >= 0, got {override!r}")
    return int(gib * GIB)


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

    def __init__(self, line_path: Path, doing: str) -> None:
        path = line_path / LOCK_NAME
        self.handle = open(path, "a+")  # noqa: SIM115 (held until release, the preparer's whole life)
        try:
            fcntl.flock(self.handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.handle.close()
            held, pid = _holder(line_path)
            article = "another" if held == doing else "a"
            who = f" (pid {pid})" if pid is not None else ""
            raise PreparerLockHeld(f"{path}: {article} {held} runs on this line{who}", held) from None
        try:
            self.handle.truncate(0)
            self.handle.write(json.dumps({"pid": os.getpid(), "doing": doing}))
            self.handle.flush()
        except OSError as error:
            with contextlib.suppress(OSError):  # its close flushes what did not go, and fails again
                self.handle.close()  # the flock goes with it
            # A full disk: the write names no file; this one is the lock's, not the cycle's.
            raise OSError(error.errno, error.strerror, str(path)) from None

    def release(self) -> None:
        self.handle.truncate(0)  # a process refused later reads no pid of one gone
        fcntl.flock(self.handle, fcntl.LOCK_UN)
        self.handle.close()

    def __enter__(self) -> PreparerLock:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def _holder(line_path: Path) -> tuple[str, int | None]:
    """What the holder of `preparer.lock` does and its pid, as it wrote them; a holder that wrote
    nothing (an older nsconsole's preparer, or one between its flock and its write) is taken for
    a preparer, whose pid is in its status file."""
    try:
        written = json.loads((line_path / LOCK_NAME).read_text())
        return str(written["doing"]), int(written["pid"])
    except (OSError, ValueError, TypeError, KeyError):
        status, _ = read_status(line_path)
        pid = None if status is None else status.get("pid")
        return PREPARING, pid if isinstance(pid, int) else None


def lock_for_rebuild(line: DataLine, index: int) -> PreparerLock:
    """The lock `data rebuild --cycle index` holds while it rebuilds; PreparerLockHeld in one line
    saying what to do when a preparer holds it."""
    try:
        return PreparerLock(line.path, f"rebuild of cycle {index}")
    except PreparerLockHeld as held:
        if held.doing != PREPARING:
            raise
        raise PreparerLockHeld(
            f"{held}; one process writes a line's cycles and downloads at a time, and the preparer rebuilds "
            f"the damaged and reopened cycles it keeps ready itself: stop it first to rebuild cycle {index} by "
            f"hand (a line's supervisor runs one while the line trains)",
            held.doing,
        ) from None


class NoDataLine(DataLineError):
    """The preparer's directory holds no dataline.json: a refusal, not a data line that broke (a
    mistyped path; a disk not mounted yet, which a later start may find)."""


def stops_for_good(error: BaseException) -> bool:
    """Whether a preparer that raised `error` stopped on a failure that does not pass by itself
    (`datalines.failures`): restarting it fails the same way until its operator acts. Not so for
    one that may pass (`SourceUnavailable`), nor for a start refused because another process holds
    the line's lock (`PreparerLockHeld`: it is that process's to prepare) or no data line is there
    (`NoDataLine`)."""
    passing = (SourceUnavailable, PreparerLockHeld, NoDataLine)
    return isinstance(error, DataLineError) and not isinstance(error, passing)


def run_preparer_at(
    path: Path,
    ahead: int = 2,
    min_free_bytes: int | None = None,
    once: bool = False,
    on_status: StatusCallback | None = None,
    on_warning: WarningCallback | None = None,
) -> PreparerStatus:
    """`data run-preparer` and a supervisor's preparer: open the data line at `path`, then
    `run_preparer`. A dataline.json (or tokenizer) that does not open is a failure that does not
    pass, recorded as one in preparer.json, under the lock (it is not another preparer's status
    to overwrite), before it is raised; a directory without dataline.json is no data line
    (`NoDataLine`), and gets no status."""
    try:
        line = open_data_line(path)
    except DataLineError as error:
        if not (path / CONFIG_NAME).is_file():
            raise NoDataLine(str(error)) from None
        with PreparerLock(path, PREPARING):  # PreparerLockHeld: another preparer runs, and says
            _record_failure(path, PreparerStatus(), error, on_status)
        raise
    return run_preparer(line, ahead, min_free_bytes, once, on_status, on_warning=on_warning)


def _record_failure(
    line_path: Path, status: PreparerStatus, error: DataLineError, on_status: StatusCallback | None
) -> None:
    """Write the failure that stops the preparer into its status: state `failed`, why, what to do."""
    reason, fix = reason_and_fix(error)
    status.state, status.message, status.last_error, status.fix = "failed", f"{reason}; {fix}", reason, fix
    status.waiting_reason = None
    status.failures += 1
    status.consecutive_failures += 1
    if on_status is not None:
        on_status(status)
    write_status(line_path, status)


def run_preparer(
    line: DataLine,
    ahead: int = 2,
    min_free_bytes: int | None = None,
    once: bool = False,
    on_status: StatusCallback | None = None,
    should_stop: Callable[[PreparerStatus], bool] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    on_warning: WarningCallback | None = None,
) -> PreparerStatus:
    """Run until the last cycle is consumed (or, with `once`, until the wanted cycles are ready).

    `should_stop(status)` is asked after every status change, mid-cycle too (tests and
    in-process use); the final status is returned. A cycle stopped mid-way leaves only its
    partial directory, removed by the next preparer. A failure that cannot pass
    (`stops_for_good`) is written to the status file (state `failed`, its reason and fix), then
    raised. `on_warning` is told each file whose bytes were not all UTF-8, per cycle prepared.
    """
    if ahead < 1:
        raise DataLineError(f"--ahead must be >= 1, got {ahead}")
    if min_free_bytes is None:
        min_free_bytes = env_min_free_bytes()
    lock = PreparerLock(line.path, PREPARING)
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

                manifest = prepare_cycle(line, index, progress)
                if manifest is not None and on_warning is not None:
                    for warning in invalid_utf8_warnings(line, manifest):
                        on_warning(warning)
                backoff = BACKOFF_INITIAL_SECONDS
                publish(consecutive_failures=0, progress=1.0, prepared=status.prepared + 1,
                        message=f"cycle {index} ready")
                continue
            except SourceUnavailable as error:  # said in its own words (it names the source and file)
                failure = str(error)
            except DataLineError:
                raise  # does not pass: stops the preparer (below)
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
    except DataLineError as error:
        if stops_for_good(error):
            _record_failure(line.path, status, error, on_status)
        raise
    finally:
        lock.release()


def invalid_utf8_warnings(line: DataLine, manifest: dict[str, Any]) -> list[str]:
    """One line per file whose documents in the cycle held bytes that are not UTF-8."""
    warnings = []
    for name, files in invalid_utf8_bytes(manifest).items():
        source = line.source(name)
        by_path = {file.path: file for file in source.files}
        for relative, count in sorted(files.items()):
            where = source.local_path(by_path[relative]) if relative in by_path else None
            bytes_are = f"{count:,} byte that is" if count == 1 else f"{count:,} bytes that are"
            warnings.append(f"cycle {manifest['cycle']}: {where or relative}: source {name}: {bytes_are} not "
                            "UTF-8, replaced by U+FFFD (the data is kept)")  # fmt: skip
    return warnings


def delete_consumed_shards_unless_preparing(line: DataLine) -> list[int] | None:
    """The last pass of a stopping line: delete consumed cycles' shards under the preparer lock.

    A line that stops right after a cycle end marks that cycle consumed after its preparer's last
    round; without this pass its shards would outlive the line. None when another preparer holds
    the lock: that one deletes them at its next round. Returns the cycles cleaned now.
    """
    try:
        lock = PreparerLock(line.path, "supervisor's deletion of consumed shards")
    except PreparerLockHeld:
        return None
    with lock:
        return delete_consumed_shards(line)
