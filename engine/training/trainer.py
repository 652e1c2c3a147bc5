"""The training loop of one line: resume, update, record, checkpoint, stop.

`Trainer(line_dir).run()` trains until `--stop-at`, a STOP request, a signal, the end of the
plan or the end of the data line, and returns the exit status. The line's position is exact:

- the data position is (cycle, sample) at the stage's sequence length; an update takes the next
  `tokens_per_update(config, data tokens) / seq_len` samples of the cycle's seeded order, and never
  spans a cycle end or a stage (sequence length) change -- a cycle's or a stage's last update may
  be short; a stage that changes the length inside a cycle reads the targets the cycle has left,
  laid out anew at its length (the position's `earlier`, datalines.relay), so every target of the
  cycle is trained once;
- a checkpoint records that position with the manifest's sha256 and the sample order's digest, the
  weights, the optimizer state, the model's extra state, the RNG states and the number of rows in
  rows.jsonl; a resume restores all of it, cuts rows.jsonl back to that count and refuses a data
  line whose manifest or sample order differs;
- on the CPU an interrupted and resumed line reproduces the uninterrupted one bit for bit.

Kept checkpoints: the line's start (update 0), every cycle end, every stage end. Rolling ones
every `checkpoints.every_updates`, and one at exit.

Every `validation.every_updates` updates, and at the line's last update (its plan's or its data line's
end), the update's row also carries the validation's readings
(engine.training.validation: held-out losses, probes, the optimizer's state, the moving average's losses)
and its samples (engine.training.samples: short generations on held-out prompts, as text), and is
printed whatever `print_every`; validation leaves everything training depends on untouched.

On a CUDA line, every `guards.gpu_check_every` updates (and at the start) the trainer looks for other
processes on its GPU (engine.gpu.sharing): beside them, within `guards.share_reserve_gb`, it trains with
the lengths' `shared` shapes (same updates, another micro-batch split) until they have been gone for
three checks; without a reserve, or past it, it checkpoints and raises `GpuBusy`, as it does when
the GPU runs out of memory beside them. The row's `gpu_mode` says which shapes computed it. The
engines themselves, one per length in the mode's shapes, and the GPU arena they share are
engine.training.engines's.

Every row is appended to rows.jsonl, then handed to the line's W&B mirror (engine.wandb.mirror), which sends
it from a background thread: training never waits on W&B and never fails because of it, and
whatever W&B missed (a crash, an outage, a rollback) is re-sent from rows.jsonl by a later start.

The trainer's components, mixed into `Trainer` and sharing its state (each module's docstring says
what it uses and what it sets): the stops it answers (engine.training.stop_requests), its data
cycles (engine.training.data_cycles), one update and its row (engine.training.one_update), its
checkpoints and disk guard (engine.training.checkpointing) and its watch of the GPU
(engine.training.gpu_guard). This module holds the start, the loop and the exit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import torch

from datalines import open_data_line
from datalines.consumption import claim_cycle, claim_data_line
from datalines.cycle import Cycle
from datalines.errors import ShardChanged
from engine.checkpoints.disk_budget import refuse_a_start_without_room
from engine.checkpoints.format import (
    LINE_START_KEPT,
    discard_partial_writes,
    no_checkpoint_left_problem,
    resume_candidate,
)
from engine.checkpoints.tensors import CheckpointWriter, find_resume_point
from engine.config.run import RunConfig, WandbConfig
from engine.errors import CheckpointError, ConfigError, LineError
from engine.gpu.placement import placed_device
from engine.gpu.sharing import GpuWatch, refuse_unshareable_lengths
from engine.layout import LineLayout
from engine.metrics import METRICS_VERSION, metrics_mismatch
from engine.models.build import build_model, refuse_unfit_memory
from engine.ops import lines as ops
from engine.ops.check import stage_length_refusal
from engine.ops.rollback import rows_remedy
from engine.protocol.facts import SIGNAL_EXIT_BASE, Engine, Stage, StopReason, TrainerExitCode
from engine.rows import Heartbeat, RowsFile, RunLog
from engine.supervisor.child import rank_file
from engine.training.checkpointing import Checkpointing
from engine.training.cpu_heap import keep_freed_memory
from engine.training.cpu_share import CpuSeat
from engine.training.data_cycles import DataCycles
from engine.training.distributed import FullyShardedModel, Ranks, refuse_written_state
from engine.training.dreaming import Dreamer
from engine.training.engines import ArenaNotReleased, StepEngines
from engine.training.gpu_guard import GpuGuard
from engine.training.line_lock import hold_trainer_lock
from engine.training.one_update import OneUpdate
from engine.training.optim import AdamWSettings, FlatAdamW, ParameterAverage
from engine.training.phase_beat import PhaseBeats
from engine.training.position import Position
from engine.training.samples import ValidationSampler
from engine.training.sharded_optim import ShardedFlatAdamW
from engine.training.startup import CompileCaches, StartupClock, TimedPhases
from engine.training.stop_requests import StopRequests
from engine.training.validation import Validator
from engine.wandb.mirror import WandbMirror

WANDB_CLOSE_SECONDS = 30.0
"""How long an exiting trainer lets W&B take what is queued; the next start re-sends the rest."""


def resolve_device(setting: str, source: str = "run.json: device") -> torch.device:
    """A device setting (run.json `device`, bench --device): `auto` is CUDA when available, else the CPU.

    A trainer or tune the supervisor placed on a leased GPU sees that GPU alone, as cuda:0
    (`engine.gpu.placement.placed_device`)."""
    setting = placed_device(setting)
    if setting == "auto":
        setting = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(setting)
    except RuntimeError:
        raise ConfigError(f"{source} must be auto, cpu, cuda or cuda:N, got {setting!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"{source} must be auto, cpu, cuda or cuda:N, got {setting!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{source} is {setting!r} but no CUDA device is available")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


class Trainer(StopRequests, DataCycles, OneUpdate, Checkpointing, GpuGuard):
    """One line's training loop (see the module docstring): its start, its loop and its exit; its stops
    are `StopRequests`'s, its data cycles `DataCycles`'s, an update and its row `OneUpdate`'s, its
    checkpoints and disk guard `Checkpointing`'s, its watch of the GPU `GpuGuard`'s."""

    def __init__(
        self,
        line_dir: Path | str,
        *,
        stop_at: int | None = None,
        echo: TextIO | None = sys.stdout,
        engine: str = Engine.AUTO,
        gpu_watch: Callable[[RunConfig, torch.device], GpuWatch] = GpuWatch.for_line,
        process_began: float | None = None,
        owns_process: bool = False,
    ):
        """`process_began`: when this process started (seconds since the epoch), so that the start-up's
        breakdown (engine.training.startup) counts the interpreter and the imports before this.
        `owns_process`: the process is this trainer's own (launched by the supervisor, or `nsconsole
        run --no-supervisor`), so process-wide settings for its device are its to make: on a CPU,
        freed memory kept for the next update (engine.training.cpu_heap) and its threads shared with
        the host's other CPU lines (engine.training.cpu_share)."""
        self.owns_process = owns_process
        self.startup = StartupClock(process_began)
        self.compile_caches: CompileCaches | None = None
        self.layout: LineLayout = ops.open_line(line_dir)
        self.stop_at = stop_at
        self.echo = echo
        self.engine_choice = engine
        self._signal: int | None = None
        self._cycles: dict[int, Cycle] = {}
        self._digests: dict[tuple[int, int, tuple[tuple[int, int], ...]], str] = {}
        self._last_checkpoint_update: int | None = None
        self._make_gpu_watch = gpu_watch
        self.cpu_seat: CpuSeat | None = None
        """This process's seat among the host's CPU trainers (engine.training.cpu_share), when it owns
        its process on a CPU."""
        self.ranks = Ranks.from_environment()
        """This process's rank in a torchrun group (engine.training.distributed), or alone."""

    def _start(self) -> None:
        """Everything the loop trains with: run.json and its checks, the model, the optimizer,
        validation and the step engines, then the resume from the newest good checkpoint (or the
        line's first one); the data line becomes this line's only once the checks have passed. Each
        step is timed for the start-up's breakdown (engine.training.startup)."""
        layout = self.layout
        self.config = config = RunConfig.load(layout.run_json)
        if config.metrics != METRICS_VERSION:
            raise ConfigError(metrics_mismatch(str(layout.run_json), config.metrics))
        refuse_unshareable_lengths(config, str(layout.run_json))
        problems = ops.unaccepted_changes(layout, config)  # lifelong keys changed without allow_changes
        # The begun stage's length: resumed at another, it would read its cycle in another order.
        stage_change = stage_length_refusal(layout, config, resume_candidate(layout.checkpoints))
        problems += [stage_change] if stage_change is not None else []
        if problems:
            raise ConfigError("; ".join(problems))
        self.run_json_bytes = layout.run_json.read_bytes()
        ranks = self.ranks
        self.device = ranks.connect(config.parallel, resolve_device(config.device, f"{layout.run_json}: device"),
                                   str(layout.run_json))
        if self.owns_process and self.device.type == "cpu":
            keep_freed_memory()
            self.cpu_seat = CpuSeat.take()
        self.gpu_watch = self._make_gpu_watch(config, self.device)
        self.data_line = open_data_line(ops.resolve_data_path(layout, config.data.line))
        layout.checkpoints.mkdir(exist_ok=True)
        # The other ranks keep their own log and heartbeat: the line's are rank 0's.
        writes = ranks.writes
        self.log = RunLog(layout.run_log if writes else rank_file(layout.root, ranks.rank, "log"),
                          self.echo if writes else None)  # fmt: skip
        if writes:
            for name in discard_partial_writes(layout.checkpoints):
                self.log.write(f"discarded an interrupted checkpoint write: {name}")
        # Before anything compiles; rank 0 keeps the caches' bound before the barrier.
        self.compile_caches = CompileCaches(layout.compile_cache)
        self.compile_caches.use(clean=writes, log=self.log.write)
        ranks.barrier()  # no rank lists the checkpoints while rank 0 discards a partial one
        self.startup.lap("set-up")
        resume = find_resume_point(layout.checkpoints)
        self.startup.lap("checkpoint load")
        for problem in resume.problems:
            self.log.write(f"skipped a bad checkpoint: {problem}")
        if resume.checkpoint is None and (lost := no_checkpoint_left_problem(layout)) is not None:
            raise CheckpointError(lost)  # a fresh start would erase the line's rows

        refuse_unfit_memory(config, self.device, str(layout.run_json))  # before anything is allocated
        self.startup.lap("memory check")
        torch.manual_seed(config.seeds.model)
        if self.device.type == "cuda":
            torch.cuda.manual_seed_all(config.seeds.model)
        self.model = build_model(config.model.preset, config.model.overrides).to(self.device)
        self.startup.lap("model build")
        refuse_written_state(self.model, ranks.size, config.model.preset, str(layout.run_json))
        resumed_from = resume.checkpoint.update if resume.checkpoint is not None else None
        refuse_a_start_without_room(layout.root, layout.checkpoints, self._checkpoint_size(), resumed_from)
        betas = config.optimizer.betas
        settings = AdamWSettings(betas[0], betas[1], config.optimizer.eps, config.optimizer.clip)
        self.sharded = self._shard_model()
        self.optimizer = (ShardedFlatAdamW(self.model, settings, self.device, ranks) if self.sharded is not None
                          else FlatAdamW(self.model, settings, self.device))  # fmt: skip
        self.average = (
            ParameterAverage(self.optimizer, config.ema.horizon_tokens, config.ema.from_tokens)
            if config.ema is not None
            else None
        )
        self.validator = Validator.for_line(
            layout, config, self.model, self.optimizer, self.average, self.device, ranks
        )
        self.validator.require_rows()
        self.dreamer = Dreamer.for_line(config, self.model)
        self.sampler = ValidationSampler(
            self.model, self.device, config.validation.samples, config.seeds.model,
            self.validator.heldout, self.validator.rows,
        )  # fmt: skip
        if self.sampler.unavailable is not None:
            self.log.write(self.sampler.unavailable)
        self.engines = StepEngines(
            self.model,
            self.optimizer,
            config,
            self.device,
            self.engine_choice,
            room_for_others=self.gpu_watch.room_for_others,
            before_capture=self._probe_rows_before_capture,
            log=self.log.write,
            phase=lambda stage, **details: self.beats.phase(stage, self.position.update, **details),
            ranks=ranks,
            sharded=self.sharded,
        )
        self.position = Position()
        self.startup.lap("optimizer and held-out rows")
        # The start passed its checks: the data line becomes this line's before any cycle is read
        # (another line that started on it first refuses this one).
        taken_over = claim_data_line(self.data_line.path, layout.root, writes=writes)
        if taken_over is not None:
            self.log.write(taken_over)
        if resume.checkpoint is not None:
            self._restore(resume.checkpoint)
            state = resume.checkpoint.state
            if writes:
                try:
                    RowsFile.cut_back(layout.rows_jsonl, state["rows"], state["rows_bytes"])
                except LineError as error:
                    raise LineError(f"{error}; {rows_remedy(layout)}") from None
            abandoned_after: int | None = resume.checkpoint.update
            self.log.write(f"resumed from {resume.checkpoint.directory.name} ({self._where()})")
        else:
            if writes:
                RowsFile.cut_back(layout.rows_jsonl, 0, 0)
            abandoned_after = None
            parameters = self.model.num_parameters()
            self.log.write(f"new line: {config.model.preset}, {parameters:,} parameters on {self.device}")
        self.startup.lap("checkpoint load")
        # Another line's consumed cycle would keep this one waiting for it forever: refuse it now.
        reopened = claim_cycle(self.data_line, self.position.cycle, layout.root, writes=writes)
        if reopened is not None:
            self.log.write(reopened)
        self._share_rank_zero_state()
        self.rows = RowsFile(layout.rows_jsonl) if writes else None
        self.heartbeat = Heartbeat(layout.heartbeat if writes else rank_file(layout.root, ranks.rank, "heartbeat"))
        self.beats = TimedPhases(PhaseBeats(self.heartbeat, Stage.TRAINING, self._beaten_cycle), self.startup)
        self.writer = CheckpointWriter(
            layout.checkpoints, config.checkpoints.keep_last, abandoned_after, config.checkpoints.keep_cycle_ends
        )
        if writes:
            # The start passed its checks: this is the accepted configuration.
            for change in ops.accept(layout.root, config):
                self.log.write(f"run.json accepted: {change}")
        # Made before the first checkpoint, which records the line's W&B run (`_snapshot`); the
        # line's W&B run is rank 0's to write.
        wandb_settings = config.wandb if writes else WandbConfig(mode="disabled")
        # rows.jsonl holds the line's rows up to `resumed_from` (cut back above): what a rewind's start sends.
        self.mirror = WandbMirror(layout.root, wandb_settings, run_config=config.to_dict(), report=self.log.write,
                                  resumed_from=resumed_from)
        if resume.checkpoint is None:
            # Written in the background while the model compiles, probes its rows and captures its
            # step (a 1.3B line's start checkpoint took 64 s of a 163 s start-up on an H100's disk
            # when the start waited for it); the first checkpoint after it waits for it to be durable.
            self._checkpoint(kept=LINE_START_KEPT)
        # Only now, with rows.jsonl cut back to the state resumed, may the mirror read it to re-send
        # what W&B lacks; a start refused by its checks leaves W&B untouched.
        self.mirror.start()
        self.startup.lap("rows and W&B")

    def _shard_model(self) -> FullyShardedModel | None:
        """The model under FSDP2 (`parallel.shard: fsdp`, engine.training.distributed) above degree 1;
        at degree 1 there is nothing to shard and the line trains as `none` (the same update)."""
        config, ranks, where = self.config, self.ranks, self.layout.run_json
        if config.parallel.shard != "fsdp":
            return None
        if ranks.size == 1:
            self.log.write("parallel.shard fsdp at degree 1: nothing to shard; the line trains as none")
            return None
        if config.ema is not None:
            raise ConfigError(
                f"{where}: parallel.shard fsdp does not keep the moving average (ema) yet: validation would swap "
                "it into the weights while FSDP2 holds them gathered; remove ema or use parallel.shard none"
            )
        sharded = FullyShardedModel(self.model, ranks, self.device)
        self.log.write(f"parallel.shard fsdp: the model's {len(sharded.layers)} layers and its root sharded over "
                       f"{ranks.size} ranks (FSDP2); eager engine: FSDP2 cannot be captured in CUDA graphs")  # fmt: skip
        return sharded

    def _share_rank_zero_state(self) -> None:
        """Rank 0's weights, optimizer state and moving average on every rank (as DDP does at its
        start): the ranks built and resumed the same state, and now hold the same bits whatever
        their devices did. Sharded, each rank holds its own part of them: rank 0's whole weights
        went to every rank before they were cut (FullyShardedModel), and a resume's parts come
        from one checkpoint."""
        optimizer = self.optimizer
        if self.sharded is not None:
            self.ranks.broadcast_(optimizer.step)
            return
        tensors = [optimizer.params, optimizer.exp_avg, optimizer.exp_avg_sq, optimizer.step]
        if self.average is not None:
            tensors.append(self.average.average)
        self.ranks.broadcast_(*tensors)

    def _loop(self) -> str:
        """Update until a stop; its reason. At each update boundary: a stop asked, the disk, the
        cycle's readiness, the GPU and the host's CPUs; after each update: a stage's or a cycle's
        end, or a rolling checkpoint."""
        config = self.config
        if self.position.stage >= len(config.plan):
            return StopReason.PLAN_END
        last = self.data_line.last_cycle()
        (past_the_end,) = self.ranks.from_writer([int(last is not None and self.position.cycle > last)])
        if past_the_end:
            return StopReason.DATA_END
        while True:
            reason = self._stop_requested()
            if reason is not None:
                return reason
            self._check_disk()
            reason = self._wait_for_cycle(self.position.cycle)
            if reason is not None:
                return reason
            self._watch_gpu()
            self._share_cpu()
            seq_len = self._seq_len()
            cycle = self._cycle(self.position.cycle)
            rows = self._update_rows(cycle, seq_len)
            if rows > 0:
                try:
                    stage_done, cycle_done = self._one_update(cycle, seq_len, rows)
                except ShardChanged as error:
                    self._cycles.clear()  # reopened, and verified, once the preparer has rebuilt it
                    self.log.write(f"{error}: update {self.position.update + 1} not trained; waiting for the "
                                   "data preparer to rebuild the cycle from its manifest")
                    continue
                limit = config.optimizer.max_nonfinite_in_a_row
                if self.optimizer.nonfinite_in_a_row > limit:
                    self._checkpoint(wait=True)
                    message = (
                        f"{self.layout.run_json}: {self.optimizer.nonfinite_in_a_row} non-finite updates "
                        f"in a row (optimizer.max_nonfinite_in_a_row is {limit}); stopped with a checkpoint "
                        f"at update {self.position.update}"
                    )
                    self.heartbeat.beat(self.position.update, Stage.STOPPED, reason=StopReason.NON_FINITE)
                    self.log.write(message)
                    raise LineError(message)
            else:
                stage_done, cycle_done = self._stage_and_cycle_done(cycle, seq_len)
            if stage_done:
                reason = self._end_of_stage(cycle_done)
                if reason is not None:
                    return reason
            if cycle_done:
                reason = self._end_of_cycle()
                if reason is not None:
                    return reason
            elif rows > 0 and self._rolling_checkpoint_due() and self._last_checkpoint_update != self.position.update:
                # (A stage end wrote this update's checkpoint, kept: a rolling one would replace it.)
                self._checkpoint()

    def _share_cpu(self) -> None:
        """On a CPU: this process's threads, the host's cores shared among its CPU training lines."""
        if self.cpu_seat is not None and (change := self.cpu_seat.share()) is not None:
            self.log.write(change)

    def _close_mirror(self, faulted: bool) -> None:
        """Let W&B take what is queued, for a bounded time (W&B never holds the line up for long).

        A trainer stopping for a fault (a full disk, a line error, a crash) does not wait at all:
        W&B cannot write to a full disk either, and the fault's report and the supervisor's next
        move must not wait on it; the next start re-sends from rows.jsonl what W&B lacks. Nothing
        is written to run.log about it: on a full disk that write would fail and replace the fault.
        """
        if faulted:
            self.mirror.abandon()
        elif not self.mirror.close(WANDB_CLOSE_SECONDS):
            self.log.write(
                f"W&B took more than {WANDB_CLOSE_SECONDS:.0f} s to close; the next start re-sends what it lacks"
            )

    def run(self) -> int:
        """Train until a stop; returns the exit status (0, or 128 + a signal's number)."""
        previous = {}
        # Signals reach only the main thread (a trainer run in a thread is stopped by STOP instead).
        if threading.current_thread() is threading.main_thread():
            for number in (signal.SIGTERM, signal.SIGINT):
                previous[number] = signal.signal(number, self._on_signal)
        # Before anything is read: one trainer per line (a group's rank 0 holds it for the group).
        lock = hold_trainer_lock(self.layout) if self.ranks.writes else None
        try:
            self._start()
            faulted = True  # until the stop below completes: any exception out of it is a fault
            try:
                reason = self._loop()
                if self._last_checkpoint_update != self.position.update:
                    self._checkpoint(wait=True)
                self.writer.wait()
                if reason == StopReason.STOP_FILE and self.ranks.writes:
                    self.layout.stop.unlink(missing_ok=True)
                self.heartbeat.beat(self.position.update, Stage.STOPPED, reason=reason)
                self.log.write(f"stopped: {reason} ({self._where()})")
                # A group's ranks leave together, rank 0's checkpoint written: torchrun ends the
                # whole group at the first rank's exit with another status than the others'.
                self.ranks.barrier()
                faulted = False
            finally:
                try:
                    self.writer.wait()
                    if self.rows is not None:
                        self.rows.close()
                    # Leaving: give the GPU back for a process that lives on (a test, a notebook).
                    # A device already broken (the error in flight) must not replace that error.
                    with contextlib.suppress(ArenaNotReleased, RuntimeError):
                        self.engines.drop()
                finally:
                    self._close_mirror(faulted)  # on every exit: a stop, a signal, a line error, a failed write
                    self.log.close()
            return SIGNAL_EXIT_BASE + self._signal if self._signal is not None else TrainerExitCode.OK
        finally:
            if self.compile_caches is not None:
                self.compile_caches.release()
            if self.cpu_seat is not None:
                self.cpu_seat.release()
            self.ranks.close()
            if lock is not None:
                os.close(lock)
            for number, handler in previous.items():
                signal.signal(number, handler)
