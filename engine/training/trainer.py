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
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

import torch

from datalines import open_data_line
from datalines.consumption import claim_cycle, claim_data_line
from datalines.cycle import Cycle
from datalines.errors import ShardChanged
from engine.checkpoints.disk_budget import (
    CheckpointSize,
    gib_text,
    next_checkpoint_size,
    refuse_a_start_without_room,
)
from engine.checkpoints.format import (
    CHECKPOINT_DISK_MARGIN,
    LINE_START_KEPT,
    cycle_end_kept,
    discard_partial_writes,
    stage_end_kept,
)
from engine.checkpoints.tensors import Checkpoint, CheckpointSnapshot, CheckpointWriter, find_resume_point
from engine.config.run import RunConfig, WandbConfig
from engine.errors import CheckpointError, ConfigError, DiskFull, LineError, is_out_of_memory
from engine.gpu.placement import placed_device
from engine.gpu.sharing import Action, GpuBusy, GpuMode, GpuReading, GpuWatch, refuse_unshareable_lengths
from engine.layout import LineLayout
from engine.metrics import METRICS_VERSION, metrics_mismatch
from engine.models.build import build_model, refuse_unfit_memory
from engine.ops import lines as ops
from engine.ops.rollback import rows_remedy
from engine.ops.stop import read_stop
from engine.protocol.facts import SIGNAL_EXIT_BASE, Engine, Stage, StopReason, TrainerExitCode
from engine.rows import Heartbeat, RowsFile, RunLog, format_row
from engine.supervisor.child import rank_file
from engine.training.cpu_heap import keep_freed_memory
from engine.training.cpu_share import CpuSeat
from engine.training.distributed import FullyShardedModel, Ranks, refuse_written_state
from engine.training.dreaming import Dreamer, format_dream
from engine.training.engines import ArenaNotReleased, StepEngines
from engine.training.line_lock import hold_trainer_lock
from engine.training.optim import AdamWSettings, FlatAdamW, ParameterAverage
from engine.training.phase_beat import PhaseBeats
from engine.training.position import Position
from engine.training.samples import ValidationSampler
from engine.training.schedule import learning_rate, tokens_per_update, update_weight_decay
from engine.training.sharded_optim import ShardedFlatAdamW
from engine.training.startup import CompileCaches, StartupClock, TimedPhases, append_startup_record
from engine.training.step import EagerEngine, UpdateResult
from engine.training.validation import Validator, format_probe_rows, format_validation
from engine.units import GIB
from engine.wandb.mirror import WandbMirror

WAIT_POLL_SECONDS = 1.0

# Stop codes agreed across a group's ranks (the largest wins): a signal's is this base + its number.
STOP_AT_CODE, STOP_FILE_CODE, SIGNAL_STOP_CODE = 1, 2, 1000
# Rank 0's reading of the data line, shared with the group (`_cycle_state`, `_end_of_cycle`, where
# DATA_ENDED meets STOP_FILE_CODE: the codes differ).
CYCLE_READY, DATA_ENDED = 1, 3
"""How often a trainer waiting for the next data cycle looks again (and at STOP)."""

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


class Trainer:
    """One line's training loop (see the module docstring)."""

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
        self._digests: dict[tuple[int, int], str] = {}
        self._last_checkpoint_update: int | None = None
        self._make_gpu_watch = gpu_watch
        self.cpu_seat: CpuSeat | None = None
        """This process's seat among the host's CPU trainers (engine.training.cpu_share), when it owns
        its process on a CPU."""
        self.ranks = Ranks.from_environment()
        """This process's rank in a torchrun group (engine.training.distributed), or alone."""

    # -----------------------------------------------------------------------------------------
    # start

    def _start(self) -> None:
        layout = self.layout
        self.config = config = RunConfig.load(layout.run_json)
        if config.metrics != METRICS_VERSION:
            raise ConfigError(metrics_mismatch(str(layout.run_json), config.metrics))
        refuse_unshareable_lengths(config, str(layout.run_json))
        problems = ops.unaccepted_changes(layout, config)  # lifelong keys changed without allow_changes
        if problems:
            raise ConfigError("; ".join(problems))
        self.run_json_bytes = layout.run_json.read_bytes()
        ranks = self.ranks
        self.device = ranks.connect(config.parallel, resolve_device(config.device), str(layout.run_json))
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
        self.beats = TimedPhases(PhaseBeats(self.heartbeat, between=Stage.TRAINING), self.startup)
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
        self.mirror = WandbMirror(layout.root, wandb_settings, run_config=config.to_dict(), report=self.log.write)
        if resume.checkpoint is None:
            self._checkpoint(kept=LINE_START_KEPT, wait=True)
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

    def _restore(self, checkpoint: Checkpoint) -> None:
        state = checkpoint.state
        where = checkpoint.directory
        if state.get("layout") != self.optimizer.layout():
            raise CheckpointError(f"{where}: its parameter layout differs from the model run.json builds")
        model_extra = {k[len("model/") :]: v for k, v in checkpoint.extra.items() if k.startswith("model/")}
        try:
            self.optimizer.load(checkpoint.weights, checkpoint.optimizer)
            # The model's own state (PSSA's banks) can differ where the layout does not.
            self.model.load_extra_state_dict({k: v.to(self.device) for k, v in model_extra.items()})
        except ValueError as error:
            raise CheckpointError(f"{where}: {error}") from None
        torch.set_rng_state(checkpoint.extra["rng/cpu"])
        if self.device.type == "cuda" and "rng/cuda" in checkpoint.extra:
            torch.cuda.set_rng_state(checkpoint.extra["rng/cuda"], self.device)
        self.optimizer.nonfinite_in_a_row = int(state["nonfinite_in_a_row"])
        if self.average is not None:
            self.average.started = bool(state.get("ema_started", False))
            if "ema" in checkpoint.optimizer:
                self.average.average.copy_(checkpoint.optimizer["ema"])
        self.position = Position(**state["position"])
        self._check_data_position(state["data"], where)
        self._last_checkpoint_update = checkpoint.update

    def _check_data_position(self, data: dict[str, Any], where: Path) -> None:
        """Refuse a resume whose cycle manifest or sample order differs from the checkpoint's."""
        position = self.position
        if (position.sample == 0 and not position.earlier) or data.get("manifest_sha256") is None:
            if position.cycle > 0 and not self.data_line.is_consumed(position.cycle - 1):
                # The cycle-end checkpoint was durable but the consumed mark was not written.
                self.data_line.mark_consumed(position.cycle - 1, by=self.layout.root)
            return
        # The manifest only: damaged shards are the preparer's to rebuild while the loop waits for them.
        cycle = self.data_line.cycle(position.cycle, verify=False)
        if cycle.manifest_sha256 != data["manifest_sha256"]:
            raise CheckpointError(
                f"{where}: cycle {position.cycle}'s manifest sha256 is {cycle.manifest_sha256[:16]}..., "
                f"the checkpoint trained on {data['manifest_sha256'][:16]}... (the data line changed)"
            )
        digest = cycle.order_digest(data["seq_len"], self.config.seeds.data, position.reads())
        if digest != data["order_digest"]:
            raise CheckpointError(
                f"{where}: cycle {position.cycle}'s sample order digest differs from the checkpoint's "
                f"(seeds.data or the data line changed); resuming would train other samples"
            )

    # -----------------------------------------------------------------------------------------
    # data

    def _cycle(self, index: int) -> Cycle:
        if index not in self._cycles:
            with self.startup.segment("data cycle"):  # the first one's shards are hashed in the start-up
                self._cycles = {index: self.data_line.cycle(index)}  # one open cycle at a time
        return self._cycles[index]

    def _order_digest(self, cycle: int, seq_len: int) -> str:
        reads = self.position.reads()
        key = (cycle, seq_len, reads)
        if key not in self._digests:
            self._digests[key] = self._cycle(cycle).order_digest(seq_len, self.config.seeds.data, reads)
        return self._digests[key]

    def _seq_len(self) -> int:
        return self.config.plan[self.position.stage].seq_len

    def _where(self) -> str:
        p = self.position
        stage = self.config.plan[p.stage].name if p.stage < len(self.config.plan) else "done"
        tokens = f"{p.tokens_trained:,} tokens"
        return f"update {p.update}, {tokens}, stage {stage}, cycle {p.cycle}, sample {p.sample}"

    # -----------------------------------------------------------------------------------------
    # checkpoints

    def _snapshot(self, kept: str | None, host_state: tuple[torch.Tensor, dict[str, torch.Tensor]]) -> CheckpointSnapshot:
        """The checkpoint of the line as it stands; `host_state`: the optimizer's whole weights and state
        on the host (`FlatAdamW.host_state`)."""
        assert self.rows is not None, "rank 0 alone snapshots the line"
        optimizer = self.optimizer
        position = self.position
        params, optimizer_state = host_state
        if self.average is not None:
            optimizer_state["ema"] = self.average.average.to("cpu", copy=True)
        extra = {
            f"model/{key}": value.detach().to("cpu", copy=True)
            for key, value in self.model.extra_state_dict().items()
        }
        extra["rng/cpu"] = torch.get_rng_state()
        if self.device.type == "cuda":
            extra["rng/cuda"] = torch.cuda.get_rng_state(self.device)
        data: dict[str, Any] = {"manifest_sha256": None, "order_digest": None, "seq_len": None}
        if (position.sample > 0 or position.earlier) and position.stage < len(self.config.plan):
            seq_len = self._seq_len()
            data = {
                "manifest_sha256": self._cycle(position.cycle).manifest_sha256,
                "order_digest": self._order_digest(position.cycle, seq_len),
                "seq_len": seq_len,
            }
        state = {
            "position": asdict(position),
            "data": data,
            "kept": kept,
            "nonfinite_in_a_row": optimizer.nonfinite_in_a_row,
            "ema_started": self.average.started if self.average is not None else False,
            "rows": self.rows.rows,
            "rows_bytes": self.rows.bytes,
            "layout": optimizer.layout(),
            "degree": self.ranks.size,
            "preset": self.config.model.preset,
            "overrides": self.config.model.overrides,
            "wandb": self.mirror.checkpoint_record(),
        }
        return CheckpointSnapshot(
            update=position.update,
            weights=optimizer.weights_by_name(params),
            optimizer=optimizer_state,
            extra=extra,
            state=state,
            run_json=self.run_json_bytes,
            tokenizer_json=self.data_line.tokenizer_json.encode("utf-8"),
        )

    def _checkpoint(self, kept: str | None = None, wait: bool = False) -> None:
        self.writer.wait()  # the write before this one has taken its space
        free, size = shutil.disk_usage(self.layout.checkpoints).free, self._checkpoint_bytes()
        (short,) = self.ranks.from_writer([int(free < CHECKPOINT_DISK_MARGIN * size)])  # every rank stops, or none
        if short:
            # Whatever the guard's threshold, a write that cannot fit would fail half-way.
            last = self._last_checkpoint_update
            newest = f"the newest is update {last}" if last is not None else "none written yet"
            # The start refusal's words (disk_budget): the size to its precision, and the margin.
            self._stop_for_disk(free, f"too little for the next checkpoint (about {gib_text(size)}; "
                                f"{CHECKPOINT_DISK_MARGIN:g}x needed); {newest}")
        # Rank 0 writes the checkpoint: every rank holds the same state, or, sharded, every rank
        # takes part in gathering it to rank 0.
        if self.rows is not None or self.sharded is not None:
            with self.beats.phase(Stage.CHECKPOINTING, self.position.update):
                host_state = self.optimizer.host_state()
                if self.rows is not None and host_state is not None:
                    self.writer.save(self._snapshot(kept, host_state), before_latest=self.rows.sync)
                    if wait:
                        self.writer.wait()
        self._last_checkpoint_update = self.position.update

    # -----------------------------------------------------------------------------------------
    # the loop

    def _out_of_memory(self, doing: str, error: BaseException) -> None:
        """If `error` is the GPU running out of memory before an update (a capture, its probe rows)
        or inside one (a forward or backward: the weights, the moments and the position are as they
        were): beside other processes -- seen now, or at the last check -- checkpoint and leave
        (`GpuBusy`; the supervisor relaunches once they fit or the GPU is free). Otherwise, or
        alone, it returns and the caller raises: alone, the shapes do not fit this GPU, and that is
        the line's error."""
        if not is_out_of_memory(error):
            return
        reading = self.gpu_watch.reader() if self.gpu_watch.enabled else self.gpu_watch.last_reading
        others = max(reading.others, self.gpu_watch.last_reading.others)
        if others == 0 and self.engines.gpu_mode == GpuMode.OWN:
            return
        first_line = (str(error).splitlines() or [type(error).__name__])[0][:160]
        self._leave_gpu(f"out of memory {doing} beside {reading.others} other process(es) "
                        f"holding {reading.others_bytes / GIB:.2f} GiB ({first_line})")  # fmt: skip

    def _probe_rows_before_capture(self, seq_len: int) -> None:
        """One row of each validation probe at `seq_len` (engine.training.validation), printed to run.log.

        Run before every capture (the spec): a probe that fails, or does not fit beside the
        arena, stops the line now rather than at its first validation, hours in.
        """
        with self.beats.phase(Stage.PROBING, self.position.update, seq_len=seq_len), self.engines.from_the_arena():
            readings = self.validator.probe_rows(seq_len)
        self.log.write(format_probe_rows(seq_len, readings))

    def _watch_gpu(self) -> None:
        """At a check (engine.gpu.sharing): share, take the GPU back, or checkpoint and leave."""
        update = self.position.update
        if not self.gpu_watch.due(update):
            return
        action, reading = self.gpu_watch.check(update)
        others = f"{reading.others} other process(es) holding {reading.others_bytes / GIB:.2f} GiB"
        # A group leaves together: one rank's GPU taken past the reserve checkpoints the whole line.
        (leave,) = self.ranks.agree_max([int(action == Action.LEAVE)])
        if leave and action != Action.LEAVE:
            self._leave_gpu("another rank's GPU is taken by other processes")
        if action == Action.SHARE:
            self._switch_shapes(GpuMode.SHARED, f"{others} on the GPU")
        elif action == Action.OWN:
            self._switch_shapes(GpuMode.OWN, "the other processes have left the GPU")
        elif action == Action.LEAVE:
            reserve_gb = self.config.guards.share_reserve_gb
            limit = ("guards.share_reserve_gb is not set" if reserve_gb is None
                     else f"more than guards.share_reserve_gb = {reserve_gb:g}")  # fmt: skip
            self._leave_gpu(f"{others} on the GPU, {limit}")
        elif self.engines.gpu_mode == GpuMode.SHARED:
            self._hold_past_the_reserve(reading)

    def _share_cpu(self) -> None:
        """On a CPU: this process's threads, the host's cores shared among its CPU training lines."""
        if self.cpu_seat is not None and (change := self.cpu_seat.share()) is not None:
            self.log.write(change)

    def _hold_past_the_reserve(self, reading: GpuReading) -> None:
        """Sharing, at a check: the memory free past what the others may still take (the reserve
        less what they use) is held again, so that they cannot grow past their reserve. The free
        memory is read between two readings of theirs; if they differ, they were allocating or
        freeing, and the next check decides."""
        if self.engines.arena is None:
            return  # nothing captured yet (or eager): the next capture's arena is sized then
        free = self.engines.free_bytes()
        if self.gpu_watch.reader() != reading:
            return
        room = self.gpu_watch.room_for_others()
        held = self.engines.hold_past(room, free)
        if held:
            self.log.write(f"gpu: held {held / GIB:.2f} GiB more, leaving {room / GIB:.2f} GiB free: the reserve "
                           f"less the {reading.others_bytes / GIB:.2f} GiB the other processes hold")  # fmt: skip

    def _switch_shapes(self, mode: str, why: str) -> None:
        """Drop the step engines (and the arena) and train on with the lengths' `mode` shapes.

        Where the arena's memory does not come back (something of this process still holds a
        block of its pool), the new shapes could not get theirs, and others could not take theirs:
        the trainer checkpoints and leaves instead, and the supervisor relaunches it beside them.
        """
        try:
            self.engines.switch(mode)
        except ArenaNotReleased as error:
            self._leave_gpu(f"{error} for the switch to the {mode} shapes ({why})")
        shapes = "shared" if mode == GpuMode.SHARED else "own"
        self.log.write(f"gpu: {why}; training with the lengths' {shapes} shapes from update {self.position.update}")

    def _leave_gpu(self, why: str) -> None:
        """Checkpoint and stop: the supervisor relaunches the line once the GPU is free (or they fit).

        The engines and the arena go as soon as the snapshot is on the host, before the write ends:
        the others get that memory now, not after tens of seconds of a large line's write."""
        if self._last_checkpoint_update != self.position.update:
            self._checkpoint()
        with contextlib.suppress(ArenaNotReleased):
            self.engines.drop()
        self.writer.wait()
        message = (
            f"{self.layout.run_json}: {why}; checkpointed update "
            f"{self.position.update} and stopped until the GPU is free"
        )
        self.heartbeat.beat(self.position.update, Stage.STOPPED, reason=StopReason.GPU_BUSY)
        self.log.write(message)
        raise GpuBusy(message)

    def _stop_requested(self) -> str | None:
        """A stop at this update boundary: a signal, --stop-at, STOP (now, or a cycle end passed).

        In a group every rank stops at the same boundary: any rank's signal stops them all (and
        each then exits as if it had received it), the STOP file is rank 0's to read."""
        code = 0
        if self._signal is not None:
            code = SIGNAL_STOP_CODE + self._signal
        elif self.stop_at is not None and self.position.update >= self.stop_at:
            code = STOP_AT_CODE
        elif self.ranks.writes:
            request = read_stop(self.layout)
            # A cycle end already behind the line (or the one it stands at) stops it now.
            if request is not None and (request.at_cycle_end is None or request.at_cycle_end < self.position.cycle):
                code = STOP_FILE_CODE
        (code,) = self.ranks.agree_max([code])
        if code >= SIGNAL_STOP_CODE:
            self._signal = code - SIGNAL_STOP_CODE
            return f"signal {signal.Signals(self._signal).name}"
        return {STOP_AT_CODE: StopReason.STOP_AT, STOP_FILE_CODE: StopReason.STOP_FILE}.get(code)

    def _cycle_state(self, index: int) -> int:
        """Rank 0's reading of cycle `index`, shared with every rank: CYCLE_READY, DATA_ENDED
        (past the data line's last cycle) or 0 (not prepared yet)."""
        state = 0
        if self.ranks.writes:
            last = self.data_line.last_cycle()
            if self.data_line.cycle_ready(index):
                state = CYCLE_READY
            elif last is not None and index > last:
                state = DATA_ENDED
        return self.ranks.from_writer([state])[0]

    def _check_shards(self, cycle: Cycle) -> None:
        """`ShardChanged` when a shard of `cycle` is no longer the manifest's (rewritten in place
        while open): rank 0 checks for the group, which reads one line directory's files."""
        problem = ""
        if self.ranks.writes:
            try:
                cycle.verify_unchanged()
            except ShardChanged as error:
                problem = str(error)
        if self.ranks.from_writer([int(bool(problem))])[0]:
            raise ShardChanged(problem or f"{cycle.directory}: a shard changed under rank 0")

    def _wait_for_cycle(self, index: int) -> str | None:
        """Block until cycle `index` is ready; returns a stop reason if one arrives meanwhile."""
        announced = False
        while (state := self._cycle_state(index)) != CYCLE_READY:
            if state == DATA_ENDED:
                return StopReason.DATA_END
            if not announced:
                # A cycle another line consumed meanwhile never comes back: refuse it, don't wait.
                claim_cycle(self.data_line, index, self.layout.root, writes=False)
                problem = self.data_line.cycle_problem(index) if self.ranks.writes else None
                self.log.write(f"waiting for data cycle {index}" + (f" ({problem})" if problem else ""))
                announced = True
            self.heartbeat.beat(self.position.update, Stage.WAITING_DATA, cycle=index)
            reason = self._stop_requested()
            if reason is not None:
                return reason
            time.sleep(WAIT_POLL_SECONDS)
        return None

    def _update_rows(self, cycle: Cycle, seq_len: int) -> int:
        """Rows of the next update: the ramp's batch, cut at the cycle's and the stage's end."""
        position = self.position
        data_tokens = position.data_tokens(self.data_line, seq_len)
        wanted = max(1, tokens_per_update(self.config, data_tokens) // seq_len)
        left_in_cycle = cycle.num_samples(seq_len, self.config.seeds.data, position.reads()) - position.sample
        stage_budget = self.config.plan[position.stage].tokens
        if stage_budget is not None:
            left_in_stage = math.ceil((stage_budget - position.stage_tokens) / seq_len)
            return max(0, min(wanted, left_in_cycle, left_in_stage))
        return max(0, min(wanted, left_in_cycle))

    def _one_update(self, cycle: Cycle, seq_len: int, rows: int) -> tuple[bool, bool]:
        """Train one update of `rows` rows; whether it ended the stage and the cycle (`_stage_and_cycle_done`)."""
        config = self.config
        position = self.position
        started = time.perf_counter()
        windows = torch.from_numpy(cycle.samples(seq_len, position.sample, rows, config.seeds.data, position.reads()))
        self._check_shards(cycle)  # before anything of the update happens: a ShardChanged leaves no trace
        update_tokens = rows * seq_len
        lr = learning_rate(config, position.tokens_trained)
        weight_decay = update_weight_decay(config, update_tokens)
        if hasattr(self.model, "recompute"):  # the length's activation recomputation (nsconsole tune)
            self.model.recompute = self.engines.shape(seq_len)[1]
        self.model.on_update(position.update)
        first_update = not self.engines.made(seq_len)
        try:
            engine = self.engines.for_length(seq_len)
        except RuntimeError as error:
            self._out_of_memory(f"capturing seq_len {seq_len}", error)
            raise
        # A length's first eager update on CUDA builds its compiled kernels (minutes at 1-2B).
        compiling = first_update and self.device.type == "cuda" and engine.name == EagerEngine.name
        try:
            with self.beats.phase(Stage.COMPILING, position.update, seq_len=seq_len) if compiling else contextlib.nullcontext():
                result = engine.run_update(windows, lr, weight_decay)
        except RuntimeError as error:
            self._out_of_memory(f"in update {self.position.update + 1}", error)
            raise
        elapsed = time.perf_counter() - started

        position.update += 1
        position.sample += rows
        position.stage_tokens += update_tokens
        if result.stats.finite:
            position.tokens_trained += update_tokens
        if self.average is not None:
            self.average.after_update(position.tokens_trained, update_tokens, result.stats.finite)
        row = self._row(result, seq_len, update_tokens, lr, weight_decay, elapsed)
        dreamt: dict[str, float] = {}
        if self.dreamer is not None and self.dreamer.due(position.update):
            with self.beats.phase(Stage.DREAMING, position.update), self.engines.from_the_arena():
                dreamt = self.dreamer.run(windows, position.update)
            row.update(dreamt)
        stage_done, cycle_done = self._stage_and_cycle_done(cycle, seq_len)
        validating = position.update % config.validation.every_updates == 0 or self._ends_the_line(stage_done, cycle_done)
        if validating:
            with self.beats.phase(Stage.VALIDATING, position.update):
                row.update(self._validate(seq_len))
        if self.rows is not None:  # rank 0's record (every rank computed the same row)
            self.rows.append(row)
            self.mirror.log(row)  # after rows.jsonl has it: W&B mirrors the line's record, never leads it
            # The row of an update that validated is printed whatever print_every.
            if validating or position.update % max(1, config.print_every) == 0 or not result.stats.finite:
                self.log.write(format_row(row))
            if dreamt:
                self.log.write(format_dream(position.update, dreamt))
            if validating:
                self.log.write(format_validation(position.update, row))
        self.heartbeat.beat(position.update, Stage.TRAINING)
        if not self.startup.done:
            self._end_of_startup()
        return stage_done, cycle_done

    def _stage_and_cycle_done(self, cycle: Cycle, seq_len: int) -> tuple[bool, bool]:
        """Whether the updates so far end the current stage (its tokens trained) and the current
        cycle (its windows at `seq_len` all read)."""
        position = self.position
        stage = self.config.plan[position.stage]
        stage_done = stage.tokens is not None and position.stage_tokens >= stage.tokens
        cycle_done = position.sample >= cycle.num_samples(seq_len, self.config.seeds.data, position.reads())
        return stage_done, cycle_done

    def _ends_the_line(self, stage_done: bool, cycle_done: bool) -> bool:
        """The update just done is the line's last: it ends the plan's last stage or the data line's
        last cycle. That update validates whatever `validation.every_updates` says, so a finished
        line's result is on record (in its row, status and the console), not only its last multiple."""
        position = self.position
        if stage_done and position.stage + 1 >= len(self.config.plan):
            return True
        if not cycle_done:
            return False
        # The cycle ends (every rank knows it alike); rank 0 reads whether the data line ends with it.
        last = self.data_line.last_cycle() if self.ranks.writes else None
        (ends,) = self.ranks.from_writer([int(last is not None and position.cycle >= last)])
        return bool(ends)

    def _end_of_startup(self) -> None:
        """The first update of this launch is done: where the start-up's seconds went, to run.log and
        (rank 0) startup.jsonl (engine.training.startup)."""
        breakdown = self.startup.finish()
        caches = self.compile_caches
        assert caches is not None, "the start opened the compile caches"
        size = caches.size()
        update = self.position.update
        self.log.write(breakdown.line(update, caches.directory, size))
        if self.ranks.writes:
            record = breakdown.record(update, str(self.device), caches.directory, size)
            append_startup_record(self.layout.startup_jsonl, record)

    def _validate(self, seq_len: int) -> dict[str, Any]:
        """The validation metrics after the update just done (engine.training.validation), then its
        samples (engine.training.samples); the next update's rate and weight decay size the optimizer's
        next step, the data position the recipe mix."""
        position = self.position
        data_tokens = position.data_tokens(self.data_line, seq_len)
        next_lr = learning_rate(self.config, position.tokens_trained)
        next_weight_decay = update_weight_decay(self.config, tokens_per_update(self.config, data_tokens))
        whole = self.sharded.whole_weights() if self.sharded is not None else contextlib.nullcontext()
        with self.engines.from_the_arena(), whole:  # sharded: rank 0's probes and samples run alone
            readings: dict[str, Any] = self.validator.run(seq_len, data_tokens, next_lr, next_weight_decay)
            if self.ranks.writes:  # texts of rank 0's row
                readings.update(self.sampler.run(seq_len, position.update))
            return readings

    def _row(
        self,
        result: UpdateResult,
        seq_len: int,
        update_tokens: int,
        lr: float,
        weight_decay: float,
        elapsed: float,
    ) -> dict[str, Any]:
        position = self.position
        stats = result.stats
        row: dict[str, Any] = {
            "update": position.update,
            "tokens": position.tokens_trained,
            "data_tokens": position.data_tokens(self.data_line, seq_len),
            "cycle": position.cycle,
            "stage": self.config.plan[position.stage].name,
            "seq_len": seq_len,
            "loss": result.loss,
            "lr": lr,
            "weight_decay": weight_decay,
            "tokens_per_update": update_tokens,
            "grad_norm": stats.grad_norm,
            "skipped": not stats.finite,
            "tokens_per_s": update_tokens / max(elapsed, 1e-9),
            "gpu_mode": self.engines.gpu_mode,
            "time": time.time(),
        }
        row.update({f"train/grad_norm/{name}": value for name, value in stats.group_norms.items()})
        row.update({f"train/grad_norm/{name}": value for name, value in stats.layer_norms.items()})
        return row

    def _end_of_cycle(self) -> str | None:
        """The update just done ended its cycle: kept checkpoint, consumed mark, next cycle."""
        position = self.position
        finished = position.cycle
        self.model.on_cycle_end(finished)
        position.next_cycle()
        self._checkpoint(kept=cycle_end_kept(finished), wait=True)
        self.log.write(f"cycle {finished} done at update {position.update}")
        reason = 0  # rank 0 marks the cycle and reads STOP and the data line; the group follows it
        if self.ranks.writes:
            self.data_line.mark_consumed(finished, by=self.layout.root)
            request = read_stop(self.layout)
            last = self.data_line.last_cycle()
            if request is not None and request.at_cycle_end is not None and request.at_cycle_end <= finished:
                reason = STOP_FILE_CODE
            elif last is not None and finished >= last:
                reason = DATA_ENDED
        (reason,) = self.ranks.from_writer([reason])
        return {STOP_FILE_CODE: StopReason.STOP_FILE, DATA_ENDED: StopReason.DATA_END}.get(reason)

    def _end_of_stage(self, cycle_done: bool) -> str | None:
        """The update just done ended its stage: kept checkpoint, next stage's length (and, inside a
        cycle the update did not end, the relay of the cycle's rest at that length)."""
        position = self.position
        finished = self.config.plan[position.stage]
        position.stage += 1
        position.stage_tokens = 0
        # The next length reads the targets the cycle has left, laid out anew (datalines.relay).
        relaid = position.stage < len(self.config.plan) and position.change_length(finished.seq_len, self._seq_len())
        self._checkpoint(kept=stage_end_kept(finished.name), wait=True)
        self.log.write(f"stage {finished.name} done at update {position.update}")
        if relaid and not cycle_done:  # (a read to the cycle's end leaves an empty relay, not worth a line)
            self.log.write(self._relay_report())
        return StopReason.PLAN_END if position.stage >= len(self.config.plan) else None

    def _relay_report(self) -> str:
        """run.log's line on the rest of a cycle re-laid at a new length: what it trains, what it cannot."""
        position, seq_len, seed = self.position, self._seq_len(), self.config.seeds.data
        cycle = self._cycle(position.cycle)
        windows = cycle.num_samples(seq_len, seed, position.reads())
        unread = cycle.unread_targets(seq_len, seed, position.reads())
        return (f"cycle {position.cycle}: its untrained targets re-laid at seq_len {seq_len}, {windows} windows; "
                f"{unread} targets left out (a stream tail shorter than a window per source, share rounding)")

    def _loop(self) -> str:
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

    def _check_disk(self) -> None:
        """Below `guards.min_free_disk_gb`: checkpoint while there is room, then stop for the operator.

        A statvfs per update costs microseconds. The checkpoint is written only when the free space
        holds the newest checkpoint's size with a margin, so a full disk never leaves a half-written
        one behind (and `latest` only ever names a complete one in any case).
        """
        free = shutil.disk_usage(self.layout.checkpoints).free
        minimum = self.config.guards.min_free_disk_bytes
        # Rank 0's disk decides for the group (the same disk: one line directory).
        low = free < minimum
        room = low and free > CHECKPOINT_DISK_MARGIN * self._checkpoint_bytes()
        low, room = self.ranks.from_writer([int(low), int(room)])
        if not low:
            return
        update = self.position.update
        if self._last_checkpoint_update == update:
            saved = f"update {update} is checkpointed"
        elif room:
            self._checkpoint(wait=True)
            saved = f"checkpointed update {update}"
        else:
            saved = f"no room for another checkpoint: the newest is update {self._last_checkpoint_update}"
        self._stop_for_disk(free, f"below guards.min_free_disk_gb = {self.config.guards.min_free_disk_gb:g}; {saved}")

    def _stop_for_disk(self, free: int, why: str) -> None:
        """Stop for the operator (DiskFull: the supervisor does not relaunch); what is saved stays."""
        update = self.position.update
        message = (
            f"{self.layout.root}: {gib_text(free)} free on its disk, {why}; "
            "free some space and run the line again"
        )
        self.heartbeat.beat(update, Stage.STOPPED, reason=StopReason.DISK_FULL)
        self.log.write(message)
        raise DiskFull(message)

    def _checkpoint_bytes(self) -> int:
        return self._checkpoint_size().bytes

    def _checkpoint_size(self) -> CheckpointSize:
        tokenizer_bytes = len(self.data_line.tokenizer_json.encode("utf-8"))
        return next_checkpoint_size(self.layout.checkpoints, self.config, self.model.num_parameters(), tokenizer_bytes)

    def _rolling_checkpoint_due(self) -> bool:
        every = self.config.checkpoints.every_updates
        return every > 0 and self.position.update % every == 0

    def _on_signal(self, number: int, _frame: Any) -> None:
        self._signal = number

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
