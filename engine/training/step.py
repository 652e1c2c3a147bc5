"""Step engines: one optimizer update from the update's windows.

An update is `rows` windows of `seq_len + 1` tokens (inputs `w[:, :-1]`, targets `w[:, 1:]`),
computed in micro-batches of `micro_batch_rows`; its loss is the mean over the update's target
tokens, so each micro-batch's summed loss is scaled by `1 / target tokens of the whole update`
(a device scalar). Gradients accumulate into the optimizer's flat buffer; then the norms and the
clipped AdamW update run (skipped as a whole when the norm is not finite).

In a torch.distributed group (engine.training.distributed) an engine is given the whole update's
windows and trains on its rank's run of `slice_rows`-row micro-batches (`Ranks.rows_of`); the
loss scale still counts the whole update's targets, and after the last micro-batch the flat gradient and the loss sum are
summed across the ranks (`Ranks.sum_`), before the norms: every rank then takes the same update.
In the CUDA-graph engine that sum runs between the replays, uncaptured. With `parallel.shard:
fsdp` (engine.training.distributed.FullyShardedModel; eager only: FSDP2 cannot be captured) the
last micro-batch's backward reduce-scatters the summed gradient into each rank's shard of the
flat buffer, and only the loss sum is summed after it.

- `EagerEngine`: plain PyTorch on any device (the CPU reference; bit for bit deterministic there).
- `GraphEngine` (CUDA): three CUDA graphs per micro-batch shape -- micro-batch forward+backward
  accumulating into the flat gradient, the norms, the clipped update -- captured once from the
  arena's memory pool. Loss scale, learning rate and weight decay are device scalars, so a new
  batch size or rate replays the same graphs. A short last micro-batch (an update at a cycle's
  end) is padded with ignored targets, which add no loss and no gradient.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from engine.models.base import IGNORE_INDEX, LanguageModel
from engine.training.arena import Arena
from engine.training.distributed import FullyShardedModel, Ranks
from engine.training.optim import FlatAdamW, UpdateStats


@dataclass
class UpdateResult:
    """What one update produced (host values)."""

    loss: float
    """Mean cross-entropy over the update's target tokens."""
    target_tokens: int
    """Target tokens the loss averaged (ignored targets excluded)."""
    stats: UpdateStats
    """Gradient norms; `stats.finite` False means the update was skipped."""


def autocast_for(device: torch.device):
    """bf16 autocast on CUDA (tensor cores; fp32 master weights), none on the CPU (exact reference)."""
    if device.type == "cuda":
        # No cast cache: a CUDA graph must recast the weights on every replay (they change).
        return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False)
    return nullcontext()


def count_targets(windows: torch.Tensor) -> int:
    """Target tokens of an update's (rows, seq_len + 1) windows that carry a loss."""
    return int((windows[:, 1:] != IGNORE_INDEX).sum())


class EagerEngine:
    """The update in eager PyTorch (CPU or GPU)."""

    name = "eager"

    def __init__(
        self,
        model: LanguageModel,
        optimizer: FlatAdamW,
        micro_batch_rows: int,
        ranks: Ranks | None = None,
        slice_rows: int | None = None,
        sharded: FullyShardedModel | None = None,
    ):
        self.model = model
        self.optimizer = optimizer
        self.micro_batch_rows = micro_batch_rows
        self.ranks = ranks or Ranks.alone()
        self.slice_rows = slice_rows or micro_batch_rows
        """The micro-batch the update is dealt to the ranks in: the length's own, on every rank."""
        self.sharded = sharded
        """FSDP2's wrapper of the model (`parallel.shard: fsdp`): it sums the gradient itself."""
        self.device = optimizer.device
        self.loss_scale = torch.zeros((), dtype=torch.float32, device=self.device)
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)

    def run_update(self, windows: torch.Tensor, lr: float, weight_decay: float) -> UpdateResult:
        """The update's (rows, seq_len + 1) int64 windows -> one optimizer update."""
        target_tokens = count_targets(windows)
        self.loss_scale.fill_(1.0 / max(target_tokens, 1))
        self.loss_sum.zero_()
        self.optimizer.zero_grad()
        self.model.train()
        batches = self._micro_batches(self.ranks.rows_of(windows, self.slice_rows), windows.shape[1] - 1)
        for index, (tokens, targets) in enumerate(batches):
            if self.sharded is not None:  # the last micro-batch's backward reduce-scatters the sum
                self.sharded.sync_gradients(index == len(batches) - 1)
            with autocast_for(self.device):
                loss_per_token, _carry = self.model(tokens, targets)  # (B, T)
            scaled = loss_per_token.sum() * self.loss_scale
            scaled.backward()
            self.loss_sum += scaled.detach()
        if self.sharded is None:
            self.ranks.sum_(self.optimizer.grads, self.loss_sum)
        else:
            self.ranks.sum_(self.loss_sum)
        self.optimizer.set_hyperparameters(lr, weight_decay)
        self.optimizer.compute_norms()
        self.optimizer.apply_update()
        stats = self.optimizer.read_stats()
        return UpdateResult(loss=self.loss_sum.item(), target_tokens=target_tokens, stats=stats)

    def _micro_batches(self, mine: torch.Tensor, seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(tokens, targets) of this rank's micro-batches, on the device. Sharded, every rank runs
        as many as the rank with the most (FSDP2's collectives pair up across the ranks): the
        missing ones are full-size micro-batches of ignored targets, which add no loss and no
        gradient."""
        batches = []
        for chunk in mine.split(self.micro_batch_rows) if mine.shape[0] else ():
            chunk = chunk.to(self.device, non_blocking=True)
            batches.append((chunk[:, :-1], chunk[:, 1:]))
        if self.sharded is None:
            return batches
        (count,) = self.ranks.agree_max([len(batches)])
        shape = (self.micro_batch_rows, seq_len)
        idle = (torch.zeros(shape, dtype=torch.int64, device=self.device),
                torch.full(shape, IGNORE_INDEX, dtype=torch.int64, device=self.device))  # fmt: skip
        return batches + [idle] * (count - len(batches))

    def close(self) -> None:
        """Nothing held beyond the optimizer's buffers."""


class GraphEngine:
    """The update as three CUDA graphs replayed per micro-batch / update (see the module docstring)."""

    name = "graph"

    WARMUP_ITERATIONS = 3
    """Eager runs on the arena's stream before capture (lazy inits, autotuning, cuBLAS workspaces)."""

    def __init__(
        self,
        model: LanguageModel,
        optimizer: FlatAdamW,
        micro_batch_rows: int,
        seq_len: int,
        arena: Arena,
        ranks: Ranks | None = None,
        slice_rows: int | None = None,
    ):
        if optimizer.device.type != "cuda":
            raise ValueError("GraphEngine needs a CUDA device")
        self.model = model
        self.optimizer = optimizer
        self.micro_batch_rows = micro_batch_rows
        self.seq_len = seq_len
        self.arena = arena
        self.ranks = ranks or Ranks.alone()
        self.slice_rows = slice_rows or micro_batch_rows
        """The micro-batch the update is dealt to the ranks in: the length's own, on every rank."""
        self.device = optimizer.device
        with arena.allocating():
            self.static_tokens = torch.zeros(micro_batch_rows, seq_len, dtype=torch.int64, device=self.device)
            self.static_targets = torch.full_like(self.static_tokens, IGNORE_INDEX)
            self.loss_scale = torch.zeros((), dtype=torch.float32, device=self.device)
            self.loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        self.micro_graph = torch.cuda.CUDAGraph()
        self.norms_graph = torch.cuda.CUDAGraph()
        self.update_graph = torch.cuda.CUDAGraph()
        self._capture()

    def _micro_step(self) -> None:
        with autocast_for(self.device):
            loss_per_token, _carry = self.model(self.static_tokens, self.static_targets)  # (B, T)
        scaled = loss_per_token.sum() * self.loss_scale
        scaled.backward()
        self.loss_sum.add_(scaled.detach())

    def _capture(self) -> None:
        optimizer = self.optimizer
        self.model.train()
        # Warm-up and capture on the arena's stream: the blocks the warm-up frees are then the
        # ones the capture reuses (the allocator caches blocks per stream).
        side = self.arena.stream
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), self.arena.allocating():
            self.loss_scale.fill_(0.0)  # warm-up micro-batches add nothing to the loss sum
            for _ in range(self.WARMUP_ITERATIONS):
                self._micro_step()
            optimizer.compute_norms()
            # A NaN norm makes the warm-up update write nothing (weights, moments, step untouched).
            optimizer.grad_norm.fill_(float("nan"))
            optimizer.apply_update()
        torch.cuda.current_stream(self.device).wait_stream(side)
        optimizer.zero_grad()
        self.loss_sum.zero_()

        pool = self.arena.pool_handle()
        with torch.cuda.graph(self.micro_graph, pool=pool, stream=side):
            self._micro_step()
        with torch.cuda.graph(self.norms_graph, pool=pool, stream=side):
            optimizer.compute_norms()
        with torch.cuda.graph(self.update_graph, pool=pool, stream=side):
            optimizer.apply_update()
        # Capturing records work without running it: clear what the capture may have touched.
        optimizer.zero_grad()
        self.loss_sum.zero_()

    def run_update(self, windows: torch.Tensor, lr: float, weight_decay: float) -> UpdateResult:
        """The update's (rows, seq_len + 1) int64 windows -> one optimizer update by graph replays."""
        if windows.shape[1] != self.seq_len + 1:
            raise ValueError(f"GraphEngine captured seq_len {self.seq_len}, got {windows.shape[1] - 1}")
        target_tokens = count_targets(windows)
        self.loss_scale.fill_(1.0 / max(target_tokens, 1))
        self.loss_sum.zero_()
        self.optimizer.zero_grad()
        mine = self.ranks.rows_of(windows, self.slice_rows)
        with self.arena.allocating():
            device_windows = mine.to(self.device, non_blocking=True)  # (rows, T + 1)
        for chunk in device_windows.split(self.micro_batch_rows) if mine.shape[0] else ():
            rows = chunk.shape[0]
            self.static_tokens[:rows].copy_(chunk[:, :-1])
            self.static_targets[:rows].copy_(chunk[:, 1:])
            if rows < self.micro_batch_rows:  # padding rows: no loss, no gradient
                self.static_tokens[rows:].zero_()
                self.static_targets[rows:].fill_(IGNORE_INDEX)
            self.micro_graph.replay()
        self.ranks.sum_(self.optimizer.grads, self.loss_sum)
        self.optimizer.set_hyperparameters(lr, weight_decay)
        self.norms_graph.replay()
        self.update_graph.replay()
        stats = self.optimizer.read_stats()
        return UpdateResult(loss=self.loss_sum.item(), target_tokens=target_tokens, stats=stats)

    def close(self) -> None:
        """Drop the graphs so their pool memory can be released with the arena."""
        del self.micro_graph, self.norms_graph, self.update_graph
