"""The supervisor: keeps one training line running unattended.

`python -m engine.supervisor.supervisor LINE [--foreground] [--stop-at N]` (what `nsconsole run LINE` runs):
without `--foreground` it starts itself detached (`engine/supervisor/start.py`; `engine/supervisor/detach.py`:
its own session, output to `<line>/supervisor.out`), after refusing where systemd-logind would end
it at logout, and returns once the detached supervisor answers.

The supervisor (one per line: an exclusive flock on the line directory):

- starts nothing on a line that has finished, decided once it holds that flock (`nsconsole run`
  looked seconds before, and a trainer started without a supervisor may have finished it since);
- launches the trainer (`engine/training/main.py`; `engine/supervisor/launch.py`) with run.log as
  its output, after taking the GPU lease (`engine/supervisor/leasing.py`; `engine/gpu/devices.py`:
  the first free one of the GPUs run.json's `device` names, `engine/gpu/placement.py`) and handing
  it to the trainer, which sees that GPU alone, by its UUID, as cuda:0; the trainer gets SIGTERM,
  and so stops at its next update with a checkpoint, if the supervisor dies;
- watches its heartbeat: none for `guards.watchdog_minutes` -> kill -9 and relaunch
  (`watchdog_restart`); a trainer that does not exit even then -> `stuck`, the supervisor stops;
- judges each exit by the recovery table (`engine/supervisor/verdict.py`, a pure function): a
  clean end, a stop, a line error (`failed`), a full disk (`disk-full`), a GPU left to other
  processes (relaunch once it is free), a SIGTERM it did not send (`signal_restart`), or a crash
  (resume from the newest checkpoint; after `max_failures` in a row without a newer checkpoint,
  `failed`; a crash beside other GPU processes is not counted, and after 3 such in a row the line
  waits for a free GPU);
- keeps the data line's preparer running beside the trainer (`engine/supervisor/preparer.py`);
- on SIGTERM, SIGINT or SIGHUP (or a `stop` call) stops the trainer with a checkpoint and exits; a
  stop at the next update left pending from before it started (nothing served it) it discards;
- serves the line's socket (`engine/supervisor/server.py`, `engine/supervisor/rpc.py`), registers for
  discovery and remembers the line in the history (`engine/supervisor/registry.py`), pushes
  heartbeats, rows and events to subscribers, tells the operator through host.json's `notify`
  (`engine/supervisor/notify.py`), and keeps its state in `supervisor.json` (its crash count
  carried over from the supervisor before);
- forks the branches asked of it at the end of their trunk cycle (`engine/supervisor/forks.py`:
  at once when it has ended, else queued in supervisor.json until the cycle-end checkpoint appears),
  and starts each branch's own supervisor, detached, with this one's engine and no `--stop-at`
  (`branched` says `started`; a start that fails is a `branch_start_failed` event and the branch
  stays, to be run by hand). A branch on a GPU then waits for the GPU lease like any other line;
- does the work that needs the trainer stopped (a rollback, a tune) between two launches: the
  trainer is stopped with SIGTERM (it checkpoints at its next update), the work runs (a tune with
  the GPU lease held and no other process on the GPU), the trainer is relaunched.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from datalines.errors import DataLineError
from engine.atomic import write_text_atomic
from engine.checkpoints.format import branched_from
from engine.config.host import HostSettings, load_and_apply
from engine.config.run import RunConfig
from engine.errors import LineError
from engine.gpu.devices import GpuLease
from engine.gpu.placement import PhysicalGpu, PlacementError, child_environment
from engine.layout import LineLayout
from engine.logrotate import RotatingLog
from engine.ops import lines as ops
from engine.ops.line_end import finished_line_error, line_end
from engine.ops.rollback_records import rollback_times
from engine.process_start import started_since_boot
from engine.protocol.facts import (
    ENGINE_CHOICES,
    FINAL_LINE_STATES,
    NOTIFIED_EVENTS,
    Engine,
    EventKind,
    LineState,
    SupervisorExitCode,
)
from engine.protocol.wire import PROTOCOL_VERSION, RequestLog
from engine.supervisor import registry
from engine.supervisor.branch_supervisors import BranchSupervisors
from engine.supervisor.forks import ForkQueue, QueuedFork
from engine.supervisor.gpu_watch import line_gpus
from engine.supervisor.launch import TrainerLaunching
from engine.supervisor.leasing import GpuLeasing, release_all
from engine.supervisor.notify import DEFAULT_TIMEOUT_S as NOTIFY_TIMEOUT_S
from engine.supervisor.notify import make_event, notify_in_background
from engine.supervisor.preparer import PreparerKeeper
from engine.supervisor.reads import (
    beat_time,
    discard_served_stop,
    file_size,
    heartbeat_update,
    last_error_line,
    latest_update,
    parse_json,
    pending_stop,
    pending_stop_now,
    read_json,
    supervisor_config,
)
from engine.supervisor.reserve import RESERVE_NAME, DiskReserve, is_disk_full
from engine.supervisor.rows_digest import is_validation_row
from engine.supervisor.rows_tail import RowsTail
from engine.supervisor.rpc import LineHandler, PausedWork
from engine.supervisor.server import SupervisorServer
from engine.supervisor.settings import SupervisorSettings
from engine.supervisor.start import start_detached
from engine.supervisor.state import SupervisorState
from engine.supervisor.verdict import ExitContext, TrainerExit, judge_exit
from engine.training.line_lock import hold_line

if TYPE_CHECKING:
    from engine.ops.branch import BranchResult

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
MAX_RELAUNCH_DELAY_S = 300.0
ROWS_INDEX_EVERY = 4096
"""Rows between two saves of the index of rows.jsonl (`RowsTail.save`): at ns-2b's 2 s an update,
about every 2 h, so a start after a crash or a reboot reads at most this many rows of the file."""
ANSWER_WAIT_S = 5.0
"""How long an ending supervisor waits for a refused rollback or tune to be answered."""


class Supervisor(GpuLeasing, TrainerLaunching):
    """One line's supervisor (see the module docstring): its loop, its state and what it tells; its GPU
    leases are `GpuLeasing`'s, its trainer's launch and watch `TrainerLaunching`'s."""

    def __init__(self, line: Path | str, settings: SupervisorSettings | None = None) -> None:
        self.layout: LineLayout = ops.open_line(line)
        self.settings = settings or SupervisorSettings()
        self.state = SupervisorState(pid=os.getpid(), started=time.time(),
                                     boot_start=started_since_boot(psutil.Process()),
                                     engine=Engine(self.settings.engine).value, stop_at=self.settings.stop_at)
        self.request_log = RequestLog()
        self.rows_tail = RowsTail(self.layout.rows_jsonl)  # from its saved index once it runs (`_index_rows`)
        self._rows_indexed_at = 0  # rows_tail.count at the index's last save
        self._lock = threading.Lock()  # guards state against the RPC threads
        self._stop_signal: int | None = None
        self._stop_asked = False  # a stop came over the socket: the clean exit it brings is a stop
        self._log = RotatingLog(self.layout.run_log)
        self._reserve = DiskReserve(self.layout.root / RESERVE_NAME)  # its last words on a full disk
        self._heartbeat_seen: bytes | None = None
        self._echo_offset = 0
        self._notify_command: str | None = None
        self._server: SupervisorServer | None = None
        self._notifying: list[threading.Thread] = []  # joined at exit: the last event is often the news
        self._config: RunConfig | None = None
        self._gpus: list[PhysicalGpu] | None = None  # the GPUs `device` may lease (None: the CPU)
        self._placed: list[PhysicalGpu] = []  # the GPUs leased for the current (or last) launch, rank 0's first
        self._need_free_gpu = False  # relaunch only once no other process is on the GPU ...
        self._others_may_stay = False  # ... or, after a launch that progressed, once they fit the reserve
        self._preparer: PreparerKeeper | None = None
        self._save_lock = threading.Lock()  # one supervisor.json write at a time, newest last
        self._paused_work: PausedWork | None = None  # a rollback or tune waiting for the trainer to stop
        self._closing = False  # the supervisor is ending: no more paused work is taken
        self._parent: str | None = None  # the line this one was branched from
        self._branches = BranchSupervisors(self.settings.engine)  # the supervisors of branches it started
        self.forks = ForkQueue(
            self.layout, on_forked=self._on_forked, on_failed=self._on_fork_failed, on_change=self._save,
        )

    # ---- the RPC handler's view ----------------------------------------------------------------

    def state_for_status(self) -> dict[str, Any]:
        with self._lock:
            state = asdict(self.state)
        state.pop("requests")
        state["queued_forks"] = self.forks.export()
        state["failed_forks"] = self.forks.failed()
        heartbeat = read_json(self.layout.heartbeat)
        stop = pending_stop(self.layout)
        config = self._config
        return {
            **state,
            "line": str(self.layout.root),
            "protocol": PROTOCOL_VERSION,
            "heartbeat": heartbeat,
            "heartbeat_age_s": None if heartbeat is None else round(time.time() - beat_time(heartbeat), 3),
            "rows": self.rows_tail.count,
            "latest_checkpoint": latest_update(self.layout),
            "rollbacks": rollback_times(self.layout),
            "stop": None if stop is None else asdict(stop),
            "preset": None if config is None else config.model.preset,
            "device": None if config is None else config.device,
            "preparer": None if self._preparer is None else self._preparer.snapshot(),
            "parent": self._parent,
        }

    def request_stop(self, at_cycle_end: int | None) -> None:
        """A stop asked over the socket. The STOP file, written already, carries it: the trainer
        stops on it with a checkpoint (and removes it); with no trainer running, the loop does."""
        self._stop_asked = True
        when = "at the next update" if at_cycle_end is None else f"at the end of cycle {at_cycle_end}"
        self._say(f"stop requested {when}")

    def save_requests(self) -> None:
        """Write supervisor.json now: a mutation's request_id is there before its reply is sent."""
        self._save()

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

    def placed_environment(self) -> dict[str, str] | None:
        """The environment of a process that works on the line's device (the trainer, a tune): only
        the GPU leased, by UUID, as its cuda:0 (`engine.gpu.placement.child_environment`); None
        (this process's own) on the CPU."""
        return None if self._gpus is None or not self._placed else child_environment(self._placed)

    # ---- life -----------------------------------------------------------------------------------

    def run(self) -> int:
        """Supervise until the line ends, fails or is stopped; the exit status."""
        line_lock = hold_line(self.layout)
        try:
            self._refuse_a_finished_line()
            self._reserve.make()
            self._config = supervisor_config(self.layout)
            self._notify_command = HostSettings.load().notify
            previous = read_json(self.layout.supervisor_json) or {}
            if isinstance(previous.get("requests"), list):
                self.request_log.restore(previous["requests"])
            self.forks.restore(previous.get("queued_forks"))
            self.state.crashes = self._crashes_before(previous)
            self._parent = branched_from(self.layout)
            try:
                self._gpus = line_gpus(self._config.device, self._config.parallel.degree)
            except PlacementError as error:
                raise LineError(f"{self.layout.run_json}: {error}") from None
            self.state.gpu_candidates = None if self._gpus is None else [gpu.index for gpu in self._gpus]
            if self._gpus is not None and self._degree() > len(self._gpus):
                raise LineError(f"{self.layout.run_json}: parallel.degree {self._degree()} needs as many GPUs, but "
                                f"device {self._config.device} names {len(self._gpus)}")
            if self.settings.run_preparer:
                self._preparer = PreparerKeeper(
                    ops.resolve_data_path(self.layout, self._config.data.line),
                    say=self._say,
                    notify_failing=lambda message: self._event(EventKind.PREPARER_FAILING, message),
                    command=self.settings.preparer_command,
                    restart_delay=self.settings.relaunch_delay_seconds,
                )
            self._echo_offset = file_size(self.layout.run_log)
            # Rows and the heartbeat of earlier runs are history, not news for subscribers.
            self._index_rows()
            with contextlib.suppress(FileNotFoundError):
                self._heartbeat_seen = self.layout.heartbeat.read_bytes()
            self._discard_a_stop_from_before()  # before it registers: `nsconsole stop` finds it from then on
            handler = LineHandler(self)
            self._server = SupervisorServer(
                self.layout.supervisor_sock, handler, identity={"line": str(self.layout.root)}
            )
            self._server.start()
            entry = registry.register(self.layout.root, self.layout.supervisor_sock)
            try:
                registry.remember_line(self.layout.root)
            except LineError as error:
                self._say(f"{error}; once the line ends, the console lists it only if it lies in a work root")
            previous_handlers = {}
            # Signals reach only the main thread (a supervisor run in a thread is stopped by STOP).
            if threading.current_thread() is threading.main_thread():
                for number in STOP_SIGNALS:
                    previous_handlers[number] = signal.signal(number, self._on_signal)
            try:
                self._say(f"supervisor started (pid {os.getpid()})")
                self._save()
                return self._supervise()
            except Exception as error:
                self._event(EventKind.SUPERVISOR_FAILED, f"the supervisor failed: {type(error).__name__}: {error}")
                self._set(state=LineState.FAILED)
                raise
            finally:
                for number, handler_before in previous_handlers.items():
                    signal.signal(number, handler_before)
                self._refuse_paused_work()
                self.forks.close()
                if self._preparer is not None:
                    self._preparer.stop()
                registry.unregister(entry)
                self._server.close()
                self._save()
                self._save_rows_index()
                deadline = time.monotonic() + NOTIFY_TIMEOUT_S  # a failed notification is said in run.log
                for thread in self._notifying:
                    thread.join(timeout=max(0.0, deadline - time.monotonic()))
                self._log.close()
                if self.settings.echo:
                    self._echo_run_log()
        finally:
            os.close(line_lock)

    def _index_rows(self) -> None:
        """Index rows.jsonl from where the saved index left off (`RowsTail.load`): a line of months
        is read through only once, not at every start (a minute for 3 GB)."""
        self.rows_tail = RowsTail.load(self.layout.rows_jsonl, self.layout.rows_index)
        restored = self.rows_tail.count
        self.rows_tail.catch_up()
        read = self.rows_tail.rows_read
        if restored or read >= ROWS_INDEX_EVERY:
            self._say(f"rows.jsonl: {self.rows_tail.count} rows, {read} read from the file "
                      f"({'the rest from rows.index.json' if restored else 'no saved index'})")
        if read >= ROWS_INDEX_EVERY:
            self._save_rows_index()

    def _save_rows_index(self) -> None:
        """Save the index of rows.jsonl (a cache: a full disk or another failure only costs a longer start)."""
        try:
            self.rows_tail.save(self.layout.rows_index)
        except OSError as error:
            self._say(f"{self.layout.rows_index}: not saved ({error}); the next start reads rows.jsonl through")
        self._rows_indexed_at = self.rows_tail.count

    def _refuse_a_finished_line(self) -> None:
        """`LineError` when the line has nothing left to train, decided here, under the line's lock.

        Whoever started this supervisor looked before it (`nsconsole run` seconds before: its start
        checks load torch), and a trainer started without a supervisor may have finished the line
        since and let go of it: a trainer launched now would stop at once, and the line would read as
        finished by this supervisor. Nothing is written before this (no supervisor.json, no entry, no
        run.log line): the line stays as the trainer that finished it left it. A line whose end
        cannot be read (a broken run.json, a data line gone) starts as before: its trainer's start
        says what is wrong, and the supervisor records that."""
        try:
            ended = line_end(self.layout.root)
        except (LineError, DataLineError, OSError):
            return
        if ended is not None:
            raise finished_line_error(self.layout.root, ended)

    def _discard_a_stop_from_before(self) -> None:
        """Discard a stop at the next update still pending from before this supervisor started.

        Nothing served it: it was asked of an orphan trainer finishing its checkpoint after its
        supervisor died, or just before the host went down. Kept, it ended this start at once, and
        `nsconsole run` said the supervisor "did not start: exit status 0". This start is the newer
        request (`nsconsole resume` leaves such a line alone, `engine.supervisor.lost`). A stop at a
        cycle end stays: the trainer serves it when that cycle ends."""
        stop = pending_stop(self.layout)
        if stop is None or stop.at_cycle_end is not None:
            return
        discard_served_stop(self.layout)
        self._say(f"a stop requested {stop.requested} was pending from before this start, with nothing "
                  "to serve it: discarded (`nsconsole stop` asks again)")

    def _crashes_before(self, previous: dict[str, Any]) -> int:
        """The crash count of the supervisors before this one, plus one when the last of them died
        with the line running (killed, or the host went down): it ended in a state that is not final."""
        crashes = previous.get("crashes")
        count = crashes if isinstance(crashes, int) and not isinstance(crashes, bool) and crashes > 0 else 0
        state = previous.get("state")
        if state is not None and state not in FINAL_LINE_STATES:
            self._say(f"the previous supervisor (pid {previous.get('pid')}) ended in state {state} without "
                      "ending the line: counted as a crash")
            count += 1
        return count

    def _on_signal(self, number: int, _frame: Any) -> None:
        self._stop_signal = number

    @property
    def _stopping(self) -> bool:
        """A signal asked the supervisor to stop (a STOP file is the trainer's to act on)."""
        return self._stop_signal is not None

    def _supervise(self) -> int:
        while True:
            self._pump()
            if self._stopping or pending_stop_now(self.layout):
                return self._end_without_trainer()
            leases: list[GpuLease] = []
            if self._gpus is not None:
                taken = self._take_gpus(self._gpus, self._degree())
                if taken is None:  # a stop came while it waited
                    return self._end_without_trainer()
                leases = taken
                if self._need_free_gpu and not all(self._wait_for_free_gpu(lease.index) for lease in leases):
                    release_all(leases)
                    return self._end_without_trainer()
                self._need_free_gpu = self._others_may_stay = False
            self._do_paused_work(gpu_ready=True)
            if self._stopping or pending_stop_now(self.layout):
                release_all(leases)
                return self._end_without_trainer()
            outcome = self._run_trainer(leases)
            verdict = self._judge(outcome)
            if verdict is not None:
                return verdict
            if not self._pause_before_relaunch():
                return self._end_without_trainer()

    # ---- after an exit --------------------------------------------------------------------------

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

    def _on_forked(self, fork: QueuedFork, result: BranchResult) -> None:
        """A branch was forked (on a fork worker thread, or at the line's end): start it, then tell."""
        failure = self._branches.start(result.line)
        message = f"branched {result.line} at the end of cycle {fork.at_cycle} (update {result.fork_update})"
        message += "; its supervisor started" if failure is None else "; its supervisor did not start"
        self._say(message)
        self._publish_event(
            "branched", message, path=str(result.line), at_cycle=fork.at_cycle, fork_update=result.fork_update,
            started=failure is None,
        )
        if failure is not None:
            self._say(f"branch_start_failed: {failure}")
            self._publish_event(EventKind.BRANCH_START_FAILED, failure, path=str(result.line), at_cycle=fork.at_cycle)

    def _on_fork_failed(self, fork: QueuedFork, reason: str) -> None:
        message = f"the branch into {fork.path} at the end of cycle {fork.at_cycle} failed: {reason}"
        self._event(EventKind.BRANCH_FAILED, message, path=fork.path, at_cycle=fork.at_cycle, reason=reason)

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

    # ---- what the world sees --------------------------------------------------------------------

    def _publish_rows(self) -> None:
        """Push the rows appended to rows.jsonl since the last look to subscribers; save the index
        every `ROWS_INDEX_EVERY` rows (a supervisor killed with the host reads only what came after)."""
        server = self._server
        for index, row in self.rows_tail.poll_indexed():
            if server is not None:
                server.publish("validation" if is_validation_row(row) else "row", row, index=index)
        if abs(self.rows_tail.count - self._rows_indexed_at) >= ROWS_INDEX_EVERY:
            self._save_rows_index()

    def _pump(self) -> None:
        """Push new rows and a changed heartbeat to subscribers; echo run.log in a terminal; keep
        the data preparer running."""
        if self._preparer is not None:
            self._preparer.tick()
        self._publish_rows()
        try:
            raw = self.layout.heartbeat.read_bytes()
        except FileNotFoundError:
            raw = None
        if raw is not None and raw != self._heartbeat_seen:
            self._heartbeat_seen = raw
            heartbeat = parse_json(raw)
            if heartbeat is not None and self._server is not None:
                self._server.publish("heartbeat", heartbeat)
        self.forks.poll()
        self._branches.reap()
        if self.settings.echo:
            self._echo_run_log()

    def _echo_run_log(self) -> None:
        size = file_size(self.layout.run_log)
        if size < self._echo_offset:
            self._echo_offset = 0  # rotated
        if size == self._echo_offset:
            return
        with open(self.layout.run_log, "rb") as handle:
            handle.seek(self._echo_offset)
            data = handle.read(size - self._echo_offset)
        whole = data[: data.rfind(b"\n") + 1]
        self._echo_offset += len(whole)
        sys.stdout.write(whole.decode("utf-8", errors="replace"))
        sys.stdout.flush()

    def _say(self, message: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
        line = f"{stamp} supervisor: {message}\n"
        try:
            self._log.write(line)
        except OSError as error:
            if not (is_disk_full(error) and self._reserve.release()):
                return  # a full disk loses this line; the supervisor goes on
            with contextlib.suppress(OSError):
                self._log.write(line)

    def _publish_event(self, kind: str, message: str, **details: Any) -> dict[str, Any]:
        event = {"event": kind, "line": str(self.layout.root), "message": message, "time": time.time()}
        event.update(details)
        if self._server is not None:
            self._server.publish("event", event)
        return event

    def _event(self, kind: str, message: str, **details: Any) -> None:
        """An event the operator is told about: run.log, subscribers, supervisor.json, notify."""
        assert kind in NOTIFIED_EVENTS
        self._say(f"{kind}: {message}")
        event = make_event(kind, str(self.layout.root), message, update=heartbeat_update(self.layout), **details)
        if self._server is not None:
            self._server.publish("event", event)
        self._set(last_event=event)
        if self._notify_command:
            self._notifying.append(notify_in_background(
                self._notify_command, event,
                on_failure=lambda detail: self._say(f"notify {kind} failed: {detail}"),
            ))

    def _set(self, **changes: Any) -> None:
        with self._lock:
            for name, value in changes.items():
                setattr(self.state, name, value)
        self._save()

    def _save(self) -> None:
        # RPC and fork threads save too: the lock orders the writes, so the newest state lands last.
        with self._save_lock:
            queued_forks = self.forks.export()
            with self._lock:
                self.state.requests = self.request_log.export()
                self.state.queued_forks = queued_forks
                document = asdict(self.state)
            text = json.dumps(document, indent=1, default=str) + "\n"
            try:
                write_text_atomic(self.layout.supervisor_json, text)
            except OSError as error:
                if not is_disk_full(error):
                    raise
                # The state must reach the file (`disk-full`, above all): the reserve makes room.
                if self._reserve.release():
                    write_text_atomic(self.layout.supervisor_json, text)

    def _watchdog_seconds(self) -> float:
        if self.settings.watchdog_seconds is not None:
            return self.settings.watchdog_seconds
        minutes = self._config.guards.watchdog_minutes if self._config is not None else 30.0
        return max(minutes, 0.0) * 60.0

    def _degree(self) -> int:
        """The line's `parallel.degree` as last read (1 before run.json is)."""
        return self._config.parallel.degree if self._config is not None else 1


# ---- the command --------------------------------------------------------------------------------


def run_line(
    line: Path,
    *,
    foreground: bool,
    stop_at: int | None = None,
    engine: str = Engine.AUTO,
    detached_child: bool = False,
) -> int:
    """`nsconsole run LINE [--foreground] [--stop-at N] [--engine E]`; `LineError` for the user.

    In the background: returns once the detached supervisor answers (0). In the foreground (and
    as the detached child): supervises, and returns 0 when the line ended or was stopped, 1 when
    it failed or got stuck.
    """
    settings = SupervisorSettings(stop_at=stop_at, engine=engine, echo=foreground)
    if foreground or detached_child:
        return Supervisor(line, settings).run()
    pid = start_detached(line, settings)
    print(f"the supervisor of {line} runs in the background (pid {pid}); output: {line}/supervisor.out")
    return SupervisorExitCode.OK


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m engine.supervisor.supervisor LINE [--foreground] [--stop-at N] [--engine E]`."""
    parser = argparse.ArgumentParser(prog="python -m engine.supervisor.supervisor")
    parser.add_argument("line")
    parser.add_argument("--foreground", action="store_true", help="supervise in this terminal")
    parser.add_argument("--stop-at", type=int, default=None, metavar="UPDATE")
    parser.add_argument("--engine", choices=ENGINE_CHOICES, default=Engine.AUTO.value)
    parser.add_argument("--detached-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        line = load_and_apply().resolve_line(args.line)
        return run_line(
            line, foreground=args.foreground, stop_at=args.stop_at, engine=args.engine,
            detached_child=args.detached_child,
        )
    except LineError as error:
        print(f"nsconsole: {error}", file=sys.stderr)
        return SupervisorExitCode.USER_ERROR


if __name__ == "__main__":
    raise SystemExit(main())
