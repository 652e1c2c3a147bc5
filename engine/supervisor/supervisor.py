"""The supervisor: keeps one training line running unattended.

`python -m engine.supervisor.supervisor LINE [--foreground] [--stop-at N]` (what `nsconsole run LINE` runs):
without `--foreground` it starts itself detached (`engine/supervisor/start.py`; `engine/supervisor/detach.py`:
its own session, output to `<line>/supervisor.out`), after refusing where systemd-logind would end
it at logout, and returns once the detached supervisor answers.

The supervisor (one per line: an exclusive flock on the line directory):

- starts nothing on a line that has finished, decided once it holds that flock (`nsconsole run`
  looked seconds before, and a trainer started without a supervisor may have finished it since;
  `engine/supervisor/startup_checks.py`);
- launches the trainer (`engine/training/main.py`; `engine/supervisor/launch.py`) with run.log as
  its output, after taking the GPU lease (`engine/supervisor/leasing.py`; `engine/gpu/devices.py`:
  the first free one of the GPUs run.json's `device` names, `engine/gpu/placement.py`) and handing
  it to the trainer, which sees that GPU alone, by its UUID, as cuda:0; the trainer gets SIGTERM,
  and so stops at its next update with a checkpoint, if the supervisor dies;
- watches its heartbeat: none for `guards.watchdog_minutes` -> kill -9 and relaunch
  (`watchdog_restart`); a trainer that does not exit even then -> `stuck`, the supervisor stops;
- judges each exit by the recovery table (`engine/supervisor/verdict.py`, a pure function, applied
  by `engine/supervisor/after_exit.py`): a clean end, a stop, a line error (`failed`), a full disk
  (`disk-full`), a GPU left to other processes (relaunch once it is free), a SIGTERM it did not
  send (`signal_restart`), or a crash (resume from the newest checkpoint; after `max_failures` in a
  row without a newer checkpoint, `failed`; a crash beside other GPU processes is not counted, and
  after 3 such in a row the line waits for a free GPU);
- keeps the data line's preparer running beside the trainer (`engine/supervisor/preparer.py`);
- on SIGTERM, SIGINT or SIGHUP (or a `stop` call) stops the trainer with a checkpoint and exits; a
  stop at the next update left pending from before it started (nothing served it) it discards;
- serves the line's socket (`engine/supervisor/server.py`, `engine/supervisor/rpc.py`), registers for
  discovery and remembers the line in the history (`engine/supervisor/registry.py`), pushes
  heartbeats, rows (`engine/supervisor/publishing.py`) and events to subscribers, tells the operator
  through host.json's `notify` (`engine/supervisor/notify.py`), and keeps its state in
  `supervisor.json` (`engine/supervisor/telling.py`; its crash count carried over from the
  supervisor before);
- forks the branches asked of it at the end of their trunk cycle (`engine/supervisor/forks.py`:
  at once when it has ended, else queued in supervisor.json until the cycle-end checkpoint appears),
  and starts each branch's own supervisor, detached, with this one's engine and no `--stop-at`
  (`branched` says `started`; a start that fails is a `branch_start_failed` event and the branch
  stays, to be run by hand). A branch on a GPU then waits for the GPU lease like any other line;
- does the work that needs the trainer stopped (a rollback, a tune) between two launches: the
  trainer is stopped with SIGTERM (it checkpoints at its next update), the work runs (a tune with
  the GPU lease held and no other process on the GPU), the trainer is relaunched
  (`engine/supervisor/between_launches.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psutil

from engine.checkpoints.format import branched_from
from engine.config.host import HostSettings, load_and_apply
from engine.config.run import RunConfig
from engine.errors import LineError
from engine.gpu.devices import GpuLease
from engine.gpu.placement import PhysicalGpu, PlacementError, child_environment
from engine.layout import LineLayout
from engine.logrotate import RotatingLog
from engine.ops import lines as ops

# Imported as the supervisor starts, not when a branch is first asked of it (forks.py imports it
# then): a supervisor runs for weeks, and a module it first imports after `pip install -U` is the new
# code inside the old process (a branch failed so, with an ImportError). Every module a supervisor
# imports later must be loaded at its start: tests/engine/supervisor/test_upgrade_imports.py.
from engine.ops.branch import BranchResult
from engine.ops.rollback_records import rollback_times
from engine.process_start import started_since_boot
from engine.protocol.facts import ENGINE_CHOICES, Engine, EventKind, LineState, SupervisorExitCode
from engine.protocol.wire import PROTOCOL_VERSION, RequestLog
from engine.supervisor import registry
from engine.supervisor.after_exit import AfterExit
from engine.supervisor.between_launches import BetweenLaunches
from engine.supervisor.branch_supervisors import BranchSupervisors
from engine.supervisor.forks import ForkQueue, QueuedFork
from engine.supervisor.gpu_watch import line_gpus
from engine.supervisor.launch import TrainerLaunching
from engine.supervisor.leasing import GpuLeasing, release_all
from engine.supervisor.lost import damaged_record
from engine.supervisor.notify import DEFAULT_TIMEOUT_S as NOTIFY_TIMEOUT_S
from engine.supervisor.preparer import PreparerKeeper
from engine.supervisor.publishing import Publishing
from engine.supervisor.reads import (
    beat_time,
    file_size,
    latest_update,
    pending_stop,
    pending_stop_now,
    read_json,
    supervisor_config,
)
from engine.supervisor.reserve import RESERVE_NAME, DiskReserve
from engine.supervisor.rows_tail import RowsTail
from engine.supervisor.rpc import LineHandler, PausedWork
from engine.supervisor.server import SupervisorServer
from engine.supervisor.settings import SupervisorSettings
from engine.supervisor.start import start_detached
from engine.supervisor.startup_checks import StartupChecks
from engine.supervisor.state import SupervisorState
from engine.supervisor.telling import Telling
from engine.training.line_lock import hold_line

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Supervisor(
    StartupChecks, GpuLeasing, TrainerLaunching, BetweenLaunches, AfterExit, Publishing, Telling,
):
    """One line's supervisor (see the module docstring): its loop and its state. Its mixins hold the
    rest: `StartupChecks` (what its start finds), `GpuLeasing` (its GPU leases), `TrainerLaunching`
    (its trainer's launch and watch), `BetweenLaunches` (the work done with the trainer stopped),
    `AfterExit` (what follows an exit), `Publishing` (the rows and beats it pushes) and `Telling`
    (run.log, events, supervisor.json)."""

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
            damage = damaged_record(self.layout.root)
            if damage is not None:  # replaced below by this supervisor's record: said, not done silently
                self._say(f"{damage}; replaced by this supervisor's record (the requests, queued branches "
                          "and crash count it held are lost)")
            if isinstance(previous.get("requests"), list):
                self.request_log.restore(previous["requests"])
            for note in self.forks.restore(previous.get("queued_forks")):  # and the pins a killed one left
                self._say(note)
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
                    recheck_delay=self.settings.preparer_recheck_seconds,
                    notify_stopped=lambda message: self._event(
                        EventKind.PREPARER_FAILING, message, stopped_for_good=True
                    ),
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
            self._reserve.release()  # its last words are written: the line's disk gets the room back
            os.close(line_lock)

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

    # ---- its branches ---------------------------------------------------------------------------

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

    # ---- run.json as last read ------------------------------------------------------------------

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
