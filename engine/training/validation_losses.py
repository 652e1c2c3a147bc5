"""Held-out losses and how they are summed up: per source, the recipe mix, by document position.

Shared by the validation at the training length (engine.training.validation) and the long-row probe
(engine.training.validation_long). Losses come back to the host as float64 (rows, T) tensors, so every
aggregate is computed once, in one precision, whatever the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from datalines import DataLine
from engine.models.base import LanguageModel
from engine.training.step import autocast_for


@dataclass
class HeldOutRows:
    """The held-out rows of one length, per source, as int64 CPU tensors of (rows, seq_len + 1)."""

    seq_len: int
    """Tokens per row (each row holds seq_len + 1 tokens: inputs and the shifted targets)."""
    rows: dict[str, torch.Tensor]
    """Source name -> (rows, seq_len + 1) int64 windows."""


def load_heldout_rows(data_line: DataLine, seq_len: int, rows_per_source: int) -> HeldOutRows:
    """The first `rows_per_source` held-out rows of every source (DataLineError when not built)."""
    rows = {
        source: torch.from_numpy(array[:rows_per_source].astype("int64"))
        for source, array in data_line.validation_rows(seq_len).items()
    }
    return HeldOutRows(seq_len, rows)


def recipe_mix(values: dict[str, float], weights: dict[str, float]) -> float | None:
    """Sum of weight x value over the sources present in both, renormalised; None when none is."""
    shared = [source for source in values if weights.get(source, 0.0) > 0]
    total = sum(weights[source] for source in shared)
    if total <= 0:
        return None
    return sum(weights[source] * values[source] for source in shared) / total


def document_position_bins(windows: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(R, T + 1) windows -> (R, T) int64 bin of each target's position in its document, -1 excluded.

    The target at t is windows[:, t + 1]; its distance into its document is t minus the last input
    position <= t holding an EOS (0: the first token after an EOS). Bin 0 is distance 0, bin k the
    distances 2^(k-1) .. 2^k - 1. With no EOS at or before t the row cut into the document: -1.
    """
    inputs = windows[:, :-1]  # (R, T)
    length = inputs.shape[1]
    positions = torch.arange(length, dtype=torch.int64).expand_as(inputs)
    eos_at = torch.where(inputs == eos_id, positions, torch.full_like(positions, -1))
    last_eos = torch.cummax(eos_at, dim=1).values  # (R, T)
    distance = positions - last_eos
    # floor(log2(d)) + 1 for d >= 1, exactly: the bit length of d.
    bins = torch.zeros_like(distance)
    remaining = distance.clone()
    while bool((remaining > 0).any()):
        bins += (remaining > 0).to(torch.int64)
        remaining = remaining >> 1
    return torch.where(last_eos >= 0, bins, torch.full_like(bins, -1))


@torch.no_grad()
def token_losses(
    model: LanguageModel, windows: torch.Tensor, micro_batch_rows: int, device: torch.device
) -> torch.Tensor:
    """(R, T + 1) windows -> (R, T) float64 CPU cross-entropy of each target, `micro_batch_rows` at a time."""
    pieces = []
    for chunk in windows.split(max(1, micro_batch_rows)):
        chunk = chunk.to(device)
        with autocast_for(device):
            loss, _carry = model(chunk[:, :-1], chunk[:, 1:])  # (B, T)
        pieces.append(loss.detach().to("cpu", torch.float64))
    return torch.cat(pieces)


def loss_metrics(prefix: str, losses: dict[str, torch.Tensor], weights: dict[str, float]) -> dict[str, float]:
    """`<prefix>/<source>`, `/mix` and `/mean` from each source's (rows, T) token losses."""
    per_source = {source: float(values.mean()) for source, values in losses.items() if values.numel()}
    metrics = {f"{prefix}/{source}": value for source, value in per_source.items()}
    mix = recipe_mix(per_source, weights)
    if mix is not None:
        metrics[f"{prefix}/mix"] = mix
    if per_source:
        metrics[f"{prefix}/mean"] = sum(per_source.values()) / len(per_source)
    return metrics


def docpos_metrics(
    prefix: str,
    windows: dict[str, torch.Tensor],
    losses: dict[str, torch.Tensor],
    weights: dict[str, float],
    eos_id: int,
) -> dict[str, float]:
    """`<prefix>/docpos/bin<k>` and `/docpos/tokens_frac`, recipe-weighted over the sources."""
    by_bin: dict[int, dict[str, float]] = {}
    counted_share: dict[str, float] = {}
    for source, source_windows in windows.items():
        bins = document_position_bins(source_windows, eos_id)  # (R, T)
        loss = losses[source]  # (R, T) float64
        counted = bins >= 0
        counted_share[source] = float(counted.to(torch.float64).mean()) if bins.numel() else 0.0
        for k in torch.unique(bins[counted]).tolist():
            selected = bins == k
            by_bin.setdefault(int(k), {})[source] = float(loss[selected].mean())
    metrics: dict[str, float] = {}
    for k in sorted(by_bin):
        value = recipe_mix(by_bin[k], weights)
        if value is not None:
            metrics[f"{prefix}/docpos/bin{k}"] = value
    share = recipe_mix(counted_share, weights)
    if share is not None:
        metrics[f"{prefix}/docpos/tokens_frac"] = share
    return metrics
