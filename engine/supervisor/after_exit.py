"""After the trainer exits: the verdict applied, the backoff before a relaunch, an end with no trainer.

A mixin of `engine.supervisor.supervisor.Supervisor`, sharing its state: the verdict
(`engine/supervisor/verdict.py`, a pure function) is given the facts of the exit and of the
supervisor (the stop signal or stop asked, `state`'s failure counts, the settings, the watchdog
interval), and its decisions are applied here: supervisor.json's record (`_set`), the queued forks
at the line's end (`forks`), the wait for a free GPU (`_need_free_gpu`, `_others_may_stay`) and the
events told (`_event`, `_publish_event`). The backoff is the supervisor's loop meanwhile (`_pump`,
`_do_paused_work`, `_stopping`).
"""

from __future__ import annotations

import time
from typing import Any

from engine.protocol.facts import EventKind, LineState, SupervisorExitCode
from engine.supervisor.reads import discard_served_stop, last_error_line, pending_stop_now, read_json
from engine.supervisor.verdict import ExitContext, TrainerExit, judge_exit

MAX_RELAUNCH_DELAY_S = 300.0


class AfterExit:
    """The supervisor after a trainer's exit (mixed into `Supervisor`, whose loop, state and log it uses)."""

    def _judge(self, outcome: TrainerExit) -> int | None:
        """Apply the verdict on the trainer's exit (`engine.supervisor.verdict`): the supervisor's
        exit status when the line is over; None to relaunch."""
        context = ExitContext(
            heartbeat_reason=(read_json(self.layout.heartbeat) or {}).get("reason"),
            stop_signal=self._stop_signal,
            stop_asked=self._stop_asked,
            stop_pending_now=pending_stop_now(self.layout),
            failures_in_a_row=self.state.failures_in_a_row,
            crashes_beside_others=self.state.crashes_beside_others,
            max_failures=self.settings.max_failures,
            gpu_indices=tuple(self.state.gpu_indices),
            watchdog_seconds=self._watchdog_seconds(),
            last_error=last_error_line(self.layout.run_log),
        )
        verdict = judge_exit(outcome, context)
        for line in verdict.said:
            self._say(line)
        if verdict.discard_stop:
            discard_served_stop(self.layout)
        if verdict.fork_at_end is not None:
            self.forks.finish_line(line_ended=verdict.fork_at_end)
        if verdict.wait_for_free_gpu:
            self._need_free_gpu = True
            self._others_may_stay = verdict.others_may_stay
        changes: dict[str, Any] = {"failures_in_a_row": verdict.failures_in_a_row,
                                   "crashes_beside_others": verdict.crashes_beside_others}
        if verdict.crashed:
            changes["crashes"] = self.state.crashes + 1
        if verdict.state is not None:
            changes["state"] = verdict.state  # before the events: a client told of the end sees it
        self._set(**changes)
        for notice in verdict.notices:
            if notice.notified:
                self._event(notice.kind, notice.message)
            else:
                self._publish_event(notice.kind, notice.message)
        return verdict.exit_status

    def _pause_before_relaunch(self) -> bool:
        """Wait out the backoff after failures before the next launch; False when a stop arrives meanwhile.

        run.log tells only the wait: what follows it may be no launch yet (work asked for, a wait
        for the GPU or its lease, a stop), and a launch tells itself ("trainer launched"). A
        "relaunching in 0 s" here preceded a tune, a wait for the GPU or a stop: a promise the
        supervisor then did not keep.
        """
        failures = self.state.failures_in_a_row
        delay = 0.0 if failures == 0 else min(
            self.settings.relaunch_delay_seconds * 2 ** (failures - 1), MAX_RELAUNCH_DELAY_S
        )
        self._set(state=LineState.RELAUNCHING)
        if delay > 0:
            self._say(f"waiting {delay:g} s before relaunching (failures in a row: {failures})")
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline:
            self._pump()
            self._do_paused_work(gpu_ready=False)
            if self._stopping or pending_stop_now(self.layout):
                return False
            time.sleep(min(self.settings.poll_seconds, max(0.0, deadline - time.monotonic())))
        return True

    def _end_without_trainer(self) -> int:
        """A stop arrived while no trainer ran: the line is already at a checkpoint."""
        discard_served_stop(self.layout)
        self._set(state=LineState.STOPPED)
        self._say("stopped (no trainer was running)")
        self._publish_event(EventKind.STOPPED, "the line stopped on request")
        return SupervisorExitCode.OK
