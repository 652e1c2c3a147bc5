"""PSSA dreaming: offline rehearsal of cached high-loss sequences, guarded by a fresh task.

Each rehearsal step is a small SGD step on the output-head rows of the rehearsed sequence's
target tokens. Its direction is the rehearsal gradient with its conflict against the fresh
task's gradient projected out (when the two point against each other), and the step is then
backtracked on the fresh task's actual loss: it is kept only if that loss stays finite and within
LOSS_TOLERANCE of its value before dreaming, the step size halving up to MAX_HALVINGS times;
otherwise the rows are restored bit for bit. The projection is a first guess, the loss check the
guarantee.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.nn import functional as F

from engine.models.base import IGNORE_INDEX

if TYPE_CHECKING:
    from engine.models.pssa.model import PSSALM

LOSS_TOLERANCE = 1e-6
"""The most a kept rehearsal step may raise the fresh task's loss (nats per target)."""
MAX_HALVINGS = 10
"""Backtracking attempts per rehearsal step before the step is given up."""


class DreamCache:
    """The last `capacity` high-loss chunks (input ids, target ids), oldest dropped first."""

    def __init__(self, capacity: int, chunk_len: int) -> None:
        self.chunk_len = chunk_len
        self.sequences: deque[tuple[torch.Tensor, torch.Tensor]] = deque(maxlen=capacity)

    def remember(self, tokens: torch.Tensor, targets: torch.Tensor) -> None:
        """Cache one chunk (L <= chunk_len) of a row, padded to chunk_len with ignored targets."""
        pad = self.chunk_len - tokens.shape[0]
        self.sequences.append(
            (
                F.pad(tokens.detach().cpu(), (0, pad), value=0),
                F.pad(targets.detach().cpu(), (0, pad), value=IGNORE_INDEX),
            )
        )

    def __len__(self) -> int:
        return len(self.sequences)

    def state(self, prefix: str) -> dict[str, torch.Tensor]:
        """The cache as (n, chunk_len) int64 tensors, oldest first."""
        if not self.sequences:
            empty = torch.zeros(0, self.chunk_len, dtype=torch.int64)
            return {prefix + "tokens": empty, prefix + "targets": empty.clone()}
        tokens, targets = zip(*self.sequences)
        return {prefix + "tokens": torch.stack(tokens), prefix + "targets": torch.stack(targets)}

    def load_state(self, state: dict[str, torch.Tensor], prefix: str) -> None:
        tokens, targets = state.get(prefix + "tokens"), state.get(prefix + "targets")
        if tokens is None or targets is None:
            raise ValueError(f"PSSA extra state: {prefix}tokens / {prefix}targets are missing")
        if tokens.shape != targets.shape or tokens.dim() != 2 or tokens.shape[1] != self.chunk_len:
            raise ValueError(
                f"PSSA extra state: dreaming cache shapes {tuple(tokens.shape)} / {tuple(targets.shape)}, "
                f"expected (n, {self.chunk_len}) each"
            )
        if tokens.shape[0] > (self.sequences.maxlen or 0):
            raise ValueError(f"PSSA extra state: {tokens.shape[0]} dreaming sequences are over capacity")
        self.sequences.clear()
        tokens, targets = tokens.to("cpu", torch.int64), targets.to("cpu", torch.int64)
        for row in range(tokens.shape[0]):
            self.sequences.append((tokens[row].clone(), targets[row].clone()))


@dataclass
class DreamReport:
    """What one call to `dream` did."""

    steps_tried: int
    """Rehearsal steps attempted (cached sequences x steps)."""
    steps_kept: int
    """Steps whose backtracked candidate passed the fresh-task guard."""
    fresh_loss_before: float
    """Fresh task's mean loss before dreaming."""
    fresh_loss_after: float
    """Fresh task's mean loss after dreaming (at most before + LOSS_TOLERANCE)."""


def _validated_fresh(
    model: PSSALM, tokens: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The guard task as (B, L) tensors; refuses empty, mismatched, too long or out-of-vocabulary input."""
    if tokens.dim() == 1:
        tokens, targets = tokens[None], targets[None]
    vocab = model.config.vocab_size
    if tokens.numel() == 0 or tokens.shape != targets.shape:
        raise ValueError(
            "dream: the fresh task must be non-empty with equal shapes, "
            f"got {tuple(tokens.shape)} / {tuple(targets.shape)}"
        )
    if tokens.shape[1] > model.config.chunk_len:
        raise ValueError(
            f"dream: the fresh task has {tokens.shape[1]} tokens, over chunk_len {model.config.chunk_len}"
        )
    scored = targets[targets != IGNORE_INDEX]
    if scored.numel() == 0:
        raise ValueError("dream: the fresh task has no scored target")
    if tokens.min() < 0 or tokens.max() >= vocab or scored.min() < 0 or scored.max() >= vocab:
        raise ValueError(f"dream: the fresh task has ids outside the vocabulary [0, {vocab})")
    device = model.head.weight.device
    return tokens.to(device), targets.to(device)


def _mean_loss(hidden: torch.Tensor, targets: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the scored targets with logits `hidden @ W^T / sqrt(d)`."""
    logits = hidden @ head_weight.T / math.sqrt(hidden.shape[-1])  # (B, L, V)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX)


def dream(
    model: PSSALM, fresh_tokens: torch.Tensor, fresh_targets: torch.Tensor, *, lr: float, steps: int
) -> DreamReport:
    """Rehearse every cached sequence `steps` times (see the module docstring).

    Only output-head rows change; the stream below the head is fixed while dreaming, so each
    sequence's final hidden states are computed once (from a fresh carry, without memory writes).
    """
    tokens, targets = _validated_fresh(model, fresh_tokens, fresh_targets)
    head = model.head.weight
    with torch.no_grad():
        fresh_hidden, _, _ = model.hidden(tokens, model.initial_carry(tokens.shape[0]))
        baseline = float(_mean_loss(fresh_hidden, targets, head))
    tried = kept = 0
    for cached_tokens, cached_targets in list(model.dream_cache.sequences):
        device_tokens = cached_tokens.to(head.device)[None]
        device_targets = cached_targets.to(head.device)[None]
        with torch.no_grad():
            dream_hidden, _, _ = model.hidden(device_tokens, model.initial_carry(1))
        rows = torch.unique(device_targets[device_targets != IGNORE_INDEX])
        if rows.numel() == 0:
            continue
        for _ in range(steps):
            tried += 1
            kept += _guarded_step(
                dream_hidden, device_targets, fresh_hidden, targets, head, rows, lr, baseline
            )
    with torch.no_grad():
        after = float(_mean_loss(fresh_hidden, targets, head))
    return DreamReport(tried, kept, baseline, after)


def _guarded_step(
    dream_hidden: torch.Tensor,
    dream_targets: torch.Tensor,
    fresh_hidden: torch.Tensor,
    fresh_targets: torch.Tensor,
    head: torch.Tensor,
    rows: torch.Tensor,
    lr: float,
    baseline: float,
) -> bool:
    """One projected, backtracked SGD step on head[rows]; True when kept, else head is unchanged."""
    weight = head.detach().clone().requires_grad_(True)
    (old,) = torch.autograd.grad(_mean_loss(dream_hidden, dream_targets, weight), weight)
    (fresh,) = torch.autograd.grad(_mean_loss(fresh_hidden, fresh_targets, weight), weight)
    old, fresh = old[rows], fresh[rows]  # (R, d) each
    dot = float((old.double() * fresh.double()).sum())
    fresh_norm_sq = float((fresh.double() ** 2).sum())
    # Remove the part of the rehearsal direction that would raise the fresh loss to first order.
    projection = dot / fresh_norm_sq if dot < 0 and fresh_norm_sq > 0 else 0.0
    direction = old - projection * fresh
    with torch.no_grad():
        snapshot = head[rows].clone()
        step_lr = lr
        for _ in range(MAX_HALVINGS):
            head[rows] = snapshot - step_lr * direction
            candidate = float(_mean_loss(fresh_hidden, fresh_targets, head))
            if math.isfinite(candidate) and candidate <= baseline + LOSS_TOLERANCE:
                return True
            step_lr *= 0.5
        head[rows] = snapshot
    return False
