"""The work that needs the trainer stopped (a rollback, a tune), done between two launches.

A mixin of `engine.supervisor.supervisor.Supervisor`, sharing its state: an RPC thread hands the
work over (`between_launches`, under the supervisor's `_lock`: `_paused_work`, `_closing`) and
waits; the supervisor's loop runs it once no trainer runs (`_do_paused_work`, with the GPU lease
held when the work needs the GPU: `_gpus`), setting `state` around it and telling of it (`_say`,
`_set`, `_publish_event`, `_publish_rows`); an ending supervisor refuses what still waits
(`_refuse_paused_work`). What the work is, and its outcome future, are `engine.supervisor.rpc.PausedWork`'s.
"""

from __future__ import annotations

from typing import Any

from datalines.errors import DataLineError
from engine.errors import LineError
from engine.supervisor.rpc import PausedWork

ANSWER_WAIT_S = 5.0
"""How long an ending supervisor waits for a refused rollback or tune to be answered."""


class BetweenLaunches:
    """The supervisor's paused work (mixed into `Supervisor`, whose loop, lock, state and log it uses)."""

    def between_launches(self, work: PausedWork) -> dict[str, Any]:
        """Do `work` with the trainer stopped and relaunch it after; its result (blocks until done).

        Called from the RPC thread: the supervisor's loop stops the trainer (SIGTERM: a checkpoint
        at its next update), waits for its exit, runs the work and launches the trainer again.
        """
        with self._lock:
            if self._closing:
                raise LineError(f"{self.layout.root}: the supervisor is ending; {work.name} refused")
            if self._paused_work is not None:
                under_way = self._paused_work.name
                raise LineError(f"{self.layout.root}: a {under_way} is under way; try once it is done")
            self._paused_work = work
        self._say(f"{work.name} requested: the trainer stops with a checkpoint first")
        try:
            return work.outcome.result()
        finally:
            work.answered.set()

    def _do_paused_work(self, gpu_ready: bool) -> None:
        """Run the rollback or tune asked for, if any, now that no trainer runs (see `between_launches`)."""
        work = self._paused_work
        if work is None or (work.needs_gpu and self._gpus is not None and not gpu_ready):
            return
        state_before = self.state.state
        self._set(state=work.state)
        self._say(f"{work.name}: started")
        try:
            result = work.work()
        except (LineError, DataLineError) as error:
            self._say(f"{work.name} refused: {error}")
            self._publish_event(work.failed_event, str(error))
            work.outcome.set_exception(error)
        except Exception as error:
            message = f"{work.name} failed: {type(error).__name__}: {error}"
            self._say(message)
            self._publish_event(work.failed_event, message)
            work.outcome.set_exception(error)
        else:
            where = f"; the line continues from update {result['to_update']}" if "to_update" in result else ""
            self._say(f"{work.name}: done{where}")
            self._publish_rows()  # a rollback cut rows.jsonl: the tail walks back before the event tells of it
            self._publish_event(work.done_event, f"{work.name} done{where}", result=result)
            work.outcome.set_result(result)
        finally:
            with self._lock:
                self._paused_work = None
            self._set(state=state_before)

    def _refuse_paused_work(self) -> None:
        """The supervisor ends: work still waiting is answered (nothing of it was done)."""
        with self._lock:
            self._closing = True
            work, self._paused_work = self._paused_work, None
        if work is not None and not work.outcome.done():
            work.outcome.set_exception(LineError(
                f"{self.layout.root}: the supervisor ended (state {self.state.state}) before the {work.name} "
                "ran; nothing was changed"
            ))
            # The server closes its connections soon: let the RPC thread hand the refusal over first.
            work.answered.wait(timeout=ANSWER_WAIT_S)
