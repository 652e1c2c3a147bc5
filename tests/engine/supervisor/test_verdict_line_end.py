"""A stop that comes as the line reaches its end (the operator's `nsconsole stop` while the last cycle
ends, found in a walkthrough of unattended lines) does not turn the line's end into a stop: it was
recorded `stopped`, the operator's notifier never heard `finished`, and the branches queued at that
end were neither forked nor failed."""

from __future__ import annotations

import signal
from dataclasses import replace

import pytest
from test_verdict import CONTEXT, kinds

from engine.protocol.facts import EventKind, LineState, StopReason, SupervisorExitCode
from engine.supervisor.verdict import TrainerExit, judge_exit


@pytest.mark.parametrize("reason", [StopReason.DATA_END, StopReason.PLAN_END])
@pytest.mark.parametrize("how", ["signal", "stop_requested", "stop_asked"])
def test_the_line_s_end_with_a_stop_asked_meanwhile_is_finished(reason: str, how: str) -> None:
    context, outcome = replace(CONTEXT, heartbeat_reason=reason), TrainerExit(0, 10.0)
    if how == "signal":
        context = replace(context, stop_signal=signal.SIGTERM)
    elif how == "stop_requested":
        outcome = replace(outcome, stop_requested=True)
    else:
        context = replace(context, stop_asked=True)
    verdict = judge_exit(outcome, context)
    assert (verdict.exit_status, verdict.state) == (SupervisorExitCode.OK, LineState.FINISHED)
    assert kinds(verdict) == [EventKind.FINISHED] and verdict.notices[0].notified
    assert verdict.fork_at_end is True and verdict.discard_stop  # the stop asked is moot: nothing is left


def test_a_stop_served_or_stop_at_reached_with_a_stop_asked_is_still_a_stop() -> None:
    for reason in (StopReason.STOP_FILE, StopReason.STOP_AT):
        verdict = judge_exit(TrainerExit(0, 10.0), replace(CONTEXT, heartbeat_reason=reason, stop_asked=True))
        assert verdict.state == LineState.STOPPED and verdict.fork_at_end is None
