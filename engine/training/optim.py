"""AdamW over flat fp32 buffers: one param buffer, one grad buffer and the two moments.

Every parameter group is a contiguous slice of each buffer, and every parameter is a segment of
its group's slice. The model's parameters become views into the param buffer and their `.grad`
views into the grad buffer, so backward accumulates straight into the flat gradient (no copy),
one `segment_sq_sums` pass gives every per-parameter, per-layer, per-group and global gradient
norm, and one `adamw_step` per group updates the weights. Learning rate, weight decay, the clip
norm input and the step count are 0-d device tensors: the update never waits on the host and a
captured CUDA graph replays with new values. The norms are float64 (squares summed in float64, so
a huge but finite gradient is clipped rather than taken for an overflow) and the step count is
int64 (exact at any length of training; an fp32 count stopped at 2^24 updates).

A gradient norm that is not finite skips the update: `adamw_step` writes nothing and
`advance_step_` does not count it. The host learns about it when it reads the norm for the row
(`UpdateStats.from_device`), and `nonfinite_in_a_row` counts the skips since the last good one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from engine.models.base import LanguageModel
from kernels.adamw import adamw_step, advance_step_
from kernels.grad_norms import segment_sq_sums


@dataclass(frozen=True)
class Segment:
    """One parameter's place in the flat buffers."""

    name: str
    """The parameter's qualified name."""
    group: str
    """The parameter group it belongs to."""
    layer: str
    """The gradient-norm bucket (`layer03`, `embed`, ...)."""
    offset: int
    """First element in the flat buffers."""
    shape: tuple[int, ...]
    """The parameter's shape."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class GroupSlice:
    """One parameter group's contiguous slice of the flat buffers."""

    name: str
    """`decay`, `no_decay`, ... as the model's `param_groups()` names it."""
    start: int
    """First element."""
    end: int
    """One past the last element."""
    weight_decay: bool
    """Whether decoupled weight decay applies."""


@dataclass(frozen=True)
class AdamWSettings:
    """The optimizer settings of a line (run.json `optimizer`)."""

    beta1: float
    """First-moment decay."""
    beta2: float
    """Second-moment decay."""
    eps: float
    """Added to the second-moment root."""
    clip: float
    """Global gradient-norm clip (<= 0: no clipping)."""


@dataclass
class UpdateStats:
    """What one update reports, read from the device once (one synchronisation per update)."""

    grad_norm: float
    """The global gradient norm before clipping (NaN or Inf: the update was skipped)."""
    group_norms: dict[str, float]
    """Gradient norm per parameter group."""
    layer_norms: dict[str, float]
    """Gradient norm per layer bucket."""

    @property
    def finite(self) -> bool:
        return math.isfinite(self.grad_norm)


def segment_layout(segments: list[Segment]) -> list[list]:
    """[name, offset, shape] of each segment, as a checkpoint's state.json records the flat layout."""
    return [[segment.name, segment.offset, list(segment.shape)] for segment in segments]


def flat_layout(model: LanguageModel) -> tuple[list[Segment], list[GroupSlice], list[nn.Parameter]]:
    """Every parameter's place in the flat buffers, group after group in `param_groups()` order,
    and the parameters in that order (each parameter's whole shape: a DTensor's is the global one)."""
    segments: list[Segment] = []
    groups: list[GroupSlice] = []
    parameters: list[nn.Parameter] = []
    offset = 0
    for group in model.param_groups():
        start = offset
        for name, parameter in group.params:
            segments.append(Segment(name, group.name, model.layer_of(name), offset, tuple(parameter.shape)))
            parameters.append(parameter)
            offset += parameter.numel()
        groups.append(GroupSlice(group.name, start, offset, group.weight_decay))
    if len({id(p) for p in parameters}) != len(parameters):
        raise ValueError("param_groups() lists a parameter twice")
    return segments, groups, parameters


class FlatAdamW:
    """Flat-buffer AdamW for one model (see the module docstring)."""

    def __init__(self, model: LanguageModel, settings: AdamWSettings, device: torch.device):
        segments, groups, parameters = flat_layout(model)
        self._allocate(settings, device, segments, groups)
        with torch.no_grad():
            for segment, parameter in zip(segments, parameters):
                self.params[segment.offset : segment.offset + segment.numel].copy_(parameter.reshape(-1))
        self._bind(parameters)

    def _allocate(
        self, settings: AdamWSettings, device: torch.device, segments: list[Segment], groups: list[GroupSlice]
    ) -> None:
        """The flat buffers, device scalars and norm bookkeeping of `segments` (the weights not yet copied)."""
        self.settings = settings
        self.device = device
        self.segments = segments
        self.groups = groups
        offset = segments[-1].offset + segments[-1].numel if segments else 0
        self.numel = offset

        self.params = torch.empty(offset, dtype=torch.float32, device=device)
        self.grads = torch.zeros(offset, dtype=torch.float32, device=device)
        self.exp_avg = torch.zeros(offset, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(offset, dtype=torch.float32, device=device)

        # Device scalars read by the kernels (and by a captured graph on replay).
        self.step = torch.zeros((), dtype=torch.int64, device=device)
        self.lr = torch.zeros((), dtype=torch.float32, device=device)
        self.weight_decay = {
            group.name: torch.zeros((), dtype=torch.float32, device=device) for group in groups
        }
        self.grad_norm = torch.zeros((), dtype=torch.float64, device=device)

        # Norm bookkeeping: segment sums of squares -> layers and groups by a 0/1 matrix product
        # (deterministic on every device, unlike an atomic scatter).
        boundaries = [segment.offset for segment in segments] + [offset]
        self.offsets = torch.tensor(boundaries, dtype=torch.int64, device=device)
        self.layer_names = sorted({segment.layer for segment in segments})
        self.group_names = [group.name for group in groups]
        self._layer_matrix = self._membership([segment.layer for segment in segments], self.layer_names)
        self._group_matrix = self._membership([segment.group for segment in segments], self.group_names)
        self.segment_sq = torch.zeros(len(segments), dtype=torch.float64, device=device)
        self.layer_sq = torch.zeros(len(self.layer_names), dtype=torch.float64, device=device)
        self.group_sq = torch.zeros(len(groups), dtype=torch.float64, device=device)

        self.nonfinite_in_a_row = 0
        """Updates skipped for a non-finite gradient norm since the last finite one (host count)."""

    def whole_sums(self, sums: torch.Tensor) -> torch.Tensor:
        """Per-segment sums over the whole model from this process's: every element is here, so
        they are already whole (`ShardedFlatAdamW` adds the other ranks' shards)."""
        return sums

    def group_numel(self, group: GroupSlice) -> int:
        """Elements of `group` in the whole model (here all of them are in this process)."""
        return group.end - group.start

    def _membership(self, keys: list[str], names: list[str]) -> torch.Tensor:
        """(len(names), segments) float64 0/1 matrix: row i selects the segments of names[i]."""
        matrix = torch.zeros(len(names), len(keys), dtype=torch.float64)
        for column, key in enumerate(keys):
            matrix[names.index(key), column] = 1.0
        return matrix.to(self.device)

    def _bind(self, parameters: list[nn.Parameter]) -> None:
        """Make each parameter a view of the param buffer and its .grad a view of the grad buffer."""
        for segment, parameter in zip(self.segments, parameters):
            end = segment.offset + segment.numel
            parameter.data = self.params[segment.offset : end].view(segment.shape)
            # With .grad already defined, autograd accumulates into it in place.
            parameter.grad = self.grads[segment.offset : end].view(segment.shape)

    # -----------------------------------------------------------------------------------------
    # the update

    def zero_grad(self) -> None:
        """Clear the flat gradient in place (the .grad views stay bound)."""
        self.grads.zero_()

    def set_hyperparameters(self, lr: float, weight_decay: float) -> None:
        """Write the update's rate and weight decay into the device scalars (no recapture needed)."""
        self.lr.fill_(lr)
        for group in self.groups:
            self.weight_decay[group.name].fill_(weight_decay if group.weight_decay else 0.0)

    @torch.no_grad()
    def compute_norms(self) -> None:
        """One pass over the flat gradient: per-segment squares -> layers, groups, global norm."""
        self.segment_sq.copy_(segment_sq_sums(self.grads, self.offsets))
        self.layer_sq.copy_(self._layer_matrix @ self.segment_sq)
        self.group_sq.copy_(self._group_matrix @ self.segment_sq)
        self.grad_norm.copy_(self.segment_sq.sum().sqrt())

    @torch.no_grad()
    def apply_update(self) -> None:
        """The clipped AdamW update of every group (skipped as a whole when the norm is not finite)."""
        settings = self.settings
        for group in self.groups:
            adamw_step(
                self.params[group.start : group.end],
                self.grads[group.start : group.end],
                self.exp_avg[group.start : group.end],
                self.exp_avg_sq[group.start : group.end],
                step=self.step,
                lr=self.lr,
                weight_decay=self.weight_decay[group.name],
                grad_norm=self.grad_norm,
                max_norm=settings.clip,
                beta1=settings.beta1,
                beta2=settings.beta2,
                eps=settings.eps,
            )
        advance_step_(self.step, self.grad_norm)

    def read_stats(self) -> UpdateStats:
        """Read the norms of the last update to the host and count a skip (one synchronisation)."""
        values = torch.cat([self.grad_norm.view(1), self.group_sq.sqrt(), self.layer_sq.sqrt()]).tolist()
        grad_norm = values[0]
        group_values = values[1 : 1 + len(self.groups)]
        layer_values = values[1 + len(self.groups) :]
        stats = UpdateStats(
            grad_norm=grad_norm,
            group_norms=dict(zip(self.group_names, group_values)),
            layer_norms=dict(zip(self.layer_names, layer_values)),
        )
        self.nonfinite_in_a_row = 0 if stats.finite else self.nonfinite_in_a_row + 1
        return stats

    # -----------------------------------------------------------------------------------------
    # checkpoints

    def layout(self) -> list[list]:
        """[name, offset, shape] of every segment: a checkpoint's flat state is only valid for it."""
        return segment_layout(self.segments)

    def weights_by_name(self, flat_params: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of a (host copy of the) param buffer, one per parameter name."""
        return {
            segment.name: flat_params[segment.offset : segment.offset + segment.numel].view(segment.shape)
            for segment in self.segments
        }

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Host copies of the optimizer state for a checkpoint."""
        return {
            "exp_avg": self.exp_avg.to("cpu", copy=True),
            "exp_avg_sq": self.exp_avg_sq.to("cpu", copy=True),
            "step": self.step.to("cpu", copy=True),
        }

    def host_state(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
        """Host copies of the flat weights (`weights_by_name` names them) and of the optimizer state
        (`state_tensors`): what a checkpoint holds. Never None here; a sharded optimizer's copy is
        rank 0's alone (engine.training.sharded_optim)."""
        return self.params.to("cpu", copy=True), self.state_tensors()

    @staticmethod
    def check_whole_weights(segments: list[Segment], weights: dict[str, torch.Tensor]) -> None:
        """ValueError unless `weights` names exactly the segments' parameters, in their shapes."""
        names = {segment.name for segment in segments}
        missing, unexpected = sorted(names - set(weights)), sorted(set(weights) - names)
        if missing or unexpected:
            raise ValueError(f"weights do not match the model: missing {missing[:3]}, extra {unexpected[:3]}")
        for segment in segments:
            shape = tuple(weights[segment.name].shape)
            if shape != segment.shape:
                raise ValueError(f"{segment.name}: shape {shape}, model {segment.shape}")

    @torch.no_grad()
    def load(self, weights: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> None:
        """Restore weights (by name) and optimizer state; shapes must match this model exactly."""
        self.check_whole_weights(self.segments, weights)
        for segment in self.segments:
            self.params[segment.offset : segment.offset + segment.numel].copy_(
                weights[segment.name].reshape(-1)
            )
        for key, buffer in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq), ("step", self.step)):
            if key not in state or state[key].shape != buffer.shape:
                raise ValueError(f"optimizer state {key!r} missing or of the wrong shape")
            # Checkpoints written before the int64 counter hold the step in fp32, always a whole
            # number (it could not pass 2^24): copy_ converts it exactly.
            buffer.copy_(state[key])


class ParameterAverage:
    """The parameters' moving average (run.json `ema`): one more flat buffer beside the weights.

    It starts as a copy of the parameters at `from_tokens` and then moves toward them by
    `update tokens / horizon_tokens` per finite update (a skipped update does not move it).
    """

    def __init__(self, optimizer: FlatAdamW, horizon_tokens: float, from_tokens: float):
        self.optimizer = optimizer
        self.horizon_tokens = horizon_tokens
        self.from_tokens = from_tokens
        self.average = torch.zeros_like(optimizer.params)
        self.started = False

    @torch.no_grad()
    def after_update(self, tokens_trained: int, update_tokens: int, finite: bool) -> None:
        """Move the average after an update that brought the line to `tokens_trained`."""
        if not finite or tokens_trained < self.from_tokens:
            return
        if not self.started:
            self.average.copy_(self.optimizer.params)
            self.started = True
            return
        self.average.lerp_(self.optimizer.params, min(1.0, update_tokens / self.horizon_tokens))
