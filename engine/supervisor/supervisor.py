"""The supervisor: keeps one training line running unattended.

`python -m engine.supervisor.supervisor LINE [--foreground] [--stop-at N]` (what `nsconsole run LINE` runs):
without `--foreground` it starts itself detached (`engine/supervisor/detach.py`: its own session, output to
`<line>/supervisor.out`), after refusing where systemd-logind would end it at logout, and
returns once the detached supervisor answers.

The supervisor (one per line: an exclusive flock on the line directory):

- starts nothing on a line that has finished, decided once it holds that flock (`nsconsole run`
  looked seconds before, and a trainer started without a supervisor may have finished it since);
- launches the trainer (`engine/training/main.py`) with run.log as its output, after taking
  the GPU lease (`engine/gpu/devices.py`: the first free one of the GPUs run.json's `device` names,
  `engine/gpu/placement.py`) and handing it to the trainer, which sees that GPU alone, by its UUID,
  as cuda:0; the trainer gets SIGTERM, and
  so stops at its next update with a checkpoint, if the supervisor dies;
- watches its heartbeat: none for `guards.watchdog_minutes` -> kill -9 and relaunch
  (`watchdog_restart`); a trainer that does not exit even then -> `stuck`, the supervisor stops;
- judges each exit by the recovery table (`engine/supervisor/verdict.py`, a pure function): a
  clean end, a stop, a line error (`failed`), a full disk (`disk-full`), a GPU left to other
  processes (relaunch once it is free), a SIGTERM it did not send (`signal_restart`), or a crash
  (resume from the newest checkpoint; after `max_failures` in a row without a newer checkpoint,
  `failed`; a crash beside other GPU processes is not counted, and after 3 such in a row the line
  waits for a free GPU);
- keeps the data line's preparer running beside the trainer (`engine/supervisor/preparer.py`);
- on SIGTERM, SIGINT or SIGHUP (or a `stop` call) stops the trainer with a checkpoint and exits;
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
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from datalines.errors import DataLineError
from engine.atomic import write_text_atomic
from engine.checkpoints.format import branched_from
from engine.config.host import HostSettings, load_and_apply
from engine.config.run import RunConfig
from engine.errors import LineError
from engine.gpu.devices import GpuLease, lease_holder, take_free_leases
from engine.gpu.placement import PhysicalGpu, PlacementError, child_environment
from engine.layout import LineLayout
from engine.logrotate import RotatingLog, rotate_if_needed
from engine.ops import lines as ops
from engine.ops.line_end import finished_line_error, line_end
from engine.ops.rollback_records import rollback_times
from engine.process_start import is_recorded_process, started_since_boot
from engine.protocol.facts import (
    ENGINE_CHOICES,
    FINAL_LINE_STATES,
    NOTIFIED_EVENTS,
    Engine,
    EventKind,
    LineState,
    Stage,
    StopReason,
    SupervisorExitCode,
)
from engine.protocol.wire import PROTOCOL_VERSION, RequestLog
from engine.supervisor import registry
from engine.supervisor.child import clear_exits, group_exit
from engine.supervisor.detach import foreground_argv, gather_logind_facts, logind_refusal, spawn_detached
from engine.supervisor.forks import ForkQueue, QueuedFork
from engine.supervisor.gpu_watch import line_gpus, memory_of_others_on_gpu, processes_on_gpu
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
    reload_config,
    supervisor_config,
)
from engine.supervisor.reserve import RESERVE_NAME, DiskReserve, is_disk_full
from engine.supervisor.rows_digest import is_validation_row
from engine.supervisor.rows_tail import RowsTail
from engine.supervisor.rpc import LineHandler, PausedWork
from engine.supervisor.server import SupervisorServer
from engine.supervisor.verdict import ExitContext, TrainerExit, judge_exit
from engine.training.line_lock import hold_line, refuse_a_held_line

if TYPE_CHECKING:
    from engine.ops.branch import BranchResult

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
MAX_RELAUNCH_DELAY_S = 300.0
ROWS_INDEX_EVERY = 4096
"""Rows between two saves of the index of rows.jsonl (`RowsTail.save`): at ns-2b's 2 s an update,
about every 2 h, so a start after a crash or a reboot reads at most this many rows of the file."""
INDEX_BYTES_PER_S = 25 * 2**20
"""The pace a start is allowed for indexing rows.jsonl before it answers: it read 3 GB in 43 s
(about 70 MB/s) on the 2-core development machine; a slower disk or a busy host reads slower."""
ANSWER_WAIT_S = 5.0
"""How long an ending supervisor waits for a refused rollback or tune to be answered."""


@dataclass
class SupervisorSettings:
    """The supervisor's timings and limits (run.json's guards give the watchdog interval)."""

    poll_seconds: float = 1.0
    """How often it looks at the trainer, its heartbeat, rows.jsonl and stop requests."""
    max_failures: int = 5
    """Crashes in a row without a newer checkpoint after which the line stops (`failed`)."""
    relaunch_delay_seconds: float = 5.0
    """Pause before relaunching the trainer after a crash (or restarting the data preparer after a
    failure); doubles with each one in a row (up to 5 min)."""
    kill_wait_seconds: float = 120.0
    """How long a trainer killed with SIGKILL may take to exit before it is reported `stuck`."""
    stop_wait_seconds: float = 1800.0
    """How long a trainer asked to stop (SIGTERM: checkpoint first) may take before SIGKILL."""
    watchdog_seconds: float | None = None
    """Overrides run.json's guards.watchdog_minutes (None: use it)."""
    engine: str = Engine.AUTO
    """The trainer's step engine (an `Engine`)."""
    stop_at: int | None = None
    """Passed to the trainer: stop cleanly at this update."""
    echo: bool = False
    """Print run.log as it grows (the foreground supervisor in a terminal)."""
    run_preparer: bool = True
    """Keep the data line's preparer running beside the trainer (`engine/supervisor/preparer.py`)."""
    preparer_command: list[str] | None = None
    """The preparer program before its `--work DATA` (None: `nsconsole data run-preparer`)."""
    trainer_command: list[str] | None = None
    """The program launched as the trainer, before its arguments (None: this Python running
    `engine.training.main`); tests give a scripted stand-in."""


@dataclass
class SupervisorState:
    """supervisor.json: what the supervisor is doing and what has happened (rewritten atomically)."""

    pid: int
    """The supervisor's pid."""
    started: float
    """When it started (Unix time)."""
    boot_start: float | None = None
    """When it started, in seconds since boot: with `pid`, this process, whatever the wall clock did
    since (engine.process_start)."""
    state: str = LineState.STARTING
    """What it is doing: a `LineState`."""
    trainer_pid: int | None = None
    """The running trainer's pid."""
    launches: int = 0
    """Trainer launches by this supervisor."""
    trainer_launched: float | None = None
    """When the running trainer was launched (Unix time; None while none runs): the console judges
    its throughput only past its first updates (compilation, warm-up)."""
    crashes: int = 0
    """Trainer exits nobody asked for (`Verdict.crashed`), and supervisors that died with the line
    running, over every life of this line's supervisor (carried over from the supervisor.json before)."""
    failures_in_a_row: int = 0
    """Crashes since the last one that left a newer checkpoint."""
    crashes_beside_others: int = 0
    """Crashes in a row without progress while other processes were on the GPU (not failures)."""
    gpu_index: int | None = None
    """The GPU of the line's lease, NVML's index: held by its trainer, or its last one between two
    launches (None: on the CPU, or waiting for a lease)."""
    gpu_uuid: str | None = None
    """That GPU's UUID: the trainer's CUDA_VISIBLE_DEVICES (`engine/gpu/placement.py`)."""
    trainer_children: list[int] = field(default_factory=list)
    """At parallel.degree above 1, the trainer's processes under `trainer_pid` (torchrun's ranks and
    what they start), so that a reader can sum the line's CPU, memory and GPU memory; empty at
    degree 1, where the trainer is one process."""
    gpu_indices: list[int] = field(default_factory=list)
    """Every GPU of the line's leases, rank 0's first (`gpu_index` alone at parallel.degree 1;
    empty with it None). Each is watched for other processes as the line's own."""
    gpu_candidates: list[int] | None = None
    """The GPUs run.json's `device` lets the line lease, in the order it tries them (None: the CPU)."""
    gpu_holders: list[dict[str, Any]] = field(default_factory=list)
    """While it waits for a lease: who holds each candidate's (`gpu`, `uuid`, `line`, `pid`)."""
    last_exit: dict[str, Any] | None = None
    """The trainer's last exit: code, signal, seconds it ran, newest checkpoint."""
    last_event: dict[str, Any] | None = None
    """The last event (as notified)."""
    requests: list[dict[str, Any]] = field(default_factory=list)
    """Mutations already applied, by request_id (a retry is answered from here)."""
    queued_forks: list[dict[str, Any]] = field(default_factory=list)
    """Branches waiting for the end of their trunk cycle (`engine.supervisor.forks.QueuedFork`)."""
    engine: str = Engine.AUTO
    """The step engine it launches trainers with (`run --engine`): a lost supervisor's line is
    resumed with it (`engine.supervisor.lost`)."""
    stop_at: int | None = None
    """The update its trainers stop at (`run --stop-at`; None: none): kept by a resume too."""


class Supervisor:
    """One line's supervisor (see the module docstring)."""

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
        self._branch_supervisors: list[int] = []  # started by this one: reaped when they exit (guarded by _lock)
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
                self._log.close()
                if self.settings.echo:
                    self._echo_run_log()
                deadline = time.monotonic() + NOTIFY_TIMEOUT_S
                for thread in self._notifying:
                    thread.join(timeout=max(0.0, deadline - time.monotonic()))
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

    # ---- one launch -----------------------------------------------------------------------------

    def _take_gpus(self, gpus: list[PhysicalGpu], count: int) -> list[GpuLease] | None:
        """The leases of the first `count` free GPUs of `gpus` (one per rank of `parallel.degree`),
        waited for as long as other lines hold too many of them (none is held meanwhile:
        `take_free_leases`); None if a stop comes first. The GPUs trained on before are tried first,
        and after a launch that left its GPU to other processes, the GPUs with none on them are (an
        `auto` line moves rather than waits); no line has priority over another."""
        waited_since = time.monotonic()
        told = False
        said: list[tuple[int, str]] | None = None
        while True:
            order = self._lease_order(gpus)
            taken = take_free_leases([GpuLease(gpu.index, self.layout.root, gpu.uuid) for gpu in order], count)
            if taken is not None:
                by_index = {gpu.index: gpu for gpu in gpus}
                self._placed = [by_index[lease.index] for lease in taken]
                self._set(gpu_index=taken[0].index, gpu_uuid=taken[0].uuid,
                          gpu_indices=[lease.index for lease in taken], gpu_holders=[])
                return taken
            # A lease freed since the try above is left out: the next try takes it.
            holders = [(gpu, holder) for gpu in gpus if (holder := lease_holder(gpu.index)) is not None]
            held_by = [(gpu.index, holder.line or f"pid {holder.pid}") for gpu, holder in holders]
            records = [{"gpu": gpu.index, "uuid": gpu.uuid, "line": holder.line, "pid": holder.pid}
                       for gpu, holder in holders]  # fmt: skip
            what = f"GPU {gpus[0].index}" if len(gpus) == 1 else "a GPU" if count == 1 else f"{count} GPUs"
            if self.state.state != LineState.WAITING_GPU or held_by != said:
                # The reason in run.log first: whoever sees the state (supervisor.json, `status`) finds it there.
                taken_by = ", ".join(f"GPU {index} by {line}" for index, line in held_by)
                self._say(f"waiting for {what}: leases held ({taken_by})")
                self._set(state=LineState.WAITING_GPU, gpu_index=None, gpu_uuid=None, gpu_indices=[],
                          gpu_holders=records)
                said = held_by
            if not told and time.monotonic() - waited_since > self._watchdog_seconds():
                self._event(EventKind.GPU_WAIT, f"waiting for {what} longer than the watchdog interval")
                told = True
            self._pump()
            self._do_paused_work(gpu_ready=False)
            if self._stopping or pending_stop_now(self.layout):
                return None
            time.sleep(self.settings.poll_seconds)

    def _lease_order(self, gpus: list[PhysicalGpu]) -> list[PhysicalGpu]:
        """`gpus` in the order to try their leases (see `_take_gpus`)."""
        def rank(gpu: PhysicalGpu) -> tuple[bool, bool]:
            busy = self._need_free_gpu and bool(processes_on_gpu(gpu.index, exclude=()))
            return busy, gpu not in self._placed

        return sorted(gpus, key=rank) if len(gpus) > 1 else gpus

    def _wait_for_free_gpu(self, index: int) -> bool:
        """Wait (holding the lease) until no process is on the GPU -- or, where the trainer left
        beside others after training on (`_others_may_stay`), until they hold no more than
        guards.share_reserve_gb (it then starts beside them with the shared shapes); False if a stop
        comes first."""
        waited_since = time.monotonic()
        told = False
        while (others := processes_on_gpu(index, exclude=())) and not self._others_fit_the_reserve(index):
            if self.state.state != LineState.WAITING_GPU:
                self._say(f"waiting for GPU {index} to be free (other processes on it: {others})")
                self._set(state=LineState.WAITING_GPU)
            if not told and time.monotonic() - waited_since > self._watchdog_seconds():
                message = f"waiting for GPU {index} to be free longer than the watchdog interval"
                self._event(EventKind.GPU_WAIT, message)
                told = True
            self._pump()
            self._do_paused_work(gpu_ready=False)
            if self._stopping or pending_stop_now(self.layout):
                return False
            time.sleep(self.settings.poll_seconds)
        return True

    def _others_fit_the_reserve(self, index: int) -> bool:
        if not self._others_may_stay:
            return False
        config = self._config or reload_config(self.layout, None)
        reserve = None if config is None else config.guards.share_reserve_bytes
        held = memory_of_others_on_gpu(index)
        return reserve is not None and held is not None and held <= reserve

    def _run_trainer(self, leases: list[GpuLease]) -> TrainerExit:
        self._wait_for_an_earlier_trainer()
        self._config = reload_config(self.layout, self._config)
        rotate_if_needed(self.layout.run_log)
        checkpoint_before = latest_update(self.layout)
        argv = self._trainer_argv()
        clear_exits(self.layout.root)
        output = os.open(self.layout.run_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            trainer = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                pass_fds=tuple(lease.fileno() for lease in leases), close_fds=True,
                env=self.placed_environment(),
            )
        finally:
            os.close(output)
        for lease in leases:
            lease.record_holder(trainer.pid)
            lease.release()  # the trainer (torchrun and its ranks) holds it now, for exactly its life
        launched = time.time()
        self._set(state=LineState.TRAINING, trainer_pid=trainer.pid, launches=self.state.launches + 1,
                  trainer_launched=launched)
        self._say(f"trainer launched (pid {trainer.pid}, launch {self.state.launches})")
        self._publish_event(EventKind.LAUNCHED, f"trainer launched (pid {trainer.pid})")
        outcome = self._watch(trainer, launched)
        if self._degree() > 1 and outcome.code not in (0, None) and not outcome.killed_by_watchdog:
            # torchrun exits 1 whatever its ranks said: the verdict reads the status they left.
            recorded = group_exit(self.layout.root)
            outcome.code = outcome.code if recorded is None else recorded
        outcome.progressed = (latest_update(self.layout) or -1) > (checkpoint_before or -1)
        self._pump()
        exit_record = {"code": outcome.code, "ran_seconds": round(outcome.ran_seconds, 3),
                       "latest_checkpoint": latest_update(self.layout), "time": time.time()}
        self._set(trainer_pid=None, trainer_children=[], trainer_launched=None, last_exit=exit_record)
        return outcome

    def _degree(self) -> int:
        """The line's `parallel.degree` as last read (1 before run.json is)."""
        return self._config.parallel.degree if self._config is not None else 1

    def _trainer_argv(self) -> list[str]:
        """The trainer's command line. At `parallel.degree` N > 1, torchrun starting N ranks of it
        (`--max-restarts=0`: the supervisor relaunches, from the newest checkpoint, by its verdict;
        `--shutdown-timeout`: ranks asked to stop may take as long to checkpoint as a trainer
        alone), exec'd through engine.supervisor.child so that it gets SIGTERM if the supervisor
        dies; torchrun forwards it to the ranks."""
        program = self.settings.trainer_command or [sys.executable, "-m", "engine.training.main"]
        argv = [*program, str(self.layout.root), "--parent", str(os.getpid())]
        argv += ["--engine", self.settings.engine]
        if self.settings.stop_at is not None:
            argv += ["--stop-at", str(self.settings.stop_at)]
        degree = self._degree()
        if degree == 1:
            return argv
        torchrun = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={degree}",
            "--max-restarts=0", f"--shutdown-timeout={math.ceil(self.settings.stop_wait_seconds)}", "--no-python",
        ]  # fmt: skip
        return [sys.executable, "-m", "engine.supervisor.child", str(os.getpid()), "--", *torchrun, *argv]

    def _group_of(self, trainer: subprocess.Popen[bytes]) -> tuple[int, ...]:
        """The trainer's pid and, at a degree above 1, its ranks' (torchrun's descendants)."""
        if self._degree() == 1:
            return (trainer.pid,)
        try:
            return (trainer.pid, *(child.pid for child in psutil.Process(trainer.pid).children(recursive=True)))
        except psutil.Error:
            return (trainer.pid,)

    def _watch(self, trainer: subprocess.Popen[bytes], launched: float) -> TrainerExit:
        stopped_by_us = False
        paused = False  # stopped for paused work (a rollback, a tune): relaunched after it
        stop_file_seen = False  # a clean exit after a STOP request is a stop, not the line's end
        asked_to_stop_at = 0.0
        data_wait_since: float | None = None  # when the trainer began waiting for a data cycle
        told_data_wait = False
        others: list[int] = []
        launch_pids: set[int] = set()
        # Silence is timed on this process's monotonic clock from when a new beat was seen: a beat's
        # own time is the wall clock's, which an NTP step or a resumed VM moves by hours (forward,
        # a healthy trainer would be killed; back, a hung one kept).
        beat_stamp: float | None = None  # the newest beat's own time, only to tell a new beat
        beat_seen_at = time.monotonic()
        while True:
            stop_file_seen = stop_file_seen or pending_stop(self.layout) is not None
            code = trainer.poll()
            group = self._group_of(trainer)
            if sorted(group[1:]) != self.state.trainer_children:
                self._set(trainer_children=sorted(group[1:]))
            if self.state.gpu_indices:  # every rank's GPU is the line's to watch
                now_on_gpu = sorted({pid for index in self.state.gpu_indices
                                     for pid in processes_on_gpu(index, exclude=group)})  # fmt: skip
                # At the exit, what was there at the last look before it counts too.
                others = sorted(set(others) | set(now_on_gpu)) if code is not None else now_on_gpu
            if code is not None:
                ran = time.time() - launched
                heartbeat = read_json(self.layout.heartbeat) or {}
                stop_served = (heartbeat.get("stage") == Stage.STOPPED and heartbeat.get("reason") == StopReason.STOP_FILE
                               and heartbeat.get("pid") in launch_pids | set(group))  # this launch's beat
                return TrainerExit(
                    code, ran, stopped_by_us=stopped_by_us, stop_requested=stop_file_seen, stop_served=stop_served,
                    others_on_gpu=others, paused_for_work=paused,
                )
            self._pump()
            if self._stopping and not stopped_by_us:
                self._set(state=LineState.STOPPING)
                self._say("stopping the trainer (SIGTERM: it checkpoints first)")
                trainer.send_signal(signal.SIGTERM)
                stopped_by_us, asked_to_stop_at = True, time.monotonic()
            work = self._paused_work
            if work is not None and not (paused or stopped_by_us):
                self._set(state=LineState.PAUSING)
                self._say(f"stopping the trainer for the {work.name} (SIGTERM: it checkpoints first)")
                trainer.send_signal(signal.SIGTERM)
                paused, asked_to_stop_at = True, time.monotonic()
            asked = stopped_by_us or paused
            if asked and time.monotonic() - asked_to_stop_at > self.settings.stop_wait_seconds:
                self._say(f"the trainer did not stop in {self.settings.stop_wait_seconds:g} s: killing it")
                outcome = self._kill(trainer, launched, watchdog=False, stopped_by_us=stopped_by_us)
                outcome.paused_for_work = paused
                return outcome
            heartbeat = read_json(self.layout.heartbeat)
            silence_allowed = self._watchdog_seconds()
            # Every pid of this launch seen so far: rank 0 may have left (its heartbeat says so) while
            # torchrun tears the group down, and its beat is still this launch's, not a stale one.
            launch_pids.update(self._group_of(trainer))
            if heartbeat is not None and heartbeat.get("pid") in launch_pids:  # rank 0's in a group
                if (stamp := beat_time(heartbeat)) != beat_stamp:
                    beat_stamp, beat_seen_at = stamp, time.monotonic()
                if heartbeat.get("stage") == Stage.STOPPED:
                    # It has checkpointed and is leaving (W&B's bounded close, a group's last barrier):
                    # a stopping trainer's allowance bounds that, not the watchdog's silence.
                    silence_allowed = max(silence_allowed, self.settings.stop_wait_seconds)
                if heartbeat.get("stage") != Stage.WAITING_DATA:
                    data_wait_since, told_data_wait = None, False
                elif data_wait_since is None:
                    data_wait_since = beat_seen_at
                elif not told_data_wait and time.monotonic() - data_wait_since > self._watchdog_seconds():
                    cycle = heartbeat.get("cycle")
                    self._event(EventKind.DATA_WAIT, f"the trainer has waited for data cycle {cycle} longer than the "
                                "watchdog interval")
                    told_data_wait = True
            if not asked and time.monotonic() - beat_seen_at > silence_allowed:
                return self._kill(trainer, launched, watchdog=True, stopped_by_us=False)
            time.sleep(self.settings.poll_seconds)

    def _kill(
        self, trainer: subprocess.Popen[bytes], launched: float, watchdog: bool, stopped_by_us: bool
    ) -> TrainerExit:
        if watchdog:
            silence = self._watchdog_seconds()
            self._say(f"no heartbeat for {silence:g} s: killing the trainer (pid {trainer.pid})")
        # A group's ranks run in sessions of their own, and one stopped or stuck in a collective
        # answers no SIGTERM torchrun forwards: each is killed, as torchrun is.
        ranks = [psutil.Process(pid) for pid in self._group_of(trainer)[1:] if psutil.pid_exists(pid)]
        trainer.kill()
        for rank in ranks:
            with contextlib.suppress(psutil.Error):
                rank.kill()
        try:
            code: int | None = trainer.wait(timeout=self.settings.kill_wait_seconds)
        except subprocess.TimeoutExpired:
            code = None
        _gone, alive = psutil.wait_procs(ranks, timeout=self.settings.kill_wait_seconds)
        if alive:
            code = None  # a rank that SIGKILL does not end: the GPU may hang
        ran = time.time() - launched
        return TrainerExit(code, ran, killed_by_watchdog=watchdog, stopped_by_us=stopped_by_us)

    def _wait_for_an_earlier_trainer(self) -> None:
        """A trainer of this line still alive (its supervisor died; it is checkpointing) must end first."""
        heartbeat = read_json(self.layout.heartbeat)
        if heartbeat is None or heartbeat.get("stage") == Stage.STOPPED:
            return
        pid = heartbeat.get("pid")
        try:
            process = psutil.Process(int(pid))
            if not is_recorded_process(process, heartbeat.get("pid_boot_start"), beat_time(heartbeat)):
                return  # the pid now belongs to another process
        except (psutil.Error, TypeError, ValueError):
            return
        self._say(f"an earlier trainer of this line (pid {pid}) is still running: waiting for it to exit")
        deadline = time.monotonic() + self.settings.stop_wait_seconds
        try:
            process.terminate()  # its supervisor is gone: it must checkpoint and go
            while process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                if time.monotonic() > deadline:
                    process.kill()
                    process.wait(self.settings.kill_wait_seconds)
                    return
                self._pump()
                time.sleep(self.settings.poll_seconds)
        except (psutil.NoSuchProcess, psutil.TimeoutExpired):
            pass  # gone (or, past the kill, stuck: the launch then fails and is counted)

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
        failure = self._start_branch(result.line)
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

    def _start_branch(self, branch: Path) -> str | None:
        """Start the branch's own supervisor detached (this one's engine, no `--stop-at`); None when
        it started, else why not (the branch stays: `nsconsole run` it by hand)."""
        try:
            pid = start_detached(branch, SupervisorSettings(engine=self.settings.engine))
        except LineError as error:
            return str(error)
        except Exception as error:  # the trunk goes on; the operator is told
            return f"internal error: {type(error).__name__}: {error}"
        with self._lock:
            self._branch_supervisors.append(pid)
        return None

    def _reap_branch_supervisors(self) -> None:
        # A started branch supervisor is this process's child: once it exits, collect its status, or
        # it stays a zombie for as long as the trunk runs.
        with self._lock:
            started = list(self._branch_supervisors)
        ended = set()
        for pid in started:
            try:
                finished, _status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                finished = pid  # collected already
            if finished:
                ended.add(pid)
        if ended:
            with self._lock:
                self._branch_supervisors = [pid for pid in self._branch_supervisors if pid not in ended]

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
        self._reap_branch_supervisors()
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
            self._notifying.append(notify_in_background(self._notify_command, event))

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


def release_all(leases: list[GpuLease]) -> None:
    """Let go of leases this process holds (one handed to a trainer already is the trainer's)."""
    for lease in leases:
        lease.release()


# ---- the command --------------------------------------------------------------------------------


class SupervisorSilent(LineError):
    """`start_detached` started a supervisor that has not answered in time. It may still come up,
    and it is the caller's child: `pid` lets a caller that lives on (the console) reap it."""

    def __init__(self, message: str, pid: int) -> None:
        super().__init__(message)
        self.pid = pid


def start_detached(line: Path, settings: SupervisorSettings, answer_timeout: float = 60.0) -> int:
    """Start the line's supervisor in the background and wait until it answers; its pid.

    `SupervisorSilent` (with the pid) when it runs but has not answered within answer_timeout."""
    layout = ops.open_line(line)
    RunConfig.load(layout.run_json)  # a broken run.json is reported here, in the terminal
    running = registry.find_supervisor(layout.root)
    if running is not None:
        raise LineError(f"{layout.root}: a supervisor already runs this line (pid {running.pid})")
    refuse_a_held_line(layout)  # refused here, not in supervisor.out, while another holds the line
    options = ["--engine", settings.engine]
    if settings.stop_at is not None:
        options += ["--stop-at", str(settings.stop_at)]
    refusal = logind_refusal(gather_logind_facts(), layout.root, [*foreground_argv(layout.root), *options])
    if refusal is not None:
        raise LineError(refusal)
    rotate_if_needed(layout.supervisor_out)
    started_at = file_size(layout.supervisor_out)
    argv = [sys.executable, "-m", "engine.supervisor.supervisor", str(layout.root), "--detached-child", *options]
    pid = spawn_detached(argv, layout.supervisor_out)
    answer_timeout = answer_wait(layout, answer_timeout)
    deadline = time.monotonic() + answer_timeout
    while time.monotonic() < deadline:
        entry = registry.find_supervisor(layout.root)
        if entry is not None and entry.pid == pid:
            return pid
        finished, status = os.waitpid(pid, os.WNOHANG)
        if finished:
            output = layout.supervisor_out.read_bytes()[started_at:].decode("utf-8", errors="replace").strip()
            last = output.splitlines()[-1].removeprefix("nsconsole: ") if output else \
                f"exit status {os.waitstatus_to_exitcode(status)}"
            raise LineError(f"{layout.supervisor_out}: the supervisor did not start: {last}")
        time.sleep(0.1)
    raise SupervisorSilent(f"{layout.supervisor_out}: the supervisor (pid {pid}) has not answered within "
                           f"{answer_timeout:.0f} s; see that file", pid)


def answer_wait(layout: LineLayout, base: float) -> float:
    """How long a start waits for its supervisor to answer: `base`, and the time its start takes to
    index what of rows.jsonl the saved index does not cover (`INDEX_BYTES_PER_S`): the first start
    on a line of months reads gigabytes before it serves, and would be reported silent meanwhile."""
    unindexed = file_size(layout.rows_jsonl) - RowsTail.indexed_bytes(layout.rows_index)
    return base + max(0, unindexed) / INDEX_BYTES_PER_S


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
