"""The supervisor's verdict on a trainer's exit: a pure function of what is known at that moment.

`judge_exit(TrainerExit, ExitContext) -> Verdict` is the spec's recovery table (the trainer
crashes or is killed, the GPU hangs, another process appears on the GPU, the disk fills up, a
SIGTERM it did not send, a line error, a stop). It reads no file and changes nothing: the
`Supervisor` gathers the context (the heartbeat's reason, its stop requests, its counters, the
newest lines of run.log), applies the verdict (run.log lines, events, counters, state) and
relaunches or ends. Every row is unit-tested without a process.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field, replace
from typing import Any

from engine.gpu.placement import gpus_label
from engine.protocol.facts import (
    SIGNAL_EXIT_BASE,
    EventKind,
    LineState,
    StopReason,
    SupervisorExitCode,
    TrainerExitCode,
)

CRASHES_BESIDE_OTHERS = 3
"""Crashes in a row beside other GPU processes after which the line waits for a free GPU."""


@dataclass
class TrainerExit:
    """How one launch of the trainer ended."""

    code: int | None
    """The exit status (a negative one: killed by that signal); None when it would not exit."""
    ran_seconds: float
    """How long it ran."""
    killed_by_watchdog: bool = False
    """The supervisor killed it for a missing heartbeat."""
    stopped_by_us: bool = False
    """The supervisor sent it the SIGTERM (a stop it asked for)."""
    stop_requested: bool = False
    """A STOP request was pending while it ran (a clean exit then is a stop, not the end)."""
    stop_served: bool = False
    """It beat `stopped` for the STOP request (its checkpoint written) before it exited: a status
    other than 0 after that (a rank that failed on its way out) ends no training."""
    progressed: bool = False
    """The line's newest checkpoint is newer than at the launch."""
    others_on_gpu: list[int] = field(default_factory=list)
    """Pids of other processes on the line's GPU at the supervisor's last look before or at the exit."""
    paused_for_work: bool = False
    """The supervisor stopped it (SIGTERM) for work that needs the trainer stopped (a rollback, a tune)."""


@dataclass(frozen=True)
class ExitContext:
    """What the supervisor knows besides the exit itself."""

    heartbeat_reason: str | None
    """The trainer's last heartbeat's `reason` (a `StopReason` value when it ended cleanly)."""
    stop_signal: int | None
    """The signal that asked the supervisor to stop (SIGTERM, SIGINT, SIGHUP), or None."""
    stop_asked: bool
    """A stop came over the socket."""
    stop_pending_now: bool
    """A STOP file asks for a stop at the next update (not at a cycle end)."""
    failures_in_a_row: int
    """Crashes so far since the last launch that left a newer checkpoint."""
    crashes_beside_others: int
    """Crashes in a row without progress beside other GPU processes so far."""
    max_failures: int
    """Failures in a row after which the line fails."""
    gpu_indices: tuple[int, ...]
    """The line's GPUs, one a rank (empty: the CPU)."""
    watchdog_seconds: float
    """The heartbeat interval after which the trainer is killed."""
    last_error: str | None
    """The last error line of run.log (the trainer's one-line message), if any."""

    @property
    def stopping(self) -> bool:
        return self.stop_signal is not None


@dataclass(frozen=True)
class Notice:
    """An event the verdict raises."""

    kind: EventKind
    message: str
    notified: bool
    """Told to the operator too (run.log, host.json's notify, supervisor.json's last_event);
    else only pushed to subscribers."""


@dataclass(frozen=True)
class Verdict:
    """What to do after the exit. `exit_status` None: relaunch (after the backoff)."""

    exit_status: SupervisorExitCode | None
    """The supervisor's exit status when the line is over; None to relaunch."""
    state: LineState | None = None
    """The line's final state when it is over."""
    notices: tuple[Notice, ...] = ()
    said: tuple[str, ...] = ()
    """run.log lines, before the notices."""
    failures_in_a_row: int = 0
    crashes_beside_others: int = 0
    discard_stop: bool = False
    """The stop it served is done: remove a STOP file left behind."""
    fork_at_end: bool | None = None
    """Fork the queued branches whose cycle ended: True when the line reached its end, False at
    `--stop-at` (the line goes on); None: not now."""
    wait_for_free_gpu: bool = False
    """Relaunch only once no other process is on the GPU ..."""
    others_may_stay: bool = False
    """... or once they hold no more than the share reserve (the trainer trained, then left)."""
    crashed: bool = False
    """The trainer ended without being asked to (a crash, a kill, the watchdog's kill, a SIGTERM the
    supervisor did not send): counted in supervisor.json's `crashes`, the console's restarts. A
    relaunch the line asked for (a rollback, a tune, a stop and resume, the GPU left to others) is none."""


def judge_exit(outcome: TrainerExit, context: ExitContext) -> Verdict:
    """The verdict on one exit; see the module docstring."""
    code = outcome.code
    keep = {"failures_in_a_row": context.failures_in_a_row, "crashes_beside_others": context.crashes_beside_others}
    if code is None:
        message = "the trainer was killed but does not exit (the GPU may hang); stopping"
        return Verdict(SupervisorExitCode.FAILED, LineState.STUCK, (Notice(EventKind.STUCK, message, True),),
                       crashed=True, **keep)
    if outcome.paused_for_work and not outcome.stopped_by_us:
        if context.stopping or context.heartbeat_reason == StopReason.STOP_FILE or context.stop_pending_now:
            return _stopped("the line stopped on request", keep)
        return Verdict(None, said=("the trainer stopped for the work asked of the line",), **keep)
    if code == 0:
        reason = context.heartbeat_reason or "stopped"
        # The line's end is its end, whatever stop came as it ended: finished (told, its branches queued
        # at that end forked), and the stop is moot.
        ended = reason in (StopReason.DATA_END, StopReason.PLAN_END)
        asked = context.stopping or outcome.stop_requested or context.stop_asked or reason == StopReason.STOP_FILE
        if asked and not ended:
            return _stopped(f"the line stopped: {reason}", keep)
        notice = Notice(EventKind.FINISHED, f"the line stopped: {reason}", True)
        return Verdict(SupervisorExitCode.OK, LineState.FINISHED, (notice,), fork_at_end=reason != StopReason.STOP_AT,
                       discard_stop=ended, **keep)
    if outcome.stopped_by_us or (context.stopping and code in signal_codes(context.stop_signal)):
        return _stopped("the line stopped on request", keep)
    if outcome.stop_served:  # a relaunch would train on against the request (its STOP file is gone)
        message = f"the line stopped on request (the trainer then exited with status {describe_code(code)})"
        return _stopped(message, keep)
    if code == TrainerExitCode.LINE_ERROR:
        notice = Notice(EventKind.FAILED, context.last_error or "the trainer refused to run the line", True)
        return Verdict(SupervisorExitCode.FAILED, LineState.FAILED, (notice,), **keep)
    if code == TrainerExitCode.DISK_FULL:
        # A relaunch would stop again at once: the operator frees space, then runs the line.
        notice = Notice(EventKind.DISK_FULL, context.last_error or "the disk is full", True)
        return Verdict(SupervisorExitCode.FAILED, LineState.DISK_FULL, (notice,), **keep)
    if context.stop_pending_now:
        # A stop asked for at the next update and not yet served: a relaunch would load the newest
        # checkpoint only to stop at its first update boundary, where the line stands now.
        message = (f"the line stopped on request: the trainer exited with status {describe_code(code)} before "
                   "serving it, so its newest checkpoint stands")
        return replace(_stopped(message, keep), crashed=True)
    if code == TrainerExitCode.GPU_BUSY:
        said = f"the trainer left {gpus_label(context.gpu_indices)} to other processes: relaunching once it is free"
        notice = Notice(EventKind.GPU_BUSY, "the trainer checkpointed and left the GPU to other processes", False)
        # A trainer that trained and then left (an in-process switch that could not get its memory,
        # say) starts again beside them if they fit; one that left at once waits.
        return Verdict(None, notices=(notice,), said=(said,), wait_for_free_gpu=True,
                       others_may_stay=outcome.progressed, **keep)
    sigterm = code in signal_codes(signal.SIGTERM)
    if not outcome.killed_by_watchdog and not sigterm and outcome.others_on_gpu:
        return _crash_beside_others(outcome, context, keep)
    if outcome.killed_by_watchdog:
        message = f"no heartbeat for {context.watchdog_seconds:g} s: the trainer was killed and is relaunched"
        notices: tuple[Notice, ...] = (Notice(EventKind.WATCHDOG_RESTART, message, True),)
        said: tuple[str, ...] = ()
    elif sigterm:
        message = "the trainer stopped on a SIGTERM the supervisor did not send"
        notices, said = (Notice(EventKind.SIGNAL_RESTART, message, True),), ()
    else:
        message = f"the trainer exited with status {describe_code(code)}"
        notices, said = (Notice(EventKind.CRASHED, message, False),), (message,)
    failures = 0 if outcome.progressed else context.failures_in_a_row
    if not (outcome.progressed and sigterm):
        failures += 1
    if failures >= context.max_failures:
        message = (f"{failures} failures in a row without progress; the line stops "
                   f"(last exit: {describe_code(code)})")
        notices += (Notice(EventKind.FAILED, message, True),)
        return Verdict(SupervisorExitCode.FAILED, LineState.FAILED, notices, said, failures,
                       context.crashes_beside_others, crashed=True)
    return Verdict(None, None, notices, said, failures, context.crashes_beside_others, crashed=True)


def _stopped(message: str, keep: dict[str, Any]) -> Verdict:
    # Not notified (the operator asked for it), but said in run.log, as a finished line's end is.
    notice = Notice(EventKind.STOPPED, message, False)
    return Verdict(SupervisorExitCode.OK, LineState.STOPPED, (notice,), (f"{EventKind.STOPPED}: {message}",),
                   discard_stop=True, **keep)


def _crash_beside_others(outcome: TrainerExit, context: ExitContext, keep: dict[str, Any]) -> Verdict:
    """A crash with other processes on the GPU is theirs as much as ours: not a failure; a few in a
    row without progress and the line waits for a free GPU."""
    assert outcome.code is not None
    crashes = 1 if outcome.progressed else context.crashes_beside_others + 1
    message = (f"the trainer exited with status {describe_code(outcome.code)} beside other processes on "
               f"{gpus_label(context.gpu_indices)} (pids {outcome.others_on_gpu}): not counted as a failure")
    verdict = Verdict(None, notices=(Notice(EventKind.CRASHED, message, False),), said=(message,), crashed=True,
                      **keep)
    if crashes >= CRASHES_BESIDE_OTHERS:
        said = (message, f"{crashes} crashes in a row beside other processes: waiting for a free GPU")
        return replace(verdict, said=said, crashes_beside_others=0, wait_for_free_gpu=True)
    return replace(verdict, crashes_beside_others=crashes)


def signal_codes(number: int | None) -> tuple[int, ...]:
    """The exit statuses of a process ended by signal `number`: the trainer's 128 + n, or -n."""
    return () if number is None else (SIGNAL_EXIT_BASE + number, -number)


def describe_code(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    if code > 128 and code - 128 in signal.valid_signals():
        return f"{code} (stopped on {signal.Signals(code - 128).name})"
    return str(code)
