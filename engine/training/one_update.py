"""One update of the training loop: its rows trained, its row recorded, its validation.

A mixin of `engine.training.trainer.Trainer`, sharing its state: it uses the run's config, the
layout, the device, the model, the step engines, the moving average, the dreamer, the validator and
its sampler, the data line, rows.jsonl, the W&B mirror, the log, the heartbeat, the phase beats, the
start-up clock and its compile caches, and the ranks. It advances the position by the update (its
update count, samples and tokens; a cycle's and a stage's end are `DataCycles`'s, which also checks
the update's shards and says whether it ended them), and hands the GPU's running out of memory to
`GpuGuard`. The validation probes' rows before each capture (the engines' `before_capture`) and the
start-up's breakdown after this launch's first update are here too.

The update's row goes to rows.jsonl, then to the W&B mirror (it never leads the line's record),
then to run.log (every `print_every`, and whenever it validated or was skipped). Every rank computes
the same row; rank 0 records it.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from datalines.cycle import Cycle
from engine.protocol.facts import Stage
from engine.rows import format_row
from engine.training.dreaming import format_dream
from engine.training.schedule import learning_rate, tokens_per_update, update_weight_decay
from engine.training.startup import append_startup_record
from engine.training.step import EagerEngine, UpdateResult
from engine.training.validation import format_probe_rows, format_validation


class OneUpdate:
    """The trainer's update and its record (mixed into `Trainer`, whose model, engines and rows it uses)."""

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
        # The cycle it trains: a stop at the end of a cycle already behind it is refused (engine.ops.stop).
        self.heartbeat.beat(position.update, Stage.TRAINING, cycle=self._beaten_cycle())
        if not self.startup.done:
            self._end_of_startup()
        return stage_done, cycle_done

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

    def _probe_rows_before_capture(self, seq_len: int) -> None:
        """One row of each validation probe at `seq_len` (engine.training.validation), printed to run.log.

        Run before every capture (the spec): a probe that fails, or does not fit beside the
        arena, stops the line now rather than at its first validation, hours in.
        """
        with self.beats.phase(Stage.PROBING, self.position.update, seq_len=seq_len), self.engines.from_the_arena():
            readings = self.validator.probe_rows(seq_len)
        self.log.write(format_probe_rows(seq_len, readings))

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
