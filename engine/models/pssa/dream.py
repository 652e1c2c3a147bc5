"""PSSA dreaming: offline rehearsal of cached and dreamt sequences, guarded by a fresh task.

Two sources of sequences (the article's modes): the cache of high-loss chunks training recorded
(`memory`), and sequences the model dreams from its memory values (`generate`): a slot's value of
the first block's bank stands in for the first token's embedding, and `length` tokens are sampled
at `temperature` from there, token by token. Every sequence, cached or dreamt, starts from the same
live carry (a copy: no sequence advances another's).

Each rehearsal step is a small SGD step on the output-head rows of the sequence's target tokens.
Its direction is the rehearsal gradient with its conflict against the fresh task's gradient
projected out (when the two point against each other), and the step is then backtracked on the
fresh task's actual loss: it is kept only if that loss stays finite and within LOSS_TOLERANCE of
its value before dreaming, the step size halving up to MAX_HALVINGS times; otherwise the rows are
restored bit for bit. The projection is a first guess, the loss check the guarantee. Only head
rows change, so the stream below the head is fixed while dreaming: each sequence's final hidden
states are computed once.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
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


@dataclass(frozen=True)
class DreamSources:
    """What one dream rehearses (the article's options beside the SGD's lr and steps)."""

    sequences: int | None = None
    """Per round: the newest cached chunks rehearsed and the newest memory slots dreamt from; None: all."""
    cached: bool = True
    """Rehearse the cached high-loss chunks (the article's `memory` mode)."""
    generated: bool = False
    """Rehearse sequences dreamt from the memory values (the article's `generate` mode)."""
    repeats: int = 1
    """Rounds over the sequences; each round dreams its generated sequences afresh."""
    length: int = 8
    """Tokens dreamt from each memory seed."""
    temperature: float = 0.8
    """Logits are divided by it before the dreamt tokens are drawn (> 0)."""

    def validate(self) -> None:
        """ValueError naming the first setting the dream cannot run with."""
        for name in ("repeats", "length"):
            if getattr(self, name) < 1:
                raise ValueError(f"dream: {name} must be at least 1, got {getattr(self, name)}")
        if self.sequences is not None and self.sequences < 1:
            raise ValueError(f"dream: sequences must be at least 1 or None (all), got {self.sequences}")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"dream: temperature must be finite and positive, got {self.temperature}")


@dataclass
class DreamReport:
    """What one call to `dream` did."""

    steps_tried: int
    """Rehearsal steps attempted (sequences rehearsed x steps)."""
    steps_kept: int
    """Steps whose backtracked candidate passed the fresh-task guard."""
    fresh_loss_before: float
    """Fresh task's mean loss before dreaming."""
    fresh_loss_after: float
    """Fresh task's mean loss after dreaming (at most before + LOSS_TOLERANCE)."""
    sequences: int = 0
    """Sequences rehearsed, cached and dreamt, over every round."""
    generated_tokens: int = 0
    """Tokens dreamt from memory seeds, over every round."""


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
    model: PSSALM,
    fresh_tokens: torch.Tensor,
    fresh_targets: torch.Tensor,
    *,
    lr: float,
    steps: int,
    sources: DreamSources = DreamSources(),
    generator: torch.Generator | None = None,
    carry: torch.Tensor | None = None,
) -> DreamReport:
    """Rehearse what `sources` names with `steps` guarded SGD steps of size `lr` per sequence
    (see the module docstring); AdamW's moments and schedule are not touched.

    carry is the live carry (loops, depth, 1, d, N) that the fresh task and every sequence start
    from (None: a fresh row's zeros); generator draws the dreamt tokens (a CPU generator, so the
    draws are the same on every device; None: torch's default).
    """
    if not (math.isfinite(lr) and lr > 0) or steps < 1:
        raise ValueError(f"dream: lr must be finite and positive and steps at least 1, got {lr} and {steps}")
    sources.validate()
    tokens, targets = _validated_fresh(model, fresh_tokens, fresh_targets)
    live = model.initial_carry(1) if carry is None else carry
    head = model.head.weight
    with torch.no_grad():
        fresh_carry = live.expand(-1, -1, tokens.shape[0], -1, -1).contiguous()
        fresh_hidden, _, _ = model.hidden(tokens, fresh_carry)
        baseline = float(_mean_loss(fresh_hidden, targets, head))
    guard = _Guard(fresh_hidden, targets, head, baseline, lr, steps)
    cached = list(model.dream_cache.sequences) if sources.cached else []
    if sources.sequences is not None:
        cached = cached[-sources.sequences :]
    rehearsed = _cached_hidden(model, cached, live)
    seeds = _memory_seeds(model, sources.sequences) if sources.generated else []
    sequences = generated_tokens = 0
    for _ in range(sources.repeats):
        for hidden, hidden_targets in rehearsed:
            sequences += guard.rehearse(hidden, hidden_targets)
        for seed in seeds:
            hidden, dreamt = _dream_from(model, seed, live, sources, generator)
            generated_tokens += dreamt.shape[1]
            sequences += guard.rehearse(hidden, dreamt)
    with torch.no_grad():
        after = float(_mean_loss(fresh_hidden, targets, head))
    return DreamReport(guard.tried, guard.kept, baseline, after, sequences, generated_tokens)


@torch.no_grad()
def _cached_hidden(
    model: PSSALM, cached: list[tuple[torch.Tensor, torch.Tensor]], live: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each cached chunk's (1, chunk_len, d) final hidden states from the live carry and its
    (1, chunk_len) targets, the chunks read in one batch."""
    if not cached:
        return []
    device = model.head.weight.device
    tokens = torch.stack([chunk for chunk, _ in cached]).to(device)  # (K, chunk_len)
    targets = torch.stack([chunk_targets for _, chunk_targets in cached]).to(device)
    hidden, _, _ = model.hidden(tokens, live.expand(-1, -1, len(cached), -1, -1).contiguous())
    return list(zip(hidden.split(1), targets.split(1)))


def _memory_seeds(model: PSSALM, newest: int | None) -> list[torch.Tensor]:
    """The values (d,) of the first block's newest written slots, newest first (a host read).

    The ring fills slots in index order and, once full, overwrites at its head, so the newest
    slot is `head + count - 1` (mod capacity) either way."""
    bank = model.blocks[0].bank
    count, head = bank.count, bank.head
    wanted = count if newest is None else min(newest, count)
    return [bank.values[(head + count - 1 - index) % bank.capacity].clone() for index in range(wanted)]


@contextmanager
def _embedding_replaced(model: PSSALM, latent: torch.Tensor) -> Iterator[None]:
    """Every embedding lookup inside the `with` returns `latent` (1, 1, d): the article's dream
    input, a memory value in place of a token's embedding, through the model's own stack."""
    handle = model.embed.register_forward_hook(lambda _module, _args, output: latent.to(output.dtype))
    try:
        yield
    finally:
        handle.remove()


@torch.no_grad()
def _dream_from(
    model: PSSALM,
    seed: torch.Tensor,
    live: torch.Tensor,
    sources: DreamSources,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dream `length` tokens from a memory value: (1, length, d) hidden states, each the one that
    predicted the next dreamt token, and the (1, length) dreamt tokens as their targets."""
    head = model.head.weight
    placeholder = torch.zeros(1, 1, dtype=torch.int64, device=head.device)
    with _embedding_replaced(model, seed.view(1, 1, -1)):
        hidden, carry, _ = model.hidden(placeholder, live)
    states, dreamt = [hidden], []
    for index in range(sources.length):
        logits = states[-1][0, -1] @ head.T / math.sqrt(head.shape[1])  # (V,)
        probabilities = torch.softmax(logits.double().cpu() / sources.temperature, dim=-1)
        token = torch.multinomial(probabilities, 1, generator=generator).to(head.device)  # (1,)
        dreamt.append(token)
        if index + 1 < sources.length:
            hidden, carry, _ = model.hidden(token.view(1, 1), carry)
            states.append(hidden)
    return torch.cat(states, dim=1), torch.cat(dreamt).view(1, -1)


class _Guard:
    """The fresh task's guard over the head: projected, backtracked SGD steps (the module docstring)."""

    def __init__(
        self,
        fresh_hidden: torch.Tensor,
        fresh_targets: torch.Tensor,
        head: torch.Tensor,
        baseline: float,
        lr: float,
        steps: int,
    ) -> None:
        self.fresh_hidden = fresh_hidden
        self.fresh_targets = fresh_targets
        self.head = head
        self.baseline = baseline
        self.lr = lr
        self.steps = steps
        self.tried = 0
        self.kept = 0

    def rehearse(self, hidden: torch.Tensor, targets: torch.Tensor) -> bool:
        """`steps` guarded steps on one sequence's (1, L, d) hidden states and (1, L) targets;
        False (nothing tried) when it has no scored target."""
        rows = torch.unique(targets[targets != IGNORE_INDEX])
        if rows.numel() == 0:
            return False
        for _ in range(self.steps):
            self.tried += 1
            self.kept += self._step(hidden, targets, rows)
        return True

    def _step(self, hidden: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor) -> bool:
        """One projected, backtracked SGD step on head[rows]; True when kept, else head is unchanged."""
        head = self.head
        weight = head.detach().requires_grad_(True)  # shares head's storage: read here, written below
        (old,) = torch.autograd.grad(_mean_loss(hidden, targets, weight), weight)
        (fresh,) = torch.autograd.grad(_mean_loss(self.fresh_hidden, self.fresh_targets, weight), weight)
        old, fresh = old[rows], fresh[rows]  # (R, d) each
        dot = float((old.double() * fresh.double()).sum())
        fresh_norm_sq = float((fresh.double() ** 2).sum())
        # Remove the part of the rehearsal direction that would raise the fresh loss to first order.
        projection = dot / fresh_norm_sq if dot < 0 and fresh_norm_sq > 0 else 0.0
        direction = old - projection * fresh
        with torch.no_grad():
            snapshot = head[rows].clone()
            step_lr = self.lr
            for _ in range(MAX_HALVINGS):
                head[rows] = snapshot - step_lr * direction
                candidate = float(_mean_loss(self.fresh_hidden, self.fresh_targets, head))
                if math.isfinite(candidate) and candidate <= self.baseline + LOSS_TOLERANCE:
                    return True
                step_lr *= 0.5
            head[rows] = snapshot
        return False
