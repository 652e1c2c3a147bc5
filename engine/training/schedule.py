"""Schedules read from run.json: the learning rate, the batch-size ramp, the weight decay.

The trainer calls these with plain numbers; they are pure functions of the configuration, so a
resumed line computes exactly the rates an uninterrupted one did.
"""

from __future__ import annotations

import math

from engine.config.run import RunConfig


def learning_rate(config: RunConfig, tokens_trained: float) -> float:
    """The learning rate after `tokens_trained` tokens.

    Piece i covers [until of piece i-1 (0 for the first), its own until). A warmup ramps linearly
    from the rate at its start (0 for a first piece) to `to` x peak; a constant holds `to` x peak;
    a decay goes from the rate at its start (the peak for a first piece) to `to` x peak along its
    shape. Past a closed last piece the rate stays at that piece's end.
    """
    peak = config.lr.peak
    start_tokens = 0.0
    start_fraction: float | None = None  # None: the rate before the first piece (kind-dependent)
    for piece in config.lr.pieces:
        if start_fraction is None:
            start_fraction = 0.0 if piece.kind == "warmup" else 1.0
        end_tokens = piece.until_tokens
        if end_tokens is None:  # open-ended: a constant (validation allows no other kind)
            return peak * piece.to_fraction
        if tokens_trained < end_tokens:
            progress = max(tokens_trained - start_tokens, 0.0) / (end_tokens - start_tokens)
            fraction = _piece_fraction(piece.kind, piece.shape, start_fraction, piece.to_fraction, progress)
            return peak * fraction
        start_tokens, start_fraction = end_tokens, piece.to_fraction
    return peak * config.lr.pieces[-1].to_fraction


def _piece_fraction(kind: str, shape: str, start: float, end: float, progress: float) -> float:
    """The rate (as a fraction of the peak) at `progress` in [0, 1] through a piece."""
    if kind == "constant":
        return end
    if kind == "warmup" or shape == "linear":
        return start + (end - start) * progress
    if shape == "cosine":
        return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if shape == "sqrt":
        return end + (start - end) * (1.0 - math.sqrt(progress))
    raise ValueError(f"unknown decay shape {shape!r}")


def tokens_per_update(config: RunConfig, data_tokens: float) -> int:
    """The tokens of an update starting at the data line's token count `data_tokens`.

    Read at the data line's position (a cycle's start token plus its updates so far), so a
    cycle's updates are fixed by its manifest and the ramp. Past a closed last piece the last
    piece's batch holds.
    """
    pieces = config.ramp()
    for piece in pieces:
        if piece.to_tokens is None or data_tokens < piece.to_tokens:
            return piece.tokens
    return pieces[-1].tokens


def update_weight_decay(config: RunConfig, update_tokens: int) -> float:
    """An update's weight decay: scaled by its tokens over `weight_decay_batch` when that is set.

    With the decay proportional to the batch, the AdamW time scale in tokens (batch / (lr x wd))
    stays put while a ramp grows the batch.
    """
    optimizer = config.optimizer
    if optimizer.weight_decay_batch is None:
        return optimizer.weight_decay
    return optimizer.weight_decay * update_tokens / optimizer.weight_decay_batch
