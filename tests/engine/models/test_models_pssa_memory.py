"""PSSA episodic memory: the map into the Poincare ball, the read's gradient, the write rule."""

from __future__ import annotations

import contextlib
import math
import random

import pytest
import torch

from engine.models.pssa import native_memory
from engine.models.pssa.memory import (
    MAX_BALL_RADIUS,
    EpisodicBank,
    PendingDreams,
    WriteRule,
    to_poincare_ball,
    write_banks,
)


def _bank(capacity: int = 2, key_dim: int = 3, value_dim: int = 2) -> EpisodicBank:
    return EpisodicBank(capacity, key_dim, value_dim, WriteRule())


def test_ball_map_is_q_over_one_plus_norm() -> None:
    q = torch.tensor([[3.0, 4.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    ball = to_poincare_ball(q)
    assert torch.allclose(ball[0], q[0] / 6.0, atol=1e-15)
    assert torch.equal(ball[1], torch.zeros(3, dtype=torch.float64))


@pytest.mark.parametrize("magnitude", [1e30, 3e38])
def test_huge_query_stays_finite_and_inside_the_ball(magnitude: float) -> None:
    q = torch.tensor([[magnitude, -magnitude, 0.5 * magnitude, 1.0]], dtype=torch.float32, requires_grad=True)
    assert not torch.isfinite((q * q).sum())  # the naive norm overflows
    ball = to_poincare_ball(q)
    assert torch.isfinite(ball).all()
    assert float(ball.detach().double().norm()) <= MAX_BALL_RADIUS + 1e-7
    bank = _bank(capacity=3, key_dim=4, value_dim=2)
    bank.write(torch.zeros(2, 4), torch.ones(2, 2), [5.0, 5.0], update=0)
    m = bank.read(ball, tau=0.1, top_k=2)
    m.sum().backward()
    assert torch.isfinite(m).all() and torch.isfinite(q.grad).all()


def test_read_backward_gradcheck_float64() -> None:
    torch.manual_seed(0)
    bank = _bank(capacity=5, key_dim=3, value_dim=4).double()
    keys = to_poincare_ball(torch.randn(4, 3, dtype=torch.float64))
    bank.write(keys, torch.randn(4, 4, dtype=torch.float64), [4.0] * 4, update=0)
    q = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    for top_k in (2, 0):
        assert torch.autograd.gradcheck(lambda x, k=top_k: bank.read(to_poincare_ball(x), 0.5, k), (q,))


def test_low_loss_writes_nothing() -> None:
    bank = _bank()
    bank.write(torch.full((2, 3), 0.1), torch.ones(2, 2), [3.5, 1.0], update=7)
    assert bank.count == 0 and not bank.occupied.any()
    bank.write(torch.full((1, 3), 0.1), torch.ones(1, 2), [float("nan")], update=7)
    assert bank.count == 0


def test_appends_until_full_then_defended_slot_pays_the_damage() -> None:
    bank = _bank(capacity=2)
    keys = torch.tensor([[0.1, 0.0, 0.0], [0.0, 0.2, 0.0]])
    bank.write(keys, torch.tensor([[1.0, 1.0], [2.0, 2.0]]), [4.0, 4.0], update=10)
    assert bank.count == 2 and bank.head == 0 and bank.occupied.all()
    assert torch.equal(bank.keys, keys)

    # Full; slot 0 was touched this very update: gain is the floor 0.005, damage 0.08 * 5 * 0.005.
    bank.write(torch.tensor([[0.0, 0.0, 0.3]]), torch.tensor([[3.0, 3.0]]), [5.0], update=10)
    assert bank.head == 0
    assert torch.equal(bank.keys, keys)
    assert float(bank.confidence[0]) == pytest.approx(1.0 - 0.08 * 5.0 * 0.005, abs=1e-7)
    assert int(bank.last_touched[0]) == 10

    # 60 updates later the gain is (1 - e^-1)^2: the slot still resists, losing exactly the damage.
    before = float(bank.confidence[0])
    damage = 0.08 * 5.0 * (1 - math.exp(-1.0)) ** 2
    bank.write(torch.tensor([[0.0, 0.0, 0.3]]), torch.tensor([[3.0, 3.0]]), [5.0], update=70)
    assert float(bank.confidence[0]) == pytest.approx(before - damage, abs=1e-6)
    assert bank.head == 0 and int(bank.last_touched[0]) == 70

    # A loss whose damage exceeds the confidence overwrites the head slot and advances the head.
    bank.write(torch.tensor([[0.0, 0.0, 0.3]]), torch.tensor([[3.0, 3.0]]), [20.0], update=1000)
    assert bank.head == 1
    assert torch.equal(bank.keys[0], torch.tensor([0.0, 0.0, 0.3]))
    assert torch.equal(bank.values[0], torch.tensor([3.0, 3.0]))
    assert float(bank.confidence[0]) == 1.0 and int(bank.last_touched[0]) == 1000
    assert torch.equal(bank.keys[1], keys[1])


def test_rows_are_offered_in_order_within_one_write() -> None:
    bank = _bank(capacity=1)
    # Row 0 appends; row 1 meets a full bank whose slot was touched now and resists (low gain).
    bank.write(torch.tensor([[0.1, 0.0, 0.0], [0.2, 0.0, 0.0]]), torch.ones(2, 2), [4.0, 4.0], update=3)
    assert bank.count == 1
    assert torch.equal(bank.keys[0], torch.tensor([0.1, 0.0, 0.0]))
    assert float(bank.confidence[0]) == pytest.approx(1.0 - 0.08 * 4.0 * 0.005, abs=1e-7)


def test_state_round_trip_and_refusal() -> None:
    bank = _bank(capacity=3)
    bank.write(torch.rand(2, 3) * 0.3, torch.rand(2, 2), [4.0, 6.0], update=5)
    state = bank.state("b.")
    other = _bank(capacity=3)
    other.load_state(state, "b.")
    assert other.count == 2 and other.head == 0
    for name in ("keys", "values", "occupied", "confidence", "last_touched"):
        assert torch.equal(getattr(other, name), getattr(bank, name))
    with pytest.raises(ValueError, match="b.keys has shape"):
        _bank(capacity=4).load_state(state, "b.")


def _counts(bank: EpisodicBank) -> tuple[int, int, int]:
    return bank.counters.writes, bank.counters.overwrites, bank.counters.defended


def test_counters_follow_appends_overwrites_and_defences() -> None:
    bank = _bank(capacity=2)
    assert _counts(bank) == (0, 0, 0)
    bank.write(torch.zeros(3, 3), torch.ones(3, 2), [4.0, 1.0, 4.0], update=0)  # row 1 is below the gate
    assert _counts(bank) == (2, 0, 0)
    # Full: the head slot was touched this update, so a loss-5 row is refused (damage 0.002).
    bank.write(torch.zeros(1, 3), torch.ones(1, 2), [5.0], update=0)
    assert _counts(bank) == (2, 0, 1)
    # Loss 20 at update 1000: damage 0.08 * 20 * ~1 > 0.998, the head slot is replaced, then the
    # next head (slot 1, untouched for 1000 updates) is replaced too; a nan row counts nothing.
    bank.write(torch.zeros(3, 3), torch.ones(3, 2), [20.0, 20.0, float("nan")], update=1000)
    assert _counts(bank) == (2, 2, 1) and bank.head == 0
    # Slot 0 was just replaced (confidence 1, touched now): a loss-4 row is refused again.
    bank.write(torch.zeros(1, 3), torch.ones(1, 2), [4.0], update=1000)
    assert _counts(bank) == (2, 2, 2)


def test_counters_are_saved_restored_and_checked() -> None:
    bank = _bank(capacity=1)
    bank.write(torch.zeros(2, 3), torch.ones(2, 2), [4.0, 4.0], update=9)  # append, then defended
    bank.write(torch.zeros(1, 3), torch.ones(1, 2), [40.0], update=1000)  # overwritten
    assert _counts(bank) == (1, 1, 1)
    state = bank.state("b.")
    other = _bank(capacity=1)
    other.load_state(state, "b.")
    assert _counts(other) == (1, 1, 1)
    other.write(torch.zeros(1, 3), torch.ones(1, 2), [4.0], update=1000)
    assert _counts(other) == (1, 1, 2) and _counts(bank) == (1, 1, 1)  # restored counters are not shared
    with pytest.raises(ValueError, match="b.counters is missing"):
        _bank(capacity=1).load_state({k: v for k, v in state.items() if k != "b.counters"}, "b.")
    with pytest.raises(ValueError, match="b.counters has shape"):
        _bank(capacity=1).load_state({**state, "b.counters": torch.zeros(2, dtype=torch.int64)}, "b.")
    with pytest.raises(ValueError, match="negative count"):
        _bank(capacity=1).load_state({**state, "b.counters": torch.tensor([1, -1, 0])}, "b.")


def test_readings_of_a_hand_built_bank() -> None:
    bank = _bank(capacity=4)
    assert bank.readings(update=5) == {"occupancy": 0.0, "writes": 0.0, "overwrites": 0.0, "defended": 0.0}
    bank.write(torch.zeros(3, 3), torch.ones(3, 2), [4.0, 4.0, 4.0], update=0)
    bank.confidence[:3] = torch.tensor([1.0, 0.5, 0.25])
    bank.last_touched[:3] = torch.tensor([10, 40, 70])
    bank.write_counts[1:] = torch.tensor([7, 11])  # overwrites, defended
    confidence_before, touched_before = bank.confidence.clone(), bank.last_touched.clone()
    readings = bank.readings(update=100)
    assert readings == {
        "occupancy": 0.75, "writes": 3.0, "overwrites": 7.0, "defended": 11.0,
        "confidence_mean": pytest.approx(1.75 / 3), "confidence_min": 0.25,
        "age_mean": pytest.approx(60.0), "age_max": 90.0,
    }  # fmt: skip
    assert torch.equal(bank.confidence, confidence_before) and torch.equal(bank.last_touched, touched_before)


class _HostRuleBank:
    """The write rule as it ran on the host before it moved to the device: the reference."""

    def __init__(self, capacity: int, key_dim: int, value_dim: int, rule: WriteRule) -> None:
        self.capacity = capacity
        self.rule = rule
        self.keys = torch.zeros(capacity, key_dim)
        self.values = torch.zeros(capacity, value_dim)
        self.count = 0
        self.head = 0
        self.confidence = torch.ones(capacity, dtype=torch.float32)
        self.last_touched = torch.zeros(capacity, dtype=torch.int64)
        self.counters = [0, 0, 0]  # writes, overwrites, defended

    def write(self, keys: torch.Tensor, values: torch.Tensor, losses: list[float], update: int) -> None:
        rule = self.rule
        slot_of_row: dict[int, int] = {}
        for row, loss in enumerate(losses):
            if not loss > rule.loss_threshold:  # also skips nan
                continue
            if self.count < self.capacity:
                slot = self.count
                self.count += 1
                self.counters[0] += 1
            else:
                slot = self.head
                since = float(update - int(self.last_touched[slot]))
                gain = max((1.0 - math.exp(-since / rule.recovery_updates)) ** 2, rule.min_gain)
                damage = rule.damage_rate * loss * gain
                if float(self.confidence[slot]) > damage:
                    self.confidence[slot] -= damage
                    self.last_touched[slot] = update
                    self.counters[2] += 1
                    continue
                self.head = (self.head + 1) % self.capacity
                self.counters[1] += 1
            self.confidence[slot] = 1.0
            self.last_touched[slot] = update
            slot_of_row = {r: s for r, s in slot_of_row.items() if s != slot}
            slot_of_row[row] = slot
        if not slot_of_row:
            return
        rows = torch.tensor(list(slot_of_row))
        slots = torch.tensor(list(slot_of_row.values()))
        self.keys = self.keys.index_copy(0, slots, keys[rows])
        self.values = self.values.index_copy(0, slots, values[rows])

    def state(self, prefix: str) -> dict[str, torch.Tensor]:
        return {
            f"{prefix}keys": self.keys.clone(), f"{prefix}values": self.values.clone(),
            f"{prefix}confidence": self.confidence.clone(),
            f"{prefix}last_touched": self.last_touched.clone(),
            f"{prefix}count_head": torch.tensor([self.count, self.head]),
            f"{prefix}counters": torch.tensor(self.counters),
        }  # fmt: skip


def _float32_neighbours(threshold: float) -> list[float]:
    """The float32 losses nearest the threshold: at it (rounded) and one step either side."""
    at = torch.tensor(threshold, dtype=torch.float32)
    return [float(v) for v in (at, torch.nextafter(at, at + 1), torch.nextafter(at, at - 1))]


def _random_losses(rnd: random.Random, rows: int, threshold: float) -> torch.Tensor:
    """Float32 chunk losses (what the model passes): around the threshold, nan, below it, mild
    (the head slot tends to resist), large (it tends to be replaced), and beyond 2500 or inf
    (even a slot touched this update is replaced, so one write can replace a slot twice)."""
    kinds = [
        lambda: rnd.choice(_float32_neighbours(threshold)), lambda: float("nan"),
        lambda: rnd.uniform(0.0, 3.5), lambda: rnd.uniform(3.5, 14.0), lambda: rnd.uniform(14.0, 60.0),
        lambda: rnd.choice([rnd.uniform(2500.0, 1e4), float("inf")]),
    ]  # fmt: skip
    weights = [4, 2, 2, 4, 3, 1]
    return torch.tensor([rnd.choices(kinds, weights)[0]() for _ in range(rows)], dtype=torch.float32)


def _random_start(
    rnd: random.Random, generator: torch.Generator, capacity: int, update: int, rule: WriteRule
) -> _HostRuleBank:
    """A reference bank in a state a line can reach or load: any count, head and confidence."""
    bank = _HostRuleBank(capacity, 3, 2, rule)
    bank.keys = torch.rand(capacity, 3, generator=generator)
    bank.values = torch.randn(capacity, 2, generator=generator)
    bank.count = rnd.choice([0, capacity, rnd.randint(0, capacity)])
    bank.head = rnd.randrange(capacity) if bank.count == capacity else 0
    bank.confidence = torch.rand(capacity, generator=generator).clamp_min(1e-3)
    bank.last_touched = torch.randint(0, update + 1, (capacity,), generator=generator)
    bank.counters = [rnd.randint(0, 9) for _ in range(3)]
    return bank


def _assert_same_bank(bank: EpisodicBank, reference: _HostRuleBank) -> None:
    assert (bank.count, bank.head) == (reference.count, reference.head)
    assert list(bank.write_counts.tolist()) == reference.counters
    assert torch.equal(bank.keys, reference.keys) and torch.equal(bank.values, reference.values)
    assert torch.equal(bank.confidence, reference.confidence)
    assert torch.equal(bank.last_touched, reference.last_touched)
    assert torch.equal(bank.occupied, torch.arange(reference.capacity) < reference.count)


@pytest.fixture(params=["native", "pytorch"])
def rule_code(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The CPU write rule in C (`native_memory`, where it is built) or in PyTorch operations."""
    if request.param == "pytorch":
        monkeypatch.setattr(native_memory, "library", lambda: None)
    elif native_memory.library() is None:
        pytest.skip("no C compiler: the native write rule is not built")
    return request.param


@pytest.mark.usefixtures("rule_code")
def test_device_rule_equals_the_host_rule_on_random_chunk_losses() -> None:
    """Several blocks' banks written together (one loss per row for all, each its own keys and
    state) offered random rows, at clocks that stand still or advance, through `writing()` sessions of
    several pieces as a training forward has them: bit for bit the host rule's banks. The
    threshold 3.7 rounds up in float32, so the gate must compare in float64 as the host did."""
    outcomes = torch.zeros(3, dtype=torch.int64)  # writes, overwrites, defended over all trials
    for trial in range(60):
        rnd = random.Random(trial)
        generator = torch.Generator().manual_seed(trial)
        capacity = rnd.randint(1, 6)
        update = rnd.randint(0, 100)
        rule = WriteRule(loss_threshold=rnd.choice([3.5, 3.7]))
        references = [_random_start(rnd, generator, capacity, update, rule) for _ in range(3)]
        banks = [EpisodicBank(capacity, 3, 2, rule) for _ in references]
        for bank, reference in zip(banks, references):
            bank.load_state(reference.state("b."), "b.")
            outcomes -= bank.write_counts
        for _ in range(rnd.randint(1, 8)):  # forwards
            with contextlib.ExitStack() as sessions:
                for bank in banks:
                    sessions.enter_context(bank.writing())
                for _ in range(rnd.randint(1, 3)):  # pieces of one forward
                    rows = rnd.randint(0, 6)
                    losses = _random_losses(rnd, rows, rule.loss_threshold)
                    keys = torch.rand(len(banks), rows, 3, generator=generator)
                    values = torch.randn(len(banks), rows, 2, generator=generator)
                    write_banks(banks, keys, values, losses, torch.tensor([update]))
                    host_losses = [float(v) for v in losses.tolist()]
                    for index, reference in enumerate(references):
                        reference.write(keys[index], values[index], host_losses, update)
            for bank, reference in zip(banks, references):
                _assert_same_bank(bank, reference)
            update += rnd.choice([0, 0, 1, 2, 10, 60, 300])
        outcomes += sum(bank.write_counts for bank in banks)
    assert (outcomes > 20).all(), outcomes  # every branch of the rule was taken, many times


@pytest.mark.usefixtures("rule_code")
def test_confidence_is_compared_with_the_damage_in_float64() -> None:
    """A float32 confidence equal to the damage rounded to float32, but above the float64
    damage: the host rule let the slot resist (paying the damage down to 0), so must the device."""
    confidence = torch.tensor(0.08 * 5.0, dtype=torch.float32)  # rounds 0.4 up
    assert float(confidence) > 0.08 * 5.0
    bank, reference = _bank(capacity=1), _HostRuleBank(1, 3, 2, WriteRule())
    for target in (bank, reference):
        target.write(torch.zeros(1, 3), torch.ones(1, 2), [4.0], 0)
        target.confidence[0] = confidence
        # 100000 updates later the gain is exactly 1: damage = 0.08 * 5.
        target.write(torch.ones(1, 3), torch.zeros(1, 2), [5.0], 100_000)
    _assert_same_bank(bank, reference)
    assert bank.counters.defended == 1 and float(bank.confidence[0]) == 0.0


def test_native_dream_record_equals_pytorch_s() -> None:
    """The C record leaves the ring (its `capacity` slots and the count) as the tensor operations
    do: rows gated in order, nan never, a piece with more gated rows than the ring holds keeping
    its newest, short pieces padded, rows of a strided view."""
    lib = native_memory.library()
    if lib is None:
        pytest.skip("no C compiler: the native record is not built")
    rnd = random.Random(5)
    capacity, chunk_len, threshold = 5, 4, 3.5
    rings = [PendingDreams(capacity, chunk_len, threshold) for _ in range(2)]
    for piece in range(60):
        rows, length = rnd.choice([1, 3, 8]), rnd.choice([chunk_len, 2])
        both = torch.randint(0, 50, (rows, length + 1))
        tokens, targets = both[:, :-1], both[:, 1:]
        losses = _random_losses(rnd, rows, threshold)
        rings[0].record(tokens, targets, losses)
        rings[1].torch_record(tokens, targets, losses)
        for name in ("tokens", "targets"):
            assert torch.equal(getattr(rings[0], name)[:capacity], getattr(rings[1], name)[:capacity]), name
        assert torch.equal(rings[0].recorded, rings[1].recorded)
        if piece % 9 == 8:
            for ring in rings:
                ring.drain()
