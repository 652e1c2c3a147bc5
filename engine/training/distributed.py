"""One line over several processes: a rank's view of its torch.distributed group.

At `parallel.degree` N > 1 the supervisor starts the trainer through torchrun (`python -m
torch.distributed.run --standalone --nproc-per-node N`); each of the N processes is a rank and
runs the whole trainer loop. Data parallel, `parallel.shard: none`:

- Every rank builds the same model from `seeds.model` and resumes from the same checkpoint; rank
  0's weights and optimizer state are broadcast once at the start all the same (as DDP does), so
  the ranks start from one state whatever their devices did.
- An update's windows are read whole by every rank (token ids: a few MB at most) and dealt in
  the length's micro-batches, as degree 1 cuts them: rank r trains on the r-th of N contiguous
  runs of micro-batches (`rows_of`). Each micro-batch's gradient is then the degree-1 one bit for
  bit, and the loss scale is one over the target tokens of the *whole* update, so the sum over
  the ranks is the degree-1 gradient but for the order in which the micro-batches' float32
  gradients are added (at degree 2 with two micro-batches, not even that: a + b == b + a). The
  unit is the length's own `micro_batch_rows`, the same on every rank whatever its GPU mode (a
  rank sharing its GPU cuts its run into its smaller shared micro-batches). A rank may get no
  micro-batch (an update shorter than the degree's): it adds nothing and joins the sum.
- The gradient: after the update's last micro-batch the optimizer's flat gradient buffer and
  the loss sum are summed across ranks (`sum_`, one all_reduce each) and every rank takes the
  same norms, clip and AdamW step on identical buffers, so the ranks' weights stay bit-identical.
  Not DDP's module wrapper, which would (1) copy the gradient into its own buckets and back,
  doubling gradient memory, unless `gradient_as_bucket_view`, which rebinds each `.grad` to its
  buckets and so breaks the flat buffer the optimizer's norms and kernel read; (2) average where
  the update needs a token-weighted sum; (3) refuse a model whose step leaves a parameter unused
  unless it searches the graph for them every step; (4) need its reducer's hooks warmed up on a
  side stream before a CUDA-graph capture. The flat buffer is already the one contiguous bucket
  DDP would build; what is given up is overlapping the sum with the backward.
- Decisions that must be the same on every rank are taken once and shared: a stop (any rank's
  signal, rank 0's STOP file: `agree_max`), whether the next data cycle is ready, the disk's free
  space and the end of the data line (rank 0 reads them: `from_writer`).
- Rank 0 alone writes the line's records: rows.jsonl, heartbeat, checkpoints (the same format at
  every degree: every rank holds the whole state, so no gather is needed), W&B, run.log; rank r
  writes its log lines and heartbeat to `<line>/ranks/` (engine.supervisor.child.rank_file).
- Validation: each source's held-out rows are split like an update's and the per-token losses
  gathered to every rank (`gather_rows`), so the readings are computed once from all rows; the
  model's probes, the long-row probe and the samples are rank 0's alone (readings of a handful of
  rows: percentiles, texts, which do not add up across ranks).

`parallel.shard: fsdp` (`FullyShardedModel`) keeps the update, the dealing of micro-batches, the
shared decisions and rank 0's records, but each rank holds a chunk of the state instead of all of
it: FSDP2 gathers the weights layer by layer and reduce-scatters the gradient into each rank's
chunk of the flat buffer (engine.training.sharded_optim, whose norms are summed across ranks);
checkpoints are gathered to rank 0 in the same whole-state format; validation runs with the
layers gathered on every rank (`whole_weights`).

Without torchrun (`Ranks.alone()`) every collective is skipped: the plain path is untouched.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from engine.config.run import ParallelConfig
from engine.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

    from engine.models.base import LanguageModel


def rank_batches(batches: int, size: int, rank: int) -> tuple[int, int]:
    """(first, count): rank `rank`'s contiguous run of an update's `batches` micro-batches dealt to
    `size` ranks, the first `batches % size` ranks one more. The one rule for the dealing: the
    trainer's `Ranks.rows_of` and `tune`'s busiest-rank timing both follow it."""
    share, extra = divmod(batches, size)
    return rank * share + min(rank, extra), share + (rank < extra)


@dataclass
class Ranks:
    """This process's rank in its group (see the module docstring); `alone()` outside torchrun."""

    rank: int
    """This process's rank (0 writes the line's records)."""
    size: int
    """Processes in the group (run.json `parallel.degree`)."""
    local_rank: int
    """The rank on this host: the offset of its GPU from the line's."""
    launched: bool
    """Started by torchrun: collectives run through the process group (even at size 1)."""
    device: torch.device | None = None
    """The device collectives run on (the rank's GPU for NCCL, the CPU for gloo); set by `connect`."""

    @classmethod
    def alone(cls) -> Ranks:
        """A trainer run by itself: rank 0 of 1, no process group."""
        return cls(rank=0, size=1, local_rank=0, launched=False)

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> Ranks:
        """The rank torchrun gave this process (RANK, WORLD_SIZE, LOCAL_RANK), else `alone()`."""
        if "WORLD_SIZE" not in environ:
            return cls.alone()
        return cls(
            rank=int(environ["RANK"]), size=int(environ["WORLD_SIZE"]),
            local_rank=int(environ.get("LOCAL_RANK", environ["RANK"])), launched=True,
        )  # fmt: skip

    @property
    def writes(self) -> bool:
        """Whether this rank writes the line's records (rank 0)."""
        return self.rank == 0

    def connect(self, parallel: ParallelConfig, device: torch.device, source: str) -> torch.device:
        """Check the group against run.json's `parallel`, join it; this rank's training device.

        On CUDA rank r trains on the line's GPU index + r (NCCL); on the CPU the group is gloo.
        """
        if not self.launched:
            if parallel.degree > 1:
                raise ConfigError(
                    f"{source}: parallel.degree is {parallel.degree}, but this trainer runs alone; "
                    "start the line with `nsconsole run`, whose supervisor launches the group through torchrun"
                )
            return device
        if parallel.degree != self.size:
            raise ConfigError(
                f"{source}: parallel.degree is {parallel.degree}, but torchrun started {self.size} processes"
            )
        if device.type == "cuda":
            device = torch.device("cuda", (device.index or 0) + self.local_rank)
            if device.index >= torch.cuda.device_count():
                raise ConfigError(
                    f"{source}: parallel.degree {self.size} puts rank {self.rank} on {device}, but this "
                    f"process sees {torch.cuda.device_count()} GPU(s)"
                )
            torch.cuda.set_device(device)
            backend = "nccl"
        else:
            backend = "gloo"
        self.device = device
        if not dist.is_initialized():
            dist.init_process_group(
                backend, timeout=timedelta(minutes=parallel.timeout_minutes),
                device_id=device if device.type == "cuda" else None,
            )  # fmt: skip
        return device

    def close(self) -> None:
        """Leave the group (at the trainer's exit)."""
        if self.launched and dist.is_initialized():
            dist.destroy_process_group()

    # -- the update's rows ---------------------------------------------------------------------

    def rows_of(self, windows: torch.Tensor, unit_rows: int) -> torch.Tensor:
        """This rank's rows of an update's (or a source's held-out) rows: its contiguous run of the
        `unit_rows`-row micro-batches they make (the first `batches % size` ranks one more)."""
        if self.size == 1:
            return windows
        first, count = rank_batches(-(-windows.shape[0] // unit_rows), self.size, self.rank)
        return windows[first * unit_rows : (first + count) * unit_rows]

    # -- collectives (none without torchrun) ---------------------------------------------------

    def sum_(self, *tensors: torch.Tensor) -> None:
        """Sum each tensor across the ranks, in place (every rank gets the same bits)."""
        if self.launched:
            for tensor in tensors:
                dist.all_reduce(tensor, op=dist.ReduceOp.SUM)

    def broadcast_(self, *tensors: torch.Tensor) -> None:
        """Rank 0's values into every rank's tensors, in place."""
        if self.launched:
            for tensor in tensors:
                dist.broadcast(tensor, src=0)

    def agree_max(self, values: list[int]) -> list[int]:
        """The largest of every rank's value, position by position (a stop any rank asks for)."""
        if not self.launched:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return [int(value) for value in tensor.tolist()]

    def from_writer(self, values: list[int]) -> list[int]:
        """Rank 0's values on every rank (what rank 0 alone reads: a file, the disk)."""
        if not self.launched:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.broadcast(tensor, src=0)
        return [int(value) for value in tensor.tolist()]

    def gather_to_writer(self, mine: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `mine` (the same shape on every rank) on rank 0, in rank order; None on the
        others. Alone: [mine]."""
        if not self.launched:
            return [mine]
        pieces = [torch.empty_like(mine) for _ in range(self.size)] if self.writes else None
        dist.gather(mine, pieces, dst=0)
        return pieces

    def gather_rows(self, mine: torch.Tensor) -> torch.Tensor:
        """Every rank's CPU rows (`rows_of` slices, in rank order) concatenated, on every rank."""
        if not self.launched:
            return mine
        pieces: list[torch.Tensor | None] = [None] * self.size
        dist.all_gather_object(pieces, mine)
        return torch.cat([piece for piece in pieces if piece is not None])

    def barrier(self) -> None:
        """Wait for every rank (the exit: none leaves while rank 0 still writes)."""
        if self.launched:
            dist.barrier()


def refuse_written_state(model: LanguageModel, degree: int, preset: str, source: str) -> None:
    """ConfigError above degree 1 for a model whose training forward writes state beside its weights
    (PSSA's memory banks): each rank would write its own rows' and no rule merges them yet."""
    if degree > 1 and model.extra_state_dict():
        raise ConfigError(
            f"{source}: parallel.degree {degree}: {preset} keeps state beside its weights that its training "
            "forward writes (memory banks); each rank would write its own rows' and no rule merges them yet, "
            "so it trains at degree 1 only"
        )


class FullyShardedModel:
    """A model's layers and root wrapped by FSDP2 `fully_shard` (run.json `parallel.shard: fsdp`).

    Each rank keeps the dim-0 chunk of every parameter (its gradient and AdamW moments alike:
    engine.training.sharded_optim); a layer's weights are all-gathered for its forward and again
    for its backward, and its gradient is reduce-scattered back to the chunks. The layers are the
    modules of the root's `nn.ModuleList`s (the transformer's and NS's `layers`); the embedding,
    the head and the final norm stay with the root (a tied embedding is one parameter there).

    - No mixed-precision policy: the weights are gathered in fp32 and the forward runs under the
      same bf16 autocast as at degree 1 (`step.autocast_for`), so the update is degree 1's.
    - The reduction is a plain SUM (divide factor 1, sum-only collectives), not FSDP's mean: the
      loss scale already counts the whole update's targets (engine.training.step).
    - Gradients are reduced once per update: every micro-batch but the last accumulates the whole
      gradient locally (`sync_gradients(False)`), the last one reduce-scatters the sum. That holds a
      whole fp32 gradient per rank through an update of several micro-batches, and sends it once.
    - Every rank runs the same number of micro-batches (the collectives pair up across ranks).
    - `whole_weights()`: every layer gathered and kept for forwards a rank runs alone (validation's
      probes and samples on rank 0, a rank's share of the held-out rows).

    Rank 0's initial weights go to every rank before the weights are cut (as `none` broadcasts them
    after the optimizer is built): the ranks then start from one state whatever their devices did.
    """

    def __init__(self, model: nn.Module, ranks: Ranks, device: torch.device) -> None:
        # Imported here: FSDP2 and DTensor take over a second to import, and only this mode needs them.
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # The step sums the model's loss out of place; FSDP2 warns once per process that an in-place
        # op on the root's output (a view) would skip its backward hook, which nothing here does.
        warnings.filterwarnings(
            "ignore", message=r"FSDP2-wrapped module .* returned a view tensor", category=UserWarning
        )
        ranks.broadcast_(*(parameter.detach() for parameter in model.parameters()))
        mesh = init_device_mesh(device.type, (ranks.size,))
        layers = [layer for child in model.children() if isinstance(child, nn.ModuleList) for layer in child]
        self.layers: list[FSDPModule] = [
            fully_shard(layer, mesh=mesh, reshard_after_forward=True) for layer in layers
        ]
        self.root: FSDPModule = fully_shard(model, mesh=mesh, reshard_after_forward=False)
        for module in (self.root, *self.layers):  # (both settings are per module, not recursive)
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)

    def sync_gradients(self, sync: bool) -> None:
        """Whether the next backward reduce-scatters the gradient (the update's last micro-batch)
        or accumulates it whole on this rank."""
        self.root.set_requires_gradient_sync(sync)

    @contextmanager
    def whole_weights(self) -> Iterator[None]:
        """Every layer's whole weights on every rank inside (one all-gather each, every rank
        together), kept through any number of forwards a rank runs alone; sharded again after.
        The weights must not change inside: the gathered copies would not see it."""
        for module in (self.root, *self.layers):
            module.unshard()
        self._keep_after_forward(True)
        try:
            yield
        finally:
            self._keep_after_forward(False)
            self.root.reset_iter_state()  # reshards every layer; forgets the forwards' bookkeeping

    def _keep_after_forward(self, keep: bool) -> None:
        for layer in self.layers:
            layer.set_reshard_after_forward(not keep, recurse=False)
