"""The supervisor's verdict on a trainer's exit, row by row of the spec's recovery table."""

from __future__ import annotations

import signal
from dataclasses import replace

import pytest

from engine.protocol.facts import EventKind, LineState, StopReason, SupervisorExitCode, TrainerExitCode
from engine.supervisor.verdict import CRASHES_BESIDE_OTHERS, ExitContext, TrainerExit, judge_exit

CONTEXT = ExitContext(
    heartbeat_reason=None, stop_signal=None, stop_asked=False, stop_pending_now=False,
    failures_in_a_row=0, crashes_beside_others=0, max_failures=5, gpu_indices=(0,),
    watchdog_seconds=1800.0, last_error=None,
)
SIGTERM_EXIT = 128 + signal.SIGTERM


def kinds(verdict) -> list[str]:
    return [notice.kind for notice in verdict.notices]


def test_a_trainer_that_would_not_exit_leaves_the_line_stuck() -> None:
    verdict = judge_exit(TrainerExit(None, 10.0, killed_by_watchdog=True), CONTEXT)
    assert (verdict.exit_status, verdict.state) == (SupervisorExitCode.FAILED, LineState.STUCK)
    assert kinds(verdict) == [EventKind.STUCK] and verdict.notices[0].notified


def test_a_clean_end_finishes_the_line_and_forks_at_its_end() -> None:
    context = replace(CONTEXT, heartbeat_reason=StopReason.PLAN_END)
    verdict = judge_exit(TrainerExit(0, 10.0), context)
    assert (verdict.exit_status, verdict.state) == (SupervisorExitCode.OK, LineState.FINISHED)
    assert kinds(verdict) == [EventKind.FINISHED] and verdict.notices[0].notified
    assert verdict.fork_at_end is True and verdict.notices[0].message == "the line stopped: the plan is complete"


def test_stop_at_finishes_the_run_but_not_the_line() -> None:
    verdict = judge_exit(TrainerExit(0, 10.0), replace(CONTEXT, heartbeat_reason=StopReason.STOP_AT))
    assert verdict.state == LineState.FINISHED and verdict.fork_at_end is False


@pytest.mark.parametrize("how", ["signal", "stop_requested", "stop_asked", "stop_file_reason"])
def test_a_clean_exit_after_a_stop_is_a_stop(how: str) -> None:
    context, outcome = CONTEXT, TrainerExit(0, 10.0)
    if how == "signal":
        context = replace(context, stop_signal=signal.SIGTERM)
    elif how == "stop_requested":
        outcome = replace(outcome, stop_requested=True)
    elif how == "stop_asked":
        context = replace(context, stop_asked=True)
    else:
        context = replace(context, heartbeat_reason=StopReason.STOP_FILE)
    verdict = judge_exit(outcome, context)
    assert (verdict.exit_status, verdict.state) == (SupervisorExitCode.OK, LineState.STOPPED)
    assert kinds(verdict) == [EventKind.STOPPED] and not verdict.notices[0].notified
    assert verdict.said == (f"stopped: {verdict.notices[0].message}",)  # run.log says so, as a finished line's end
    assert verdict.discard_stop and verdict.fork_at_end is None


def test_the_supervisors_own_sigterm_stops_the_line() -> None:
    verdict = judge_exit(TrainerExit(SIGTERM_EXIT, 10.0, stopped_by_us=True), CONTEXT)
    assert verdict.state == LineState.STOPPED and verdict.failures_in_a_row == 0
    signalled = replace(CONTEXT, stop_signal=signal.SIGINT)
    assert judge_exit(TrainerExit(128 + signal.SIGINT, 10.0), signalled).state == LineState.STOPPED


def test_a_pause_for_work_relaunches_unless_a_stop_came_meanwhile() -> None:
    paused = TrainerExit(SIGTERM_EXIT, 10.0, paused_for_work=True)
    verdict = judge_exit(paused, CONTEXT)
    assert verdict.exit_status is None and verdict.notices == () and verdict.failures_in_a_row == 0
    assert verdict.said == ("the trainer stopped for the work asked of the line",)
    for context in (replace(CONTEXT, stop_pending_now=True), replace(CONTEXT, heartbeat_reason=StopReason.STOP_FILE),
                    replace(CONTEXT, stop_signal=signal.SIGHUP)):
        assert judge_exit(paused, context).state == LineState.STOPPED


def test_a_line_error_fails_at_once_with_the_trainers_message() -> None:
    context = replace(CONTEXT, last_error="nsconsole: run.json: unknown key x", failures_in_a_row=2)
    verdict = judge_exit(TrainerExit(TrainerExitCode.LINE_ERROR, 3.0), context)
    assert (verdict.exit_status, verdict.state) == (SupervisorExitCode.FAILED, LineState.FAILED)
    assert verdict.notices[0].message == "nsconsole: run.json: unknown key x" and verdict.failures_in_a_row == 2


def test_a_full_disk_stops_the_line_for_the_operator() -> None:
    verdict = judge_exit(TrainerExit(TrainerExitCode.DISK_FULL, 3.0), CONTEXT)
    assert (verdict.exit_status, verdict.state) == (SupervisorExitCode.FAILED, LineState.DISK_FULL)
    assert kinds(verdict) == [EventKind.DISK_FULL] and verdict.notices[0].message == "the disk is full"


@pytest.mark.parametrize("progressed", [False, True])
def test_a_trainer_that_left_the_gpu_is_relaunched_once_it_is_free(progressed: bool) -> None:
    verdict = judge_exit(TrainerExit(TrainerExitCode.GPU_BUSY, 3.0, progressed=progressed), CONTEXT)
    assert verdict.exit_status is None and kinds(verdict) == [EventKind.GPU_BUSY]
    assert verdict.wait_for_free_gpu and verdict.others_may_stay is progressed
    assert verdict.failures_in_a_row == 0


def test_crashes_count_until_max_failures_then_the_line_fails() -> None:
    context = CONTEXT
    for crash in range(1, 6):
        verdict = judge_exit(TrainerExit(1, 3.0), context)
        assert verdict.failures_in_a_row == crash and kinds(verdict)[0] == EventKind.CRASHED
        context = replace(context, failures_in_a_row=verdict.failures_in_a_row)
    assert (verdict.exit_status, verdict.state) == (SupervisorExitCode.FAILED, LineState.FAILED)
    assert kinds(verdict) == [EventKind.CRASHED, EventKind.FAILED]
    assert "5 failures in a row without progress" in verdict.notices[1].message


def test_a_crash_after_progress_starts_the_count_again() -> None:
    verdict = judge_exit(TrainerExit(-signal.SIGKILL, 3.0, progressed=True), replace(CONTEXT, failures_in_a_row=4))
    assert verdict.exit_status is None and verdict.failures_in_a_row == 1
    assert verdict.said == ("the trainer exited with status killed by SIGKILL",)


def test_a_hung_gpu_is_killed_and_relaunched() -> None:
    verdict = judge_exit(TrainerExit(-signal.SIGKILL, 1800.0, killed_by_watchdog=True), CONTEXT)
    assert verdict.exit_status is None and kinds(verdict) == [EventKind.WATCHDOG_RESTART]
    assert verdict.notices[0].notified and verdict.failures_in_a_row == 1
    assert "no heartbeat for 1800 s" in verdict.notices[0].message


def test_a_sigterm_it_did_not_send_relaunches_and_counts_only_without_progress() -> None:
    verdict = judge_exit(TrainerExit(SIGTERM_EXIT, 3.0), CONTEXT)
    assert verdict.exit_status is None and kinds(verdict) == [EventKind.SIGNAL_RESTART]
    assert verdict.failures_in_a_row == 1
    after_progress = judge_exit(TrainerExit(SIGTERM_EXIT, 3.0, progressed=True), replace(CONTEXT, failures_in_a_row=3))
    assert after_progress.failures_in_a_row == 0


def test_crashes_beside_other_gpu_processes_are_not_failures_and_three_wait_for_a_free_gpu() -> None:
    context = replace(CONTEXT, failures_in_a_row=2)
    for crash in range(1, CRASHES_BESIDE_OTHERS + 1):
        verdict = judge_exit(TrainerExit(1, 3.0, others_on_gpu=[4242]), context)
        assert verdict.exit_status is None and verdict.failures_in_a_row == 2
        assert "beside other processes on GPU 0 (pids [4242])" in verdict.notices[0].message
        context = replace(context, crashes_beside_others=verdict.crashes_beside_others)
        assert verdict.wait_for_free_gpu is (crash == CRASHES_BESIDE_OTHERS)
    assert verdict.crashes_beside_others == 0
    assert verdict.said[-1] == "3 crashes in a row beside other processes: waiting for a free GPU"
    after_progress = judge_exit(TrainerExit(1, 3.0, others_on_gpu=[1], progressed=True),
                                replace(CONTEXT, crashes_beside_others=2))
    assert after_progress.crashes_beside_others == 1 and not after_progress.wait_for_free_gpu


def test_only_exits_nobody_asked_for_count_as_crashes() -> None:
    unasked = [
        TrainerExit(1, 5.0),  # a crash
        TrainerExit(-signal.SIGKILL, 5.0, killed_by_watchdog=True),  # the watchdog's kill
        TrainerExit(SIGTERM_EXIT, 5.0),  # a SIGTERM the supervisor did not send
        TrainerExit(1, 5.0, others_on_gpu=[4242]),  # beside other GPU processes: no failure, still a crash
        TrainerExit(None, 5.0, killed_by_watchdog=True),  # killed, and stuck
    ]
    for outcome in unasked:
        assert judge_exit(outcome, CONTEXT).crashed, outcome
    assert judge_exit(TrainerExit(1, 5.0), replace(CONTEXT, failures_in_a_row=4)).crashed  # the one that fails the line
    asked = [
        (TrainerExit(0, 5.0), replace(CONTEXT, heartbeat_reason=StopReason.PLAN_END)),  # the line's end
        (TrainerExit(0, 5.0, stop_requested=True), CONTEXT),  # a stop (then a resume relaunches it)
        (TrainerExit(SIGTERM_EXIT, 5.0, stopped_by_us=True), CONTEXT),
        (TrainerExit(SIGTERM_EXIT, 5.0, paused_for_work=True), CONTEXT),  # a rollback or a tune
        (TrainerExit(TrainerExitCode.GPU_BUSY, 5.0), CONTEXT),  # the GPU left to others
        (TrainerExit(TrainerExitCode.LINE_ERROR, 5.0), CONTEXT),
        (TrainerExit(TrainerExitCode.DISK_FULL, 5.0), CONTEXT),
    ]
    for outcome, context in asked:
        assert not judge_exit(outcome, context).crashed, outcome


@pytest.mark.parametrize("code", [1, SIGTERM_EXIT, -9])
def test_a_served_stop_then_a_failed_exit_is_a_stop_not_a_relaunch(code: int) -> None:
    # A group's rank 0 checkpointed, took the STOP file and beat `stopped`; another rank then failed
    # on its way out. A relaunch would train on with no STOP file left to stop it.
    verdict = judge_exit(TrainerExit(code, 10.0, stop_requested=True, stop_served=True), CONTEXT)
    assert (verdict.exit_status, verdict.state, verdict.crashed) == (SupervisorExitCode.OK, LineState.STOPPED, False)
    assert kinds(verdict) == [EventKind.STOPPED] and "then exited with status" in verdict.notices[0].message


@pytest.mark.parametrize("code", [1, -9, SIGTERM_EXIT, TrainerExitCode.GPU_BUSY])
def test_a_crash_before_a_stop_at_the_next_update_is_served_stops_the_line(code: int) -> None:
    # A relaunch would load the newest checkpoint only to stop at its first boundary.
    verdict = judge_exit(TrainerExit(code, 10.0, stop_requested=True), replace(CONTEXT, stop_pending_now=True))
    assert (verdict.exit_status, verdict.state, verdict.crashed) == (SupervisorExitCode.OK, LineState.STOPPED, True)
    assert verdict.discard_stop and "before serving it, so its newest checkpoint stands" in verdict.said[0]


def test_a_crash_with_a_stop_at_a_cycle_end_pending_relaunches_to_reach_that_end() -> None:
    verdict = judge_exit(TrainerExit(1, 10.0, stop_requested=True), CONTEXT)  # stop_pending_now: only "next update"
    assert verdict.exit_status is None and verdict.crashed
