"""PSSA's episodic memory: the map into the Poincare ball, one block's bank of slots, and the
high-loss chunks waiting for the dreaming cache.

The bank is detached state: reads take gradients to the query only (the kernel's contract),
writes happen at chunk ends from the block's last-token query and output, gated by the chunk's
loss and guarded by a refractory rule so that a recently useful slot is not overwritten at once.

What a training forward does to this state is device work of fixed shapes, with no host read and
no branch on a tensor's value, so the step can be captured as a CUDA graph and replayed. Hence:
all state lives in device buffers that keep their addresses (a replay reads and writes the same
memory); the bookkeeping is updated in place; and a forward reads and writes its own copies of
the keys and values (`EpisodicBank.writing`), replaced out of place on each write so that a
read's autograd graph that saved the old tensors stays valid until its backward, and copied back
into the bank's buffers when the forward ends.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from engine.models.base import IGNORE_INDEX
from engine.models.pssa import native_memory
from engine.models.pssa.read import topk_read
from kernels.poincare import hyperbolic_distance, poincare_read

MAX_BALL_RADIUS = 1.0 - 8.0 * torch.finfo(torch.float32).eps
"""Largest radius of a projected query: representable in fp32 and strictly inside the ball."""


def to_poincare_ball(q: torch.Tensor) -> torch.Tensor:
    """`q / (1 + |q|)` over the last dimension, radially capped at MAX_BALL_RADIUS.

    Overflow-safe: the norm is taken of q divided by its largest magnitude, so a finite query
    of any size (|q| = 1e30 in fp32, where q * q overflows) maps to a finite point. On the CPU,
    float32 or float64, `native_memory`'s C loop where it is built (one operation forward and
    back instead of some twenty small ones each way), else `torch_poincare_ball`.
    """
    if not q.is_cuda and q.dtype in (torch.float32, torch.float64) and native_memory.library() is not None:
        return _NativeBall.apply(q)
    return torch_poincare_ball(q)


class _NativeBall(torch.autograd.Function):
    """`to_poincare_ball` by `native_memory.ball`, forward and backward."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor) -> torch.Tensor:
        rows = q.detach().reshape(-1, q.shape[-1]).contiguous()
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(rows)
        return native_memory.ball(native_memory.library(), rows, None, MAX_BALL_RADIUS).view(q.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (rows,) = ctx.saved_tensors
        grad_rows = grad.reshape(rows.shape).to(rows.dtype).contiguous()
        return native_memory.ball(native_memory.library(), rows, grad_rows, MAX_BALL_RADIUS).view(grad.shape)


def torch_poincare_ball(q: torch.Tensor) -> torch.Tensor:
    """`to_poincare_ball` in PyTorch operations (the definition the native map is held to)."""
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

    def gain(self, since: torch.Tensor) -> torch.Tensor:
        """The gain of int64 update gaps dt, in float64 (the precision of the host rule it replaced)."""
        return ((1.0 - torch.exp(-since.double() / self.recovery_updates)) ** 2).clamp_min(self.min_gain)


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

    Its state is non-persistent buffers on the model's device (they reach checkpoints through
    `state()`, not the parameter state dict): keys (S, Dk) and values (S, Dv); for the write
    rule confidence (S,) float32 and last_touched (S,) int64 (the update a slot was last written
    or defended); slot_count and ring_head, (1,) int64; and write_counts (3,) int64, what its
    writes did since the line started (`WriteCounters.FIELDS`), saved with it so a resumed
    line's counts continue. `count`, `head` and `counters` read those on the host: for probes,
    checkpoints and tests, never inside a training step.
    """

    def __init__(self, capacity: int, key_dim: int, value_dim: int, rule: WriteRule) -> None:
        super().__init__()
        self.capacity = capacity
        self.rule = rule
        self.register_buffer("keys", torch.zeros(capacity, key_dim), persistent=False)
        self.register_buffer("values", torch.zeros(capacity, value_dim), persistent=False)
        self.register_buffer("confidence", torch.ones(capacity, dtype=torch.float32), persistent=False)
        self.register_buffer("last_touched", torch.zeros(capacity, dtype=torch.int64), persistent=False)
        self.register_buffer("slot_count", torch.zeros(1, dtype=torch.int64), persistent=False)
        self.register_buffer("ring_head", torch.zeros(1, dtype=torch.int64), persistent=False)
        counters = len(WriteCounters.FIELDS)
        self.register_buffer("write_counts", torch.zeros(counters, dtype=torch.int64), persistent=False)
        self.register_buffer("slot_index", torch.arange(capacity), persistent=False)
        # The keys and values of an open `writing()` session: what reads see and writes replace.
        self._live: tuple[torch.Tensor, torch.Tensor] | None = None

    def _apply(self, fn: Any, recurse: bool = True) -> EpisodicBank:
        # The rule's confidence arithmetic is float32 whatever the model's dtype: a `.double()`
        # (gradchecks) moves the buffer with the model but must not retype it.
        super()._apply(fn, recurse)
        self.confidence = self.confidence.float()
        return self

    @property
    def count(self) -> int:
        """Occupied slots (a host read)."""
        return int(self.slot_count)

    @property
    def head(self) -> int:
        """The slot a full bank offers next (a host read)."""
        return int(self.ring_head)

    @property
    def counters(self) -> WriteCounters:
        """A host copy of `write_counts`."""
        return WriteCounters(*(int(v) for v in self.write_counts.tolist()))

    @property
    def occupied(self) -> torch.Tensor:
        """(S,) bool: slots fill in index order and never empty, so the first `count` are occupied."""
        return self.slot_index < self.slot_count

    @contextmanager
    def writing(self) -> Iterator[None]:
        """A session of writes (a training forward): reads and writes use copies of the keys and
        values, written back into the buffers when it ends (see the module docstring)."""
        self._live = (self.keys.clone(), self.values.clone())
        try:
            yield
        finally:
            keys, values = self._live
            self._live = None
            with torch.no_grad():
                self.keys.copy_(keys)
                self.values.copy_(values)

    def _slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._live if self._live is not None else (self.keys, self.values)

    def read(self, q_ball: torch.Tensor, tau: float, top_k: int) -> torch.Tensor:
        """(N, Dk) queries in the ball -> (N, Dv) reads; zeros while the bank is empty. A top-k
        read on the CPU reads only the chosen slots (`pssa.read`), elsewhere the kernel's."""
        keys, values = self._slots()
        if not q_ball.is_cuda and 0 < top_k < self.capacity:
            return topk_read(q_ball, keys, values, self.occupied, tau, top_k)
        return poincare_read(q_ball, keys, values, self.occupied, tau, top_k)

    @torch.no_grad()
    def read_weights(self, q_ball: torch.Tensor, tau: float, top_k: int) -> torch.Tensor:
        """(N, S) read weights, as the read forms them (for probes); all zero while empty."""
        keys, _ = self._slots()
        distance = hyperbolic_distance(q_ball.to(keys.dtype), keys)  # (N, S)
        usable = self.occupied[None, :].expand_as(distance)
        if 0 < top_k < self.capacity:
            ranking = distance.masked_fill(~usable, float("inf"))
            chosen = ranking.topk(top_k, dim=-1, largest=False).indices
            usable = torch.zeros_like(usable).scatter_(1, chosen, True) & usable
        logits = (-distance / tau).masked_fill(~usable, float("-inf"))
        weights = torch.softmax(logits, dim=-1)
        return torch.nan_to_num(weights, nan=0.0)  # an empty bank's rows are all -inf

    def write(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        losses: torch.Tensor | Sequence[float],
        update: torch.Tensor | int,
    ) -> None:
        """Offer one (key, value) per row, in row order: keys (R, Dk), values (R, Dv), the rest
        as in `write_banks`."""
        write_banks([self], keys[None], values[None], losses, update)

    def occupancy(self) -> float:
        return self.count / self.capacity

    def readings(self, update: int) -> dict[str, float]:
        """The bank at optimizer update `update`, for probes; reads only.

        Confidence and age (updates since a slot was last written or defended) are over the
        occupied slots, and absent while the bank is empty: no slot has either.
        """
        counters = self.counters
        count = self.count
        readings = {
            "occupancy": count / self.capacity,
            "writes": float(counters.writes),
            "overwrites": float(counters.overwrites),
            "defended": float(counters.defended),
        }
        if count:
            # Slots fill in index order and never empty, so the occupied ones are the first `count`.
            confidence = self.confidence[:count].double()  # (count,)
            age = (update - self.last_touched[:count]).double()  # (count,)
            readings.update({
                "confidence_mean": float(confidence.mean()), "confidence_min": float(confidence.min()),
                "age_mean": float(age.mean()), "age_max": float(age.max()),
            })  # fmt: skip
        return readings

    def state(self, prefix: str) -> dict[str, torch.Tensor]:
        """The bank as named CPU tensors (checkpoint state; the format of the host rule's banks)."""
        return {
            f"{prefix}keys": self.keys.detach().cpu().clone(),
            f"{prefix}values": self.values.detach().cpu().clone(),
            f"{prefix}confidence": self.confidence.cpu().clone(),
            f"{prefix}last_touched": self.last_touched.cpu().clone(),
            f"{prefix}count_head": torch.cat([self.slot_count, self.ring_head]).cpu(),
            f"{prefix}counters": self.write_counts.cpu().clone(),
        }

    @torch.no_grad()
    def load_state(self, state: dict[str, torch.Tensor], prefix: str) -> None:
        """Restore what `state(prefix)` returned into the buffers, in place (captured graphs keep
        reading them); refuses a bank of another shape."""
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
        self.keys.copy_(state[prefix + "keys"])
        self.values.copy_(state[prefix + "values"])
        self.confidence.copy_(state[prefix + "confidence"])
        self.last_touched.copy_(state[prefix + "last_touched"])
        self.slot_count.fill_(count)
        self.ring_head.fill_(head)
        self.write_counts.copy_(counters.as_tensor())


@dataclass
class _StackedRuleState:
    """The write rule's state of K banks stacked along a leading bank dimension, for one write:
    the rule's kernels then run once for all of a model's blocks, not once per block."""

    confidence: torch.Tensor  # (K, S) float32
    last_touched: torch.Tensor  # (K, S) int64
    slot_count: torch.Tensor  # (K, 1) int64
    ring_head: torch.Tensor  # (K, 1) int64
    write_counts: torch.Tensor  # (K, 3) int64

    BUFFERS: ClassVar[tuple[str, ...]] = (
        "confidence", "last_touched", "slot_count", "ring_head", "write_counts",
    )  # fmt: skip
    """The fields, named as the banks' buffers they stack."""

    @classmethod
    def of(cls, banks: Sequence[EpisodicBank]) -> _StackedRuleState:
        return cls(*(torch.stack([getattr(bank, name) for bank in banks]) for name in cls.BUFFERS))

    def store_into(self, banks: Sequence[EpisodicBank]) -> None:
        """Copy each bank's row back into its buffers, in place (their addresses never change)."""
        for name in self.BUFFERS:
            torch._foreach_copy_([getattr(bank, name) for bank in banks], list(getattr(self, name).unbind(0)))


@torch.no_grad()
def write_banks(
    banks: Sequence[EpisodicBank],
    keys: torch.Tensor,
    values: torch.Tensor,
    losses: torch.Tensor | Sequence[float],
    update: torch.Tensor | int,
) -> None:
    """Offer one (key, value) per row to each of several banks of one capacity and rule (a
    model's blocks), in row order, each row gated by its chunk loss, which they share.

    keys (K, R, Dk) in the ball and values (K, R, Dv), bank k's in row k; losses (R,) (nan: the
    row had no target); update the optimizer updates done, (1,) int64. Inside a training step
    losses and update are device tensors; outside one a list of floats and an int do (a
    host-to-device copy). A bank outside a `writing()` session gets one for this write. On the
    CPU the rule runs as C loops where they are built (`native_memory`, the same rule bit for bit).
    """
    first = banks[0]
    if any(bank.capacity != first.capacity or bank.rule != first.rule for bank in banks):
        raise ValueError("PSSA memory: banks written together must share their capacity and write rule")
    device = first.keys.device
    losses = torch.as_tensor(losses, dtype=torch.float64, device=device)  # exact for fp32 losses
    update = torch.as_tensor(update, dtype=torch.int64, device=device).reshape(1)
    if losses.shape[0] == 0:
        return
    with ExitStack() as sessions:
        for bank in banks:
            if bank._live is None:
                sessions.enter_context(bank.writing())
        lib = native_memory.library() if device.type == "cpu" else None
        if lib is not None:
            _native_write(lib, banks, keys, values, losses, update)
            return
        state = _StackedRuleState.of(banks)
        gated = losses > first.rule.loss_threshold  # (R,); nan never passes
        append_slot, appended = _append(state, gated, update, first.slot_index)
        contested = gated & ~appended  # (K, R)
        heads, replaced = _contest(state, first.rule, losses, contested, update, first.slot_index)
        defended = contested & ~replaced
        state.write_counts += torch.stack([appended.sum(1), replaced.sum(1), defended.sum(1)], dim=1)
        state.store_into(banks)
        slot_of_row = torch.where(appended, append_slot, torch.where(replaced, heads, first.capacity))
        _store_rows(banks, slot_of_row, keys, values, first.slot_index)


def _native_write(
    lib: Any,
    banks: Sequence[EpisodicBank],
    keys: torch.Tensor,
    values: torch.Tensor,
    losses: torch.Tensor,
    update: torch.Tensor,
) -> None:
    """`write_banks` on the CPU by `native_memory`'s C rule, bank by bank (the same rule row by
    row as the host ran it: a dozen tiny tensor operations a row are each a C statement here)."""
    rule = banks[0].rule
    numbers = (rule.loss_threshold, rule.damage_rate, rule.recovery_updates, rule.min_gain)
    losses, update = losses.contiguous(), update.contiguous()
    for index, bank in enumerate(banks):
        state = tuple(getattr(bank, name) for name in _StackedRuleState.BUFFERS)
        target = native_memory.write_rule(lib, numbers, losses, update, state)
        old_keys, old_values = bank._slots()
        bank._live = (native_memory.stored(lib, old_keys, keys[index], target),
                      native_memory.stored(lib, old_values, values[index], target))  # fmt: skip


def _append(
    state: _StackedRuleState, gated: torch.Tensor, update: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """While below capacity each gated row takes the next free slot (confidence 1, touched now).
    Rows that append precede, in row order, every row that meets a full bank, so they are done
    first, all at once. Returns each row's next free slot and whether it appended, (K, R) each."""
    capacity = slots.shape[0]
    count = state.slot_count  # (K, 1)
    earlier = torch.cumsum(gated, dim=0) - gated.long()  # (R,) gated rows before each row
    append_slot = count + earlier  # (K, R)
    appended = gated & (append_slot < capacity)
    new_count = (count + gated.sum()).clamp_max(capacity)
    fresh = (slots >= count) & (slots < new_count)  # (K, S) slots filled now
    state.confidence.masked_fill_(fresh, 1.0)
    state.last_touched = torch.where(fresh, update, state.last_touched)
    state.slot_count = new_count
    return append_slot, appended


def _contest(
    state: _StackedRuleState,
    rule: WriteRule,
    losses: torch.Tensor,
    contested: torch.Tensor,
    update: torch.Tensor,
    slots: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row that meets a full bank, in row order, against the ring head's slot: the slot
    resists while its confidence exceeds the damage (it pays the damage, counts as touched now,
    the head stays), else it is replaced (confidence 1, touched now, the head advances).

    A fixed loop over every row (capturable); a row that does not contest changes nothing.
    Float64 damage, float32 confidence, as the host rule computed them. Returns the head each
    row met and whether the row replaced that slot, (K, R) each.
    """
    capacity = slots.shape[0]
    scaled_loss = rule.damage_rate * losses  # damage = (damage_rate * loss) * gain
    gains = rule.gain(update - state.last_touched)  # (K, S) at this update
    head = state.ring_head  # (K, 1)
    heads, replaced = [], []
    for row in range(losses.shape[0]):
        meets = contested[:, row : row + 1]  # (K, 1)
        confidence = state.confidence.gather(1, head)
        gain = gains.gather(1, head)
        damage = scaled_loss[row] * gain
        resists = confidence > damage  # compared in float64
        paid = torch.where(resists, confidence - damage.float(), 1.0)
        state.confidence.scatter_(1, head, torch.where(meets, paid, confidence))
        # Touched now either way: a later row meeting this slot sees dt = 0, gain(0) = min_gain.
        gains.scatter_(1, head, torch.where(meets, rule.min_gain, gain))
        heads.append(head)
        replaced.append(meets & ~resists)
        head = (head + replaced[-1]) % capacity
    heads_met, replaced_rows = torch.cat(heads, dim=1), torch.cat(replaced, dim=1)
    state.ring_head = head
    touched = ((heads_met[:, :, None] == slots) & contested[:, :, None]).any(dim=1)  # (K, S)
    state.last_touched = torch.where(touched, update, state.last_touched)
    return heads_met, replaced_rows


def _store_rows(
    banks: Sequence[EpisodicBank],
    slot_of_row: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Put each writing row's key and value in its slot (slot_of_row (K, R), S for rows that
    write nothing), the last row writing a slot winning; out of place (see `writing`).

    Each bank's new keys and values are a copy of the old with one spare slot after the last:
    the rows are copied into their slots in one `index_copy_`, and a row that writes nothing, or
    whose slot a later row of the same write takes, is sent to the spare (so every real slot
    receives one row at most: no order among duplicates to rely on). Then the spare is dropped.
    The alternative, a (K, S, D) gather of the rows and a select against the old slots, makes
    three passes over the bank a write instead of one copy."""
    capacity = slots.shape[0]
    rows = torch.arange(slot_of_row.shape[1], device=slot_of_row.device)
    writes_slot = slot_of_row[:, :, None] == slots  # (K, R, S)
    writer = torch.where(writes_slot, rows[:, None], -1).amax(dim=1)  # (K, S) last writing row or -1
    # The last writer of each row's slot (the spare's is -1, which no row equals).
    last_writer = F.pad(writer, (0, 1), value=-1).gather(1, slot_of_row)  # (K, R)
    target = torch.where(last_writer == rows, slot_of_row, capacity)  # (K, R)

    def replaced(old: torch.Tensor, target_rows: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
        with_spare = torch.cat([old, old[:1]])  # (S + 1, D): the spare's content is never read
        return with_spare.index_copy_(0, target_rows, data.detach().to(old.dtype))[:capacity]

    for index, bank in enumerate(banks):
        old_keys, old_values = bank._slots()
        bank._live = (
            replaced(old_keys, target[index], keys[index]),
            replaced(old_values, target[index], values[index]),
        )


class PendingDreams(nn.Module):
    """High-loss chunks a training forward recorded for the dreaming cache, held on the device.

    The dreaming cache (`pssa_dream.DreamCache`) is a host deque of the last `capacity` chunks;
    appending to it inside the step would read the chunk losses on the host. So the forward
    writes each gated row's chunk, padded to chunk_len, into a device ring of the cache's
    capacity (a chunk recorded more than `capacity` chunks ago is overwritten: the cache would
    have dropped it first anyway), and `drain()` hands them over, oldest first, outside the step.
    """

    def __init__(self, capacity: int, chunk_len: int, loss_threshold: float) -> None:
        super().__init__()
        self.capacity = capacity
        self.chunk_len = chunk_len
        self.loss_threshold = loss_threshold
        # Row `capacity` is a spare: rows of a piece that record nothing are sent there.
        shape = (capacity + 1, chunk_len)
        self.register_buffer("tokens", torch.zeros(shape, dtype=torch.int64), persistent=False)
        self.register_buffer("targets", torch.full(shape, IGNORE_INDEX, dtype=torch.int64), persistent=False)
        # Chunks recorded since the last drain (it may exceed the capacity).
        self.register_buffer("recorded", torch.zeros(1, dtype=torch.int64), persistent=False)

    @torch.no_grad()
    def record(self, tokens: torch.Tensor, targets: torch.Tensor, losses: torch.Tensor) -> None:
        """One piece's (R, L <= chunk_len) tokens and targets and its (R,) row losses: record,
        in row order, the rows whose loss exceeds the threshold (nan never does). On the CPU one
        C call (`native_memory.record_dreams`) where it is built: a dozen operations on 8 rows
        cost 0.17 ms a chunk in PyTorch. Rows that record nothing are then not copied at all."""
        lib = native_memory.library() if not tokens.is_cuda else None
        if lib is not None and tokens.dtype == targets.dtype == torch.int64:
            ring = (self.tokens, self.targets, self.recorded)
            native_memory.record_dreams(lib, ring, tokens, targets, losses, self.loss_threshold, IGNORE_INDEX)
        else:
            self.torch_record(tokens, targets, losses)

    @torch.no_grad()
    def torch_record(self, tokens: torch.Tensor, targets: torch.Tensor, losses: torch.Tensor) -> None:
        """`record` in tensor operations only (on the device, no host read: capturable)."""
        pad = self.chunk_len - tokens.shape[1]
        tokens = F.pad(tokens.long(), (0, pad), value=0)
        targets = F.pad(targets.long(), (0, pad), value=IGNORE_INDEX)
        gated = losses.double() > self.loss_threshold
        position = self.recorded + torch.cumsum(gated, dim=0) - gated.long()  # (R,) in the ring's sequence
        total = self.recorded + gated.sum()
        # A row that a later row of this same piece overwrites in the ring is not written at all.
        kept = gated & (position >= total - self.capacity)
        slot = torch.where(kept, position % self.capacity, self.capacity)
        self.tokens.index_copy_(0, slot, tokens)
        self.targets.index_copy_(0, slot, targets)
        self.recorded.copy_(total)

    def drain(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The recorded (tokens, targets) chunks as CPU (chunk_len,) tensors, oldest first, and
        an empty ring. A host read: outside the training step."""
        recorded = int(self.recorded)
        kept = min(recorded, self.capacity)
        slots = torch.arange(recorded - kept, recorded, device=self.tokens.device) % self.capacity
        tokens = self.tokens.index_select(0, slots).cpu()
        targets = self.targets.index_select(0, slots).cpu()
        self.clear()
        return list(zip(tokens, targets))

    def clear(self) -> None:
        """Forget what was recorded (a checkpoint's cache replaces it)."""
        self.recorded.zero_()
