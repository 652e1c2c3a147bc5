"""The optimizer's state summarised at a validation: per parameter group and per layer.

    opt/<group>/param_norm    ||p|| over the group
    opt/<group>/m_norm        ||m||, the first moment
    opt/<group>/grad_rms      sqrt(mean(v / (1 - beta2^t))): the gradient's root mean square as AdamW's
                              second moment has seen it (the state, not the last micro-batch)
    opt/<group>/update_norm   ||u||, u = the step AdamW takes next (below)
    opt/<group>/update_ratio  update_norm / param_norm
    opt/<layer>/param_norm, update_norm, update_ratio   the same per gradient-norm bucket
                              (`layer00`, ..., and the other parts of the model by name)

The next step is read from the moments as they stand, without touching anything:
`u = lr (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps) + lr wd p`, at the next update's
rate and weight decay (the gradient it will add is not known yet). Before the first update the
moments are zero and only the weight-decay part remains.

The elementwise work runs in fp32 over bounded chunks of each parameter segment (no buffer of
the model's size is allocated beside the arena); the sums accumulate in float64 and are read to
the host in one transfer.
"""

from __future__ import annotations

import math

import torch

from engine.training.optim import FlatAdamW
from kernels.adamw import bias_correction

_PARAM_SQ, _M_SQ, _V_HAT_SUM, _UPDATE_SQ = range(4)


CHUNK_ELEMENTS = 1 << 24
"""Elements read at a time (64 MB of fp32 per temporary): a 2B model's embedding is never copied whole."""


@torch.no_grad()
def optimizer_summary(optimizer: FlatAdamW, next_lr: float, next_weight_decay: float) -> dict[str, float]:
    """The `opt/...` metrics (see the module docstring); nothing in the optimizer changes."""
    settings = optimizer.settings
    step = optimizer.step.detach()  # 0-d int64: finite updates applied so far
    started = bool(step.item() > 0)
    correction1 = bias_correction(settings.beta1, step) if started else None
    correction2 = bias_correction(settings.beta2, step) if started else None
    decays = {group.name: group.weight_decay for group in optimizer.groups}
    per_segment: list[torch.Tensor] = []
    for segment in optimizer.segments:
        weight_decay = next_weight_decay if decays[segment.group] else 0.0
        sums = torch.zeros(4, dtype=torch.float64, device=optimizer.device)
        for start in range(segment.offset, segment.offset + segment.numel, CHUNK_ELEMENTS):
            span = slice(start, min(start + CHUNK_ELEMENTS, segment.offset + segment.numel))
            param = optimizer.params[span]  # (n,) fp32 views: elementwise work in fp32 as AdamW does it
            first = optimizer.exp_avg[span]
            second = optimizer.exp_avg_sq[span]
            update = (next_lr * weight_decay) * param
            if started:
                second = second / correction2
                update = update + next_lr * (first / correction1) / (second.sqrt() + settings.eps)
            sums += torch.stack([
                torch.linalg.vector_norm(param, dtype=torch.float64).square(),
                torch.linalg.vector_norm(first, dtype=torch.float64).square(),
                second.sum(dtype=torch.float64),
                torch.linalg.vector_norm(update, dtype=torch.float64).square(),
            ])  # fmt: skip
        per_segment.append(sums)
    if not per_segment:
        return {}
    # (segments, 4), summed over the ranks' shards under FSDP2; one transfer.
    sums = optimizer.whole_sums(torch.stack(per_segment)).cpu().tolist()

    metrics: dict[str, float] = {}
    for group in optimizer.groups:
        rows = [sums[i] for i, segment in enumerate(optimizer.segments) if segment.group == group.name]
        totals = [sum(row[column] for row in rows) for column in range(4)]
        numel = optimizer.group_numel(group)
        metrics.update(_norms(f"opt/{group.name}", totals))
        metrics[f"opt/{group.name}/m_norm"] = math.sqrt(totals[_M_SQ])
        metrics[f"opt/{group.name}/grad_rms"] = math.sqrt(totals[_V_HAT_SUM] / max(numel, 1))
    for layer in optimizer.layer_names:
        rows = [sums[i] for i, segment in enumerate(optimizer.segments) if segment.layer == layer]
        metrics.update(_norms(f"opt/{layer}", [sum(row[column] for row in rows) for column in range(4)]))
    return metrics


def _norms(prefix: str, totals: list[float]) -> dict[str, float]:
    """param_norm, update_norm and their ratio from summed squares."""
    param_norm = math.sqrt(totals[_PARAM_SQ])
    update_norm = math.sqrt(totals[_UPDATE_SQ])
    ratio = update_norm / param_norm if param_norm > 0 else math.inf if update_norm > 0 else 0.0
    return {
        f"{prefix}/param_norm": param_norm,
        f"{prefix}/update_norm": update_norm,
        f"{prefix}/update_ratio": ratio,
    }
