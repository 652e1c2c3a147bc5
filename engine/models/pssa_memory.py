"""PSSA's episodic memory: the map into the Poincare ball and one block's bank of slots.

The bank is detached state: reads take gradients to the query only (the kernel's contract),
writes happen at chunk ends from the block's last-token query and output, gated by the chunk's
loss and guarded by a refractory rule so that a recently useful slot is not overwritten at once.
Keys and values are replaced out of place on a write, so a read's autograd graph that saved the
old tensors stays valid until its backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from kernels.poincare import hyperbolic_distance, poincare_read

MAX_BALL_RADIUS = 1.0 - 8.0 * torch.finfo(torch.float32).eps
"""Largest radius of a projected query: representable in fp32 and strictly inside the ball."""


def to_poincare_ball(q: torch.Tensor) -> torch.Tensor:
    """`q / (1 + |q|)` over the last dimension, radially capped at MAX_BALL_RADIUS.

    Overflow-safe: the norm is taken of q divided by its largest magnitude, so a finite query
    of any size (|q| = 1e30 in fp32, where q * q overflows) maps to a finite point.
    """
    largest = q.detach().abs().amax(dim=-1, keepdim=True)  # (..., 1)
    largest = torch.where(largest > 0, largest, torch.ones_like(largest))
    scaled = q / largest  # (..., Dk), entries in [-1, 1]
    scaled_norm = scaled.norm(dim=-1, keepdim=True)  # in [1, sqrt(Dk)], or 0 for q = 0
    direction = scaled / scaled_norm.clamp_min(torch.finfo(q.dtype).tiny)
    radius = (largest * scaled_norm).clamp_max(torch.finfo(q.dtype).max)
    ball_radius = (radius / (1 + radius)).clamp_max(MAX_BALL_RADIUS)
    return direction * ball_radius


@dataclass(frozen=True)
class WriteRule:
    """The loss-gated, refractory overwrite rule of a full bank (DESIGN.md, "PSSA memory write rule")."""

    loss_threshold: float = 3.5
    """A chunk writes only when its mean loss (nats per target) exceeds this."""
    damage_rate: float = 0.08
    """damage = damage_rate * loss * gain."""
    recovery_updates: float = 60.0
    """gain = max((1 - exp(-dt / recovery_updates))^2, min_gain), dt in optimizer updates."""
    min_gain: float = 0.005
    """Floor of the gain, so a slot touched this very update still takes some damage."""


@dataclass
class WriteCounters:
    """What a bank's writes did, cumulative since the line started."""

    FIELDS: ClassVar[tuple[str, ...]] = ("writes", "overwrites", "defended")

    writes: int = 0
    """Rows appended to an empty slot while the bank was below capacity."""
    overwrites: int = 0
    """Rows that replaced the ring-head slot of a full bank."""
    defended: int = 0
    """Rows the ring-head slot refused because its confidence exceeded the damage."""

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor([getattr(self, name) for name in self.FIELDS], dtype=torch.int64)

    @classmethod
    def from_tensor(cls, saved: torch.Tensor, name: str) -> WriteCounters:
        """Counters from `as_tensor()`'s output; `name` labels a negative count's error."""
        values = [int(v) for v in saved.tolist()]
        if any(value < 0 for value in values):
            raise ValueError(f"PSSA memory state: {name} = {values} has a negative count")
        return cls(*values)


class EpisodicBank(nn.Module):
    """One block's ring buffer of (key in the Poincare ball, value) slots.

    keys (S, Dk) and values (S, Dv) live on the model's device (non-persistent buffers: they
    reach checkpoints through `state()`, not the parameter state dict). The bookkeeping that
    the write rule decides on (count, ring head, confidence, last update touched) lives on the
    CPU, so a write costs one host read of the chunk losses and no per-slot device syncs.

    The bank also counts, since the line started, what its writes did (`counters`, saved with
    it so a resumed line's counts continue): appends while below capacity, ring-head slots
    replaced, and writes the head slot refused because its confidence exceeded the damage.
    """

    def __init__(self, capacity: int, key_dim: int, value_dim: int, rule: WriteRule) -> None:
        super().__init__()
        self.capacity = capacity
        self.rule = rule
        self.register_buffer("keys", torch.zeros(capacity, key_dim), persistent=False)
        self.register_buffer("values", torch.zeros(capacity, value_dim), persistent=False)
        self.register_buffer("occupied", torch.zeros(capacity, dtype=torch.bool), persistent=False)
        self.count = 0
        self.head = 0
        self.confidence = torch.ones(capacity, dtype=torch.float32)
        self.last_touched = torch.zeros(capacity, dtype=torch.int64)
        self.counters = WriteCounters()

    def read(self, q_ball: torch.Tensor, tau: float, top_k: int) -> torch.Tensor:
        """(N, Dk) queries in the ball -> (N, Dv) reads; zeros while the bank is empty."""
        return poincare_read(q_ball, self.keys, self.values, self.occupied, tau, top_k)

    @torch.no_grad()
    def read_weights(self, q_ball: torch.Tensor, tau: float, top_k: int) -> torch.Tensor:
        """(N, S) read weights, as the read forms them (for probes); all zero while empty."""
        distance = hyperbolic_distance(q_ball.to(self.keys.dtype), self.keys)  # (N, S)
        usable = self.occupied[None, :].expand_as(distance)
        if 0 < top_k < self.capacity:
            ranking = distance.masked_fill(~usable, float("inf"))
            chosen = ranking.topk(top_k, dim=-1, largest=False).indices
            usable = torch.zeros_like(usable).scatter_(1, chosen, True) & usable
        logits = (-distance / tau).masked_fill(~usable, float("-inf"))
        weights = torch.softmax(logits, dim=-1)
        return torch.nan_to_num(weights, nan=0.0)  # an empty bank's rows are all -inf

    @torch.no_grad()
    def write(self, keys: torch.Tensor, values: torch.Tensor, losses: list[float], update: int) -> None:
        """Offer one (key, value) per row, in row order, each gated by its row's chunk loss.

        keys (R, Dk) in the ball, values (R, Dv), losses R floats (nan: the row had no target).
        """
        rule = self.rule
        slot_of_row: dict[int, int] = {}
        for row, loss in enumerate(losses):
            if not loss > rule.loss_threshold:  # also skips nan
                continue
            if self.count < self.capacity:
                slot = self.count
                self.count += 1
                self.counters.writes += 1
            else:
                slot = self.head
                since = float(update - int(self.last_touched[slot]))
                gain = max((1.0 - math.exp(-since / rule.recovery_updates)) ** 2, rule.min_gain)
                damage = rule.damage_rate * loss * gain
                if float(self.confidence[slot]) > damage:
                    # The slot resists: it pays the damage and counts as touched now.
                    self.confidence[slot] -= damage
                    self.last_touched[slot] = update
                    self.counters.defended += 1
                    continue
                self.head = (self.head + 1) % self.capacity
                self.counters.overwrites += 1
            self.confidence[slot] = 1.0
            self.last_touched[slot] = update
            slot_of_row = {r: s for r, s in slot_of_row.items() if s != slot}
            slot_of_row[row] = slot
        if not slot_of_row:
            return
        rows = torch.tensor(list(slot_of_row), device=keys.device)
        slots = torch.tensor(list(slot_of_row.values()), device=self.keys.device)
        self.keys = self.keys.index_copy(0, slots, keys[rows].detach().to(self.keys.dtype))
        self.values = self.values.index_copy(0, slots, values[rows].detach().to(self.values.dtype))
        self.occupied = torch.arange(self.capacity, device=self.keys.device) < self.count

    def occupancy(self) -> float:
        return self.count / self.capacity

    def readings(self, update: int) -> dict[str, float]:
        """The bank at optimizer update `update`, for probes; reads only.

        Confidence and age (updates since a slot was last written or defended) are over the
        occupied slots, and absent while the bank is empty: no slot has either.
        """
        readings = {
            "occupancy": self.occupancy(),
            "writes": float(self.counters.writes),
            "overwrites": float(self.counters.overwrites),
            "defended": float(self.counters.defended),
        }
        if self.count:
            # Slots fill in index order and never empty, so the occupied ones are the first `count`.
            confidence = self.confidence[: self.count].double()  # (count,)
            age = (update - self.last_touched[: self.count]).double()  # (count,)
            readings.update({
                "confidence_mean": float(confidence.mean()), "confidence_min": float(confidence.min()),
                "age_mean": float(age.mean()), "age_max": float(age.max()),
            })  # fmt: skip
        return readings

    def state(self, prefix: str) -> dict[str, torch.Tensor]:
        """The bank as named CPU tensors (checkpoint state)."""
        return {
            f"{prefix}keys": self.keys.detach().cpu().clone(),
            f"{prefix}values": self.values.detach().cpu().clone(),
            f"{prefix}confidence": self.confidence.clone(),
            f"{prefix}last_touched": self.last_touched.clone(),
            f"{prefix}count_head": torch.tensor([self.count, self.head], dtype=torch.int64),
            f"{prefix}counters": self.counters.as_tensor(),
        }

    def load_state(self, state: dict[str, torch.Tensor], prefix: str) -> None:
        """Restore what `state(prefix)` returned; refuses a bank of another shape."""
        expected = {
            "keys": self.keys.shape,
            "values": self.values.shape,
            "confidence": self.confidence.shape,
            "last_touched": self.last_touched.shape,
            "count_head": torch.Size([2]),
            "counters": torch.Size([len(WriteCounters.FIELDS)]),
        }
        for name, shape in expected.items():
            key = prefix + name
            if key not in state:
                raise ValueError(f"PSSA memory state: {key} is missing")
            if state[key].shape != shape:
                raise ValueError(
                    f"PSSA memory state: {key} has shape {tuple(state[key].shape)}, expected {tuple(shape)}"
                )
        count, head = (int(v) for v in state[prefix + "count_head"])
        if not (0 <= count <= self.capacity and 0 <= head < self.capacity):
            raise ValueError(f"PSSA memory state: {prefix}count_head = {[count, head]} is out of range")
        counters = WriteCounters.from_tensor(state[prefix + "counters"], prefix + "counters")
        self.keys = state[prefix + "keys"].to(self.keys.device, self.keys.dtype).clone()
        self.values = state[prefix + "values"].to(self.values.device, self.values.dtype).clone()
        self.confidence = state[prefix + "confidence"].to("cpu", torch.float32).clone()
        self.last_touched = state[prefix + "last_touched"].to("cpu", torch.int64).clone()
        self.count, self.head = count, head
        self.counters = counters
        self.occupied = torch.arange(self.capacity, device=self.keys.device) < self.count
