"""FlatAdamW over each rank's shards of an FSDP2-sharded model (run.json `parallel.shard: fsdp`).

FSDP2 (engine.training.distributed.FullyShardedModel) keeps on each rank the dim-0 chunk of every
parameter: rows [r c, (r + 1) c) with c = ceil(rows / ranks), as one padded 1-D tensor per
parameter (FSDPParam's `_sharded_param_data`, c rows long, the missing rows of the last ranks
zeros), which its all-gather reads, and a DTensor parameter whose local tensor is that tensor's
first, unpadded rows. Those are plain tensors, and FSDP2 accepts them as views of another
buffer: so this optimizer is FlatAdamW itself, kernels and all, over a flat buffer of the local
padded chunks -- each parameter's segment is its c rows, the groups stay contiguous, and
FSDP2's sharded data and local tensors are re-pointed into it (`_bind`). The same buffers then
serve the fused norms, the clipped AdamW kernel, the non-finite skip and the moving average.
Reusing FlatAdamW rather than keeping one more optimizer: one AdamW, one set of kernels, one
checkpoint format. The price is two private attributes of torch 2.13's FSDP2 (`FSDPParam.
_sharded_param_data` and the DTensor's `_local_tensor`, which FSDP2's own `reset_sharded_param`
sets the same way); `_check_bound` raises if a torch release stops honouring them, before an
update could be lost. The padding rows hold zeros and stay zero (no gradient; AdamW of 0 is 0).

The gradient: each parameter's `.grad` is a DTensor over its segment of the flat gradient, and
FSDP2's reduce-scatter adds into an existing `.grad` in place, so the last micro-batch's
backward lands the update's summed gradient in the flat buffer (zeroed before the update).

Norms are global: the per-segment sums of squares of the local chunks are summed across the ranks
(one all_reduce of one float64 per parameter) before the layer, group and global norms, so every
rank clips by, and skips on, the same norm, and the rows log the whole model's norms.

Checkpoints keep the one whole-state format of every degree (engine.checkpoints.tensors): the
weights by name, the moments as flat buffers in the unsharded layout (`layout()` is
FlatAdamW's for the same model). `host_state` gathers every rank's buffers to rank 0's host a
bounded chunk at a time and reassembles them; `load` takes this rank's rows out of a whole
state. Gathered rather than torch.distributed.checkpoint's sharded files: a checkpoint is what a
user samples and evaluates from (self-contained, with its tokenizer), it resumes at any degree and
either `parallel.shard`, and the line keeps one format; the gather costs one whole copy of the
state on rank 0's host, which a `none` checkpoint takes too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.models.base import LanguageModel
from engine.training.distributed import Ranks
from engine.training.optim import AdamWSettings, FlatAdamW, GroupSlice, Segment, flat_layout
from kernels.grad_norms import segment_sq_sums

if TYPE_CHECKING:
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

GATHER_CHUNK_ELEMENTS = 1 << 24
"""Elements of each rank's buffer gathered at a time (64 MB of fp32 per rank on rank 0's device)."""


class ShardedFlatAdamW(FlatAdamW):
    """FlatAdamW over this rank's FSDP2 shards (see the module docstring)."""

    def __init__(self, model: LanguageModel, settings: AdamWSettings, device: torch.device, ranks: Ranks):
        self.ranks = ranks
        whole, whole_groups, parameters = flat_layout(model)
        self.whole_segments = whole
        """Every parameter's place in the unsharded layout: a checkpoint's."""
        self.whole_numel = whole_groups[-1].end if whole_groups else 0
        fsdp_groups = _fsdp_param_groups(model)
        placed = {id(shard.sharded_param): shard for group in fsdp_groups for shard in group.fsdp_params}
        missing = [
            segment.name for segment, parameter in zip(whole, parameters) if id(parameter) not in placed
        ]
        if missing:
            raise ValueError(f"parameters not sharded by fully_shard: {missing[:3]}")
        shards = [placed[id(parameter)] for parameter in parameters]
        segments, groups = self._local_layout(whole, whole_groups, shards)
        self._allocate(settings, device, segments, groups)
        self.first_rows = [min(ranks.rank * segment.shape[0], whole_segment.shape[0])
                           for segment, whole_segment in zip(segments, whole)]  # fmt: skip
        """Each parameter's first row held here (its dim-0 chunk's start, clamped to its rows)."""
        self.rows = [shard.sharded_size[0] for shard in shards]
        """Each parameter's rows held here (its chunk less the padding)."""
        for segment, whole_segment, first, rows in zip(segments, whole, self.first_rows, self.rows):
            if rows != max(0, min(segment.shape[0], whole_segment.shape[0] - first)):
                raise ValueError(f"{segment.name}: FSDP2 holds {rows} rows on rank {ranks.rank}, "
                                 f"not the dim-0 chunk from row {first}")  # fmt: skip
        # FSDP2 re-points its sharded data once, at its lazy init: let it do so now, so that it
        # finds ours in place at the first forward.
        for group in fsdp_groups:
            group.lazy_init()
        self._bind_shards(parameters, shards)
        self._checked_after_forward = False

    @staticmethod
    def _local_layout(
        whole: list[Segment], whole_groups: list[GroupSlice], shards: list[FSDPParam]
    ) -> tuple[list[Segment], list[GroupSlice]]:
        """The flat layout of the local padded chunks: each parameter's segment is its padded
        chunk's shape, group after group as in the whole layout."""
        segments: list[Segment] = []
        groups: list[GroupSlice] = []
        offset = 0
        for group in whole_groups:
            start = offset
            for segment, shard in zip(whole, shards):
                if segment.group == group.name:
                    shape = tuple(shard.padded_sharded_param_size)
                    segments.append(Segment(segment.name, segment.group, segment.layer, offset, shape))
                    offset += segments[-1].numel
            groups.append(GroupSlice(group.name, start, offset, group.weight_decay))
        return segments, groups

    def _bind_shards(self, parameters: list[nn.Parameter], shards: list[FSDPParam]) -> None:
        """FSDP2's sharded data and local tensors become views of the param buffer, each `.grad` a
        DTensor over the grad buffer (module docstring)."""
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            for segment, parameter, shard, rows in zip(self.segments, parameters, shards, self.rows):
                end = segment.offset + segment.numel
                padded = self.params[segment.offset : end]
                padded.copy_(shard._sharded_param_data)
                shard._sharded_param_data = padded
                parameter._local_tensor = padded.view(segment.shape).narrow(0, 0, rows)
                parameter.grad = DTensor.from_local(
                    self.grads[segment.offset : end].view(segment.shape).narrow(0, 0, rows),
                    parameter.device_mesh, parameter.placements, run_check=False,
                    shape=parameter.shape, stride=parameter.stride(),
                )  # fmt: skip
        self._parameters = parameters
        self._shards = shards
        self._check_bound()

    def _check_bound(self) -> None:
        """RuntimeError unless FSDP2 still reads and writes this optimizer's buffers."""

        def inside(tensor: torch.Tensor, buffer: torch.Tensor) -> bool:
            return tensor.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()

        for segment, parameter, shard in zip(self.segments, self._parameters, self._shards):
            local, grad = parameter.to_local(), parameter.grad
            if not (inside(shard._sharded_param_data, self.params) and inside(local, self.params)
                    and grad is not None and inside(grad.to_local(), self.grads)):  # fmt: skip
                raise RuntimeError(
                    f"{segment.name}: FSDP2's shard is no longer a view of the optimizer's flat buffers "
                    f"(torch {torch.__version__} changed FSDPParam's internals); parallel.shard fsdp "
                    "cannot train with it"
                )

    # -----------------------------------------------------------------------------------------
    # the update

    @torch.no_grad()
    def compute_norms(self) -> None:
        """FlatAdamW's norms, the segments' sums of squares summed across the ranks first."""
        self.segment_sq.copy_(segment_sq_sums(self.grads, self.offsets))
        self.ranks.sum_(self.segment_sq)
        self.layer_sq.copy_(self._layer_matrix @ self.segment_sq)
        self.group_sq.copy_(self._group_matrix @ self.segment_sq)
        self.grad_norm.copy_(self.segment_sq.sum().sqrt())

    def whole_sums(self, sums: torch.Tensor) -> torch.Tensor:
        """Per-segment sums of this rank's shards summed across the ranks (the padding rows are zeros)."""
        self.ranks.sum_(sums)
        return sums

    def group_numel(self, group: GroupSlice) -> int:
        """Elements of `group` in the unsharded model, not in this rank's padded shards."""
        return sum(segment.numel for segment in self.whole_segments if segment.group == group.name)

    @torch.no_grad()
    def apply_update(self) -> None:
        """FlatAdamW's update; the first one after a forward checks FSDP2 kept the buffers."""
        if not self._checked_after_forward:
            self._check_bound()
            self._checked_after_forward = True
        super().apply_update()

    # -----------------------------------------------------------------------------------------
    # checkpoints: the whole state

    def layout(self) -> list[list]:
        """The unsharded layout, FlatAdamW's for the same model: checkpoints do not know the degree."""
        return [[segment.name, segment.offset, list(segment.shape)] for segment in self.whole_segments]

    def weights_by_name(self, flat_params: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of a whole (unsharded) param buffer, as `host_state` returns it, one per name."""
        return {
            segment.name: flat_params[segment.offset : segment.offset + segment.numel].view(segment.shape)
            for segment in self.whole_segments
        }

    def host_state(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
        """The whole weights and optimizer state on rank 0's host (None on the others), gathered
        from every rank's shards: every rank calls it together."""
        self._check_bound()
        gathered = [self._gathered(buffer) for buffer in (self.params, self.exp_avg, self.exp_avg_sq)]
        if not self.ranks.writes:
            return None
        params, exp_avg, exp_avg_sq = (self._whole(pieces) for pieces in gathered if pieces is not None)
        return params, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "step": self.step.to("cpu", copy=True)}

    def _gathered(self, buffer: torch.Tensor) -> torch.Tensor | None:
        """(ranks, local elements): every rank's `buffer` on rank 0's host, None elsewhere."""
        host = torch.empty(self.ranks.size, self.numel, dtype=buffer.dtype) if self.ranks.writes else None
        for start in range(0, self.numel, GATHER_CHUNK_ELEMENTS):
            end = min(start + GATHER_CHUNK_ELEMENTS, self.numel)
            pieces = self.ranks.gather_to_writer(buffer[start:end])
            if host is not None and pieces is not None:
                host[:, start:end].copy_(torch.stack(pieces))
        return host

    def _whole(self, gathered: torch.Tensor) -> torch.Tensor:
        """A whole flat buffer in the unsharded layout from the ranks' gathered chunks."""
        whole = torch.empty(self.whole_numel, dtype=gathered.dtype)
        for segment, whole_segment in zip(self.segments, self.whole_segments):
            chunks = gathered[:, segment.offset : segment.offset + segment.numel]  # (ranks, chunk)
            rows = chunks.reshape(-1, *segment.shape[1:])[: whole_segment.shape[0]]
            whole[whole_segment.offset : whole_segment.offset + whole_segment.numel].copy_(rows.reshape(-1))
        return whole

    @torch.no_grad()
    def load(self, weights: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> None:
        """This rank's rows of a whole state (by name; moments in the unsharded layout)."""
        self.check_whole_weights(self.whole_segments, weights)
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in state or tuple(state[key].shape) != (self.whole_numel,):
                raise ValueError(f"optimizer state {key!r} missing or of the wrong shape")
        if "step" not in state or state["step"].shape != self.step.shape:
            raise ValueError("optimizer state 'step' missing or of the wrong shape")
        for segment, whole_segment, first, rows in zip(
            self.segments, self.whole_segments, self.first_rows, self.rows
        ):
            span = slice(whole_segment.offset, whole_segment.offset + whole_segment.numel)
            for buffer, source in ((self.params, weights[segment.name].reshape(-1)),
                                   (self.exp_avg, state["exp_avg"][span]),
                                   (self.exp_avg_sq, state["exp_avg_sq"][span])):  # fmt: skip
                mine = buffer[segment.offset : segment.offset + segment.numel].view(segment.shape)
                mine[:rows].copy_(source.view(whole_segment.shape)[first : first + rows])
        self.step.copy_(state["step"])


def _fsdp_param_groups(model: nn.Module) -> list[FSDPParamGroup]:
    """FSDP2's parameter groups of `model`'s sharded modules (each lists its parameters' FSDPParam)."""
    from torch.distributed.fsdp import FSDPModule

    return [
        group
        for module in model.modules()
        if isinstance(module, FSDPModule)
        for group in module._get_fsdp_state()._fsdp_param_groups
    ]
