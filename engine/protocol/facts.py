"""Facts that cross process boundaries, each with one typed home.

The supervisor writes line states to supervisor.json and its `status` replies; the trainer writes
heartbeat stages and stop reasons to `<line>/heartbeat` and exits with an `ExitCode` the
supervisor reads; both publish `EventKind`s to subscribers. The console, the CLI, the supervisor
and the trainer all import these names, so a value written by one process is a value the others
know. Each enum is a `str` (or `int`) subclass: JSON writes its value and a value read back from
a file compares equal to its member.
"""

from __future__ import annotations

from enum import Enum, IntEnum


class _Fact(str, Enum):
    """A string fact: formats, prints and serialises as its value."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class LineState(_Fact):
    """What a line's supervisor is doing (supervisor.json `state`, the `status` reply's `state`)."""

    STARTING = "starting"
    WAITING_GPU = "waiting-gpu"
    """Waiting for the GPU's lease, or for other processes to leave the GPU."""
    TRAINING = "training"
    """A trainer runs (its heartbeat's stage says what it does)."""
    PAUSING = "pausing"
    """The trainer stops (a checkpoint first) for work that needs it stopped: a rollback or a tune."""
    ROLLING_BACK = "rolling-back"
    TUNING = "tuning"
    RELAUNCHING = "relaunching"
    """Between a trainer's exit and its next launch (after a crash: backing off)."""
    STOPPING = "stopping"
    """The trainer was asked to stop (SIGTERM: it checkpoints first)."""
    FINISHED = "finished"
    """The line reached its end (the plan, the data line's end, or `--stop-at`)."""
    STOPPED = "stopped"
    """The line stopped on request."""
    FAILED = "failed"
    """A line error, or repeated crashes without progress."""
    STUCK = "stuck"
    """The trainer was killed but would not exit."""
    DISK_FULL = "disk-full"
    """The disk filled: the line checkpointed while it could and waits for the operator."""

    @property
    def final(self) -> bool:
        """The supervisor exits in this state: its socket then goes quiet, which is no fault."""
        return self in FINAL_LINE_STATES


FINAL_LINE_STATES = frozenset(
    {LineState.FINISHED, LineState.STOPPED, LineState.FAILED, LineState.STUCK, LineState.DISK_FULL}
)
"""The states a supervisor exits in."""

FAULT_LINE_STATES = frozenset({LineState.FAILED, LineState.STUCK, LineState.DISK_FULL})
"""The final states of a line that ended without being asked to: it waits for its operator
(`nsconsole status` exits `StatusExitCode.NEEDS_OPERATOR`; its supervisor exited
`SupervisorExitCode.FAILED`). The other final states, `finished` and `stopped`, are ends as asked."""


class Stage(_Fact):
    """What the trainer is doing (`<line>/heartbeat` `stage`)."""

    TRAINING = "training"
    CHECKPOINTING = "checkpointing"
    VALIDATING = "validating"
    CAPTURING = "capturing"
    """Making a length's CUDA-graph engine: its warm-up compiles kernels, then the capture."""
    COMPILING = "compiling"
    """A length's first eager update on CUDA, where its compiled kernels are built."""
    PROBING = "probing"
    """One row of each validation probe, before a capture (a failing probe stops the line now)."""
    DREAMING = "dreaming"
    """PSSA dreaming after an update (run.json `dreaming`): guarded rehearsal on the output head."""
    WAITING_DATA = "waiting-data"
    """Waiting for the data preparer to make the next cycle ready (`cycle` says which)."""
    STOPPED = "stopped"
    """The trainer has ended (`reason` says why)."""


class StopReason(_Fact):
    """Why the trainer ended (the heartbeat's `reason` with stage `stopped`, and run.log)."""

    STOP_AT = "reached --stop-at"
    """The line goes on when run again."""
    STOP_FILE = "stop requested"
    DATA_END = "the data line has ended"
    PLAN_END = "the plan is complete"
    GPU_BUSY = "gpu busy"
    """It checkpointed and left the GPU to other processes."""
    NON_FINITE = "non-finite updates"
    """Too many non-finite updates in a row."""
    DISK_FULL = "disk full"


class EventKind(_Fact):
    """A line event: pushed to subscribers; those in `NOTIFIED_EVENTS` also reach host.json's
    `notify` command and supervisor.json's `last_event`."""

    LAUNCHED = "launched"
    FINISHED = "finished"
    STOPPED = "stopped"
    FAILED = "failed"
    CRASHED = "crashed"
    STUCK = "stuck"
    WATCHDOG_RESTART = "watchdog_restart"
    SIGNAL_RESTART = "signal_restart"
    DISK_FULL = "disk_full"
    DATA_WAIT = "data_wait"
    GPU_WAIT = "gpu_wait"
    GPU_BUSY = "gpu_busy"
    PREPARER_FAILING = "preparer_failing"
    SUPERVISOR_FAILED = "supervisor_failed"
    BRANCHED = "branched"
    BRANCH_FAILED = "branch_failed"
    BRANCH_START_FAILED = "branch_start_failed"
    ROLLED_BACK = "rolled_back"
    ROLLBACK_FAILED = "rollback_failed"
    TUNED = "tuned"
    TUNE_FAILED = "tune_failed"


NOTIFIED_EVENTS: dict[EventKind, str] = {
    EventKind.FINISHED: "the line reached its end (or the stop it was asked for)",
    EventKind.FAILED: "the line stopped after repeated failures without progress, or could not start",
    EventKind.STUCK: "no heartbeat for the watchdog interval, and the trainer could not be killed",
    EventKind.WATCHDOG_RESTART: "no heartbeat for the watchdog interval: the trainer was killed and relaunched",
    EventKind.SIGNAL_RESTART: "the trainer stopped on a signal the supervisor did not send and was relaunched",
    EventKind.DISK_FULL: "the disk filled up: the line checkpointed (while it could) and stopped",
    EventKind.DATA_WAIT: "the trainer has waited for data longer than the watchdog interval",
    EventKind.GPU_WAIT: "the line has waited for the GPU longer than the watchdog interval",
    EventKind.PREPARER_FAILING: (
        "the data preparer keeps failing, or stopped on a failure that does not pass by itself and is not "
        "restarted (`stopped_for_good`: true; the trainer waits once the cycles prepared are trained)"
    ),
    EventKind.SUPERVISOR_FAILED: "the supervisor itself failed",
    EventKind.BRANCH_FAILED: "a queued branch could not be forked at its cycle end, or its cycle never came",
}
"""Every event the operator is told about (the spec's list, and `branch_failed`: a branch asked
for hours before fails while nobody watches) and what it means."""

ENDING_EVENTS: dict[EventKind, LineState] = {
    EventKind.FINISHED: LineState.FINISHED,
    EventKind.STOPPED: LineState.STOPPED,
    EventKind.FAILED: LineState.FAILED,
    EventKind.STUCK: LineState.STUCK,
    EventKind.DISK_FULL: LineState.DISK_FULL,
}
"""The events a supervisor publishes as its line ends, and the final state each leaves it in."""

ERROR_EVENTS = frozenset({
    EventKind.FAILED, EventKind.STUCK, EventKind.SUPERVISOR_FAILED, EventKind.DISK_FULL,
    EventKind.BRANCH_FAILED, EventKind.BRANCH_START_FAILED, EventKind.ROLLBACK_FAILED, EventKind.TUNE_FAILED,
})
"""Events that are errors (the console shows and rings them as such)."""


class TrainerExitCode(IntEnum):
    """The trainer process's exit status, as the supervisor reads it (a crash is any other)."""

    OK = 0
    """A clean end: a stop, `--stop-at`, the plan's or the data's end (the heartbeat's reason says which)."""
    LINE_ERROR = 2
    """A line error a relaunch would not fix: the line fails with the trainer's one-line message."""
    DISK_FULL = 74
    """The disk filled: the line stops for the operator (EX_IOERR)."""
    GPU_BUSY = 75
    """It left the GPU to other processes: relaunch once the GPU is free (EX_TEMPFAIL)."""


SIGNAL_EXIT_BASE = 128
"""A trainer stopped by signal n (with a checkpoint, on SIGTERM) exits with 128 + n, as a shell reports it."""


class SupervisorExitCode(IntEnum):
    """The supervisor's (and `nsconsole run`'s) exit status."""

    OK = 0
    """The line ended or was stopped."""
    FAILED = 1
    """The line failed, got stuck or filled the disk."""
    USER_ERROR = 2
    """The command was refused (a one-line error on stderr)."""


class PreparerExitCode(IntEnum):
    """The data preparer's exit status (`nsconsole data run-preparer`, and the one a supervisor
    runs beside its trainer), as the supervisor reads it: any status but these is a crash (or a
    start refused, e.g. another preparer holds the data line's lock), restarted with backoff."""

    OK = 0
    """It ended on its own: every cycle of the data line is consumed (or, with --once, the cycles
    wanted are ready)."""
    STOPPED_FOR_GOOD = 78
    """It stopped on a failure that does not pass by itself (a source used up, a pinned file changed
    or gone, a dataline.json that no longer parses): preparer.json says why and what to do (state
    `failed`, `last_error`, `fix`). Its supervisor does not restart it; the trainer trains the
    cycles already prepared, then waits. 78, as sysexits' EX_CONFIG."""


class StatusExitCode(IntEnum):
    """`nsconsole status LINE`'s exit status: whether the line needs its operator, for a script or a
    cron job that reads no report (as `systemctl status` exits 0 for a unit running, 3 for one not).

    Read from the line's files, as the report is: the state its supervisor saved, and whether that
    supervisor (or a trainer of its own) still runs."""

    OK = 0
    """Nothing to do: a supervisor, or a trainer run without one, runs the line (whatever it does or
    waits for: the GPU, data, a relaunch after a crash), or the line rests where it was left:
    finished, stopped on request, never run under a supervisor."""
    INVALID_RUN_JSON = 1
    """run.json is invalid, whatever the line's state: it would not start again (the report names the
    problem and shows the rest). 1, as `check` fails a check and `data status` reports damage."""
    USER_ERROR = SupervisorExitCode.USER_ERROR
    """The command was refused, as every command's user error (LINE is not a training line: one line
    on stderr)."""
    NEEDS_OPERATOR = 3
    """The line stopped without being asked to and will not go on by itself: it failed, got stuck or
    filled the disk (`FAULT_LINE_STATES`), or its supervisor is gone without saving a final state
    (killed, the host rebooted; `nsconsole resume` starts it again), or its trainer waits for data
    that will not come (its data line's preparer stopped for good: `PreparerExitCode.STOPPED_FOR_GOOD`).
    3, as systemctl's "not running"."""


class Engine(_Fact):
    """The trainer's step engine (`--engine`)."""

    AUTO = "auto"
    """CUDA graphs on a GPU, eager on the CPU."""
    EAGER = "eager"
    GRAPH = "graph"


ENGINE_CHOICES = tuple(engine.value for engine in Engine)
"""The `--engine` values, for argument parsers."""
