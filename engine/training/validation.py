"""Validation at the training length: held-out losses, loss by document position, probes, EMA.

`Validator.run(seq_len, at_tokens, next_lr, next_weight_decay)` returns one flat dict of metrics
(see engine.metrics for the set), merged by the trainer into the row of the update it follows:

    val_<L>/<source>            mean cross-entropy over the source's held-out rows of length L
    val_<L>/mix                 the sources weighted by the held-out line's recipe at `at_tokens`
    val_<L>/mean                the plain mean over the sources
    val_<L>/docpos/bin<k>       the loss by the target's position in its document: bin 0 the first
                                token after an EOS, bin k the tokens 2^(k-1) .. 2^k - 1 after it
                                (recipe-weighted over the sources); targets of a document the row
                                cuts into (no EOS before them in the row) are left out
    val_<L>/docpos/tokens_frac  the share of targets counted (recipe-weighted)
    val_<L>/bpb/<source>, /bpb/mix   bits per UTF-8 byte of the targets' text, per source and for
                                the recipe's mix (engine.training.bits_per_byte)
    val_<L>/<probe>             the model's probes (`dendritic/...`, `hippocampal/...`, `pssa/...`)
    opt/...                     the optimizer's state (engine.training.optim_metrics)
    ema/val_<L>/<source>, /mix, /mean, /bpb/...   the same losses with the parameters' moving average
    val_<P>/..., ema/val_<P>/...        the long-row probe (engine.training.validation_long) when the model
                                        reads rows longer than L

`Validator.probe_rows(seq_len)` runs one row of each of those probes (the trainer runs them before
every CUDA graph capture and prints their readings), and a line whose held-out rows are missing
is refused at its start (`require_rows`).

Validation changes nothing training depends on: it runs under no_grad in eval mode, restores the
model's mode and every RNG state, reads only the held-out rows (never the data position), and the
moving average is swapped into the weights' buffer and the exact bits swapped back (the flat
buffers keep their addresses, so captured CUDA graphs stay valid).

In a torch.distributed group (engine.training.distributed) every rank runs `run` together: each
source's held-out rows are split across the ranks and their per-token losses gathered, so every
loss reading is computed from all the rows; the model's probes and the long-row probe run on rank
0 alone (the other ranks' readings lack them, and only rank 0's row is written).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from datalines import DataLine, open_data_line
from engine.config.run import RunConfig
from engine.errors import LineError
from engine.layout import LineLayout
from engine.models.base import LanguageModel
from engine.training.bits_per_byte import bits_per_byte_metrics, token_byte_lengths
from engine.training.distributed import Ranks
from engine.training.heldout_rows import heldout_line_path, missing_rows_problem, validation_lengths
from engine.training.optim import FlatAdamW, ParameterAverage
from engine.training.optim_metrics import optimizer_summary
from engine.training.validation_long import long_row_losses, long_row_metrics
from engine.training.validation_losses import (
    HeldOutRows,
    docpos_metrics,
    load_heldout_rows,
    loss_metrics,
    token_losses,
)

EMA_PREFIX = "ema/"


def long_seq_len(config: RunConfig, model: LanguageModel, train_len: int) -> int | None:
    """The long-row probe's length at training length `train_len`, None when there is none."""
    length = config.validation.long_seq_len or model.longest_context
    return length if length > train_len else None


@contextmanager
def untouched_training_state(model: LanguageModel, device: torch.device) -> Iterator[None]:
    """Eval mode and no_grad inside; the model's mode and every RNG stream restored on the way out."""
    was_training = model.training
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)


@contextmanager
def averaged_weights(optimizer: FlatAdamW, average: ParameterAverage) -> Iterator[None]:
    """The moving average in the weights' buffer inside; the weights' exact bits back afterwards.

    The weights wait on the host (the GPU's memory belongs to the arena) and are copied back into
    the same buffer, so every view and captured graph keeps pointing at valid weights.
    """
    saved = optimizer.params.to("cpu", copy=True)
    optimizer.params.copy_(average.average)
    try:
        yield
    finally:
        optimizer.params.copy_(saved)


def probe_batch(rows: dict[str, torch.Tensor], batch_rows: int) -> torch.Tensor:
    """Rows taken from the sources in turn (at least one of each), `batch_rows` in all."""
    sources = sorted(rows)
    picked: list[torch.Tensor] = []
    index = 0
    while len(picked) < max(batch_rows, len(sources)):
        added = False
        for source in sources:
            if index < rows[source].shape[0] and len(picked) < max(batch_rows, len(sources)):
                picked.append(rows[source][index])
                added = True
        if not added:
            break
        index += 1
    return torch.stack(picked)


class Validator:
    """Runs a line's validations (see the module docstring); one per trainer."""

    def __init__(
        self,
        model: LanguageModel,
        optimizer: FlatAdamW,
        average: ParameterAverage | None,
        config: RunConfig,
        heldout: DataLine,
        device: torch.device,
        ranks: Ranks | None = None,
    ):
        self.model = model
        self.optimizer = optimizer
        self.average = average
        self.config = config
        self.heldout = heldout
        self.device = device
        self.ranks = ranks or Ranks.alone()
        self._rows: dict[int, HeldOutRows] = {}
        self._byte_lengths: torch.Tensor | None = None

    @classmethod
    def for_line(
        cls,
        layout: LineLayout,
        config: RunConfig,
        model: LanguageModel,
        optimizer: FlatAdamW,
        average: ParameterAverage | None,
        device: torch.device,
        ranks: Ranks | None = None,
    ) -> Validator:
        """A validator reading the line's held-out data line."""
        heldout = open_data_line(heldout_line_path(layout, config))
        return cls(model, optimizer, average, config, heldout, device, ranks)

    def lengths(self) -> list[int]:
        """Every row length a validation of this line reads: the stages' and their long lengths."""
        return validation_lengths(self.config, self.model.longest_context)

    def require_rows(self) -> None:
        """Refuse a start (LineError) while held-out rows are missing: the first validation would
        stop the line after hours of training, so the start stops instead, naming the command."""
        problem = missing_rows_problem(self.heldout, self.lengths())
        if problem is not None:
            raise LineError(problem)

    def rows(self, length: int) -> HeldOutRows:
        """The held-out rows of a length, read (and checked against their index) once."""
        if length not in self._rows:
            self._rows[length] = load_heldout_rows(
                self.heldout, length, self.config.validation.rows_per_source
            )
        return self._rows[length]

    def byte_lengths(self) -> torch.Tensor:
        """The UTF-8 bytes of each token id of the held-out line's tokenizer, built once."""
        if self._byte_lengths is None:
            self._byte_lengths = token_byte_lengths(self.heldout.tokenizer)
        return self._byte_lengths

    def _micro_batch_rows(self, seq_len: int) -> int:
        for entry in self.config.lengths:
            if entry.seq_len == seq_len:
                return entry.micro_batch_rows
        return 1

    def run(
        self, seq_len: int, at_tokens: float, next_lr: float, next_weight_decay: float
    ) -> dict[str, float]:
        """Every validation metric at training length `seq_len` (see the module docstring)."""
        weights = self.heldout.validation_weights(at_tokens)
        rows = self.rows(seq_len)
        batch = self._micro_batch_rows(seq_len)
        long = long_seq_len(self.config, self.model, seq_len)
        metrics: dict[str, float] = {}
        with untouched_training_state(self.model, self.device):
            metrics.update(self._length_metrics(rows, batch, weights, probe_batch(rows.rows, batch), shard=True))
            if long is not None and self.ranks.writes:
                metrics.update(long_row_metrics(self.model, self.rows(long), seq_len, weights,
                                                self.heldout.eos_id, self.device))  # fmt: skip
            metrics.update(optimizer_summary(self.optimizer, next_lr, next_weight_decay))
            if self.average is not None and self.average.started:
                metrics.update(self._average_metrics(rows, batch, long, weights))
        return metrics

    def probe_rows(self, seq_len: int) -> dict[str, float]:
        """One row of each probe a validation at `seq_len` runs, through the same code and guard as
        `run`: the first held-out row of one source at the training length, and the first long row
        of one source when the long-row probe runs.

        The trainer runs them before every capture (the spec): their kernels and their memory
        are then known to work beside the captured graphs, not only at the first validation.
        """
        rows = self.rows(seq_len)
        source = sorted(rows.rows)[0]
        one_row = HeldOutRows(seq_len, {source: rows.rows[source][:1]})
        weights = {source: 1.0}
        long = long_seq_len(self.config, self.model, seq_len)
        metrics: dict[str, float] = {}
        with untouched_training_state(self.model, self.device):
            metrics.update(self._length_metrics(one_row, 1, weights, one_row.rows[source], shard=False))
            if long is not None:
                long_rows = self.rows(long)
                long_source = sorted(long_rows.rows)[0]
                one_long_row = HeldOutRows(long, {long_source: long_rows.rows[long_source][:1]})
                metrics.update(long_row_metrics(self.model, one_long_row, seq_len, {long_source: 1.0},
                                                self.heldout.eos_id, self.device))  # fmt: skip
        return metrics

    def _losses(self, windows: torch.Tensor, batch: int, shard: bool) -> torch.Tensor:
        """(R, T) float64 CPU token losses of a source's rows; with `shard`, each rank computes its
        slice of them and every rank gets them all (a group's ranks call this together)."""
        if not shard:
            return token_losses(self.model, windows, batch, self.device)
        mine = self.ranks.rows_of(windows, batch)
        if mine.shape[0] == 0:  # fewer rows than ranks
            losses = torch.zeros(0, windows.shape[1] - 1, dtype=torch.float64)
        else:
            losses = token_losses(self.model, mine, batch, self.device)
        return self.ranks.gather_rows(losses)

    def _length_metrics(
        self, rows: HeldOutRows, batch: int, weights: dict[str, float], probe_rows: torch.Tensor, shard: bool
    ) -> dict[str, float]:
        """The training length's losses (per source, mix, by document position) and the model's
        probes on `probe_rows` (rank 0's alone when `shard`); the caller holds the training state
        untouched."""
        prefix = f"val_{rows.seq_len}"
        losses = {source: self._losses(windows, batch, shard) for source, windows in rows.rows.items()}
        metrics = loss_metrics(prefix, losses, weights)
        metrics.update(bits_per_byte_metrics(prefix, rows.rows, losses, weights, self.byte_lengths()))
        metrics.update(docpos_metrics(prefix, rows.rows, losses, weights, self.heldout.eos_id))
        if shard and not self.ranks.writes:
            return metrics
        probe_rows = probe_rows.to(self.device)
        probes = self.model.probes(probe_rows[:, :-1], probe_rows[:, 1:], self.heldout.eos_id)
        metrics.update({f"{prefix}/{name}": float(value) for name, value in probes.items()})
        return metrics

    def _average_metrics(
        self, rows: HeldOutRows, batch: int, long: int | None, weights: dict[str, float]
    ) -> dict[str, float]:
        assert self.average is not None
        metrics: dict[str, float] = {}
        with averaged_weights(self.optimizer, self.average):
            losses = {source: self._losses(windows, batch, shard=True) for source, windows in rows.rows.items()}
            prefix = f"{EMA_PREFIX}val_{rows.seq_len}"
            metrics.update(loss_metrics(prefix, losses, weights))
            metrics.update(bits_per_byte_metrics(prefix, rows.rows, losses, weights, self.byte_lengths()))
            if long is not None and self.ranks.writes:
                first_long_rows = {source: windows[:1] for source, windows in self.rows(long).rows.items()}
                long_losses = long_row_losses(self.model, first_long_rows, self.device)
                metrics.update(loss_metrics(f"{EMA_PREFIX}val_{long}", long_losses, weights))
        return metrics


def format_probe_rows(seq_len: int, metrics: dict[str, float]) -> str:
    """The run.log line of the rows probed before a capture: each row's loss, then how many probe
    readings they gave and which of them, if any, are not finite."""
    losses = sorted(key for key in metrics if key.count("/") == 1 and not key.endswith(("/mix", "/mean")))
    readings = "  ".join(f"{key} {metrics[key]:.4f}" for key in losses)
    others = [key for key in metrics if key not in losses]
    bad = sorted(key for key in others if not math.isfinite(metrics[key]))
    health = f"not finite: {', '.join(bad)}" if bad else "all finite"
    return f"probe rows before capture at seq_len {seq_len}: {readings}  ({len(others)} readings, {health})"


def format_validation(update: int, metrics: dict[str, float]) -> str:
    """The run.log line of a validation: every `/mix` and `/mean` loss (training length, long rows, EMA)."""
    keys = sorted(key for key in metrics if key.endswith(("/mix", "/mean")))
    readings = "  ".join(f"{key} {metrics[key]:.4f}" for key in keys)
    return f"validation at update {update}: {readings}"
