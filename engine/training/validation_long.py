"""The long-row probe: held-out rows longer than the training length, read one row at a time.

When the model's longest context (or `validation.long_seq_len`) exceeds the training length L,
every validation also reads each source's held-out rows of that length P:

    val_<P>/<source>, /mix, /mean     the loss at the long length
    val_<P>/pos/seg<k>                the recipe-weighted loss of the targets at positions
                                      k L .. (k + 1) L - 1: what the context past L is worth
    val_<P>/pos/last_over_first       the last segment's loss over the first's
    val_<P>/<probe>                   the model's probes on the long rows with `train_len` = L
                                      (one row per source, each probed alone; the mean over them)

One row at a time: a long row's activations are the largest allocation a validation makes.
"""

from __future__ import annotations

import inspect
import math

import torch

from engine.models.base import LanguageModel
from engine.training.validation_losses import HeldOutRows, loss_metrics, recipe_mix, token_losses


def long_row_losses(
    model: LanguageModel, rows: dict[str, torch.Tensor], device: torch.device
) -> dict[str, torch.Tensor]:
    """Source -> (rows, P) float64 token losses, each row forwarded alone."""
    return {source: token_losses(model, windows, 1, device) for source, windows in rows.items()}


def segment_losses(losses: dict[str, torch.Tensor], train_len: int) -> dict[int, dict[str, float]]:
    """Segment k -> source -> mean loss of the targets at positions k L .. (k + 1) L - 1."""
    segments: dict[int, dict[str, float]] = {}
    for source, values in losses.items():
        length = values.shape[1]
        for k in range(math.ceil(length / train_len)):
            piece = values[:, k * train_len : (k + 1) * train_len]  # (rows, <= L)
            if piece.numel():
                segments.setdefault(k, {})[source] = float(piece.mean())
    return segments


def _accepts_train_len(model: LanguageModel) -> bool:
    return "train_len" in inspect.signature(model.probes).parameters


def long_row_probes(
    model: LanguageModel, rows: dict[str, torch.Tensor], train_len: int, eos_id: int, device: torch.device
) -> dict[str, float]:
    """The model's probes on the first long row of every source, each alone; the mean of each reading."""
    kwargs = {"train_len": train_len} if _accepts_train_len(model) else {}
    readings: dict[str, list[float]] = {}
    for source in sorted(rows):
        if rows[source].shape[0] == 0:
            continue
        row = rows[source][:1].to(device)  # (1, P + 1)
        for name, value in model.probes(row[:, :-1], row[:, 1:], eos_id, **kwargs).items():
            readings.setdefault(name, []).append(float(value))
    return {name: sum(values) / len(values) for name, values in readings.items()}


def long_row_metrics(
    model: LanguageModel,
    rows: HeldOutRows,
    train_len: int,
    weights: dict[str, float],
    eos_id: int,
    device: torch.device,
) -> dict[str, float]:
    """Every `val_<P>/...` metric of the long-row probe (see the module docstring)."""
    prefix = f"val_{rows.seq_len}"
    losses = long_row_losses(model, rows.rows, device)
    metrics = loss_metrics(prefix, losses, weights)
    segments = segment_losses(losses, train_len)
    mixed = {k: recipe_mix(by_source, weights) for k, by_source in sorted(segments.items())}
    for k, value in mixed.items():
        if value is not None:
            metrics[f"{prefix}/pos/seg{k}"] = value
    present = [k for k, value in mixed.items() if value is not None]
    if len(present) >= 2 and mixed[present[0]]:
        metrics[f"{prefix}/pos/last_over_first"] = mixed[present[-1]] / mixed[present[0]]
    probes = long_row_probes(model, rows.rows, train_len, eos_id, device)
    metrics.update({f"{prefix}/{name}": value for name, value in probes.items()})
    return metrics
