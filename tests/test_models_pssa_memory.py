"""PSSA episodic memory: the map into the Poincare ball, the read's gradient, the write rule."""

from __future__ import annotations

import math

import pytest
import torch

from engine.models.pssa_memory import MAX_BALL_RADIUS, EpisodicBank, WriteRule, to_poincare_ball


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
    bank.counters.overwrites, bank.counters.defended = 7, 11
    confidence_before, touched_before = bank.confidence.clone(), bank.last_touched.clone()
    readings = bank.readings(update=100)
    assert readings == {
        "occupancy": 0.75, "writes": 3.0, "overwrites": 7.0, "defended": 11.0,
        "confidence_mean": pytest.approx(1.75 / 3), "confidence_min": 0.25,
        "age_mean": pytest.approx(60.0), "age_max": 90.0,
    }  # fmt: skip
    assert torch.equal(bank.confidence, confidence_before) and torch.equal(bank.last_touched, touched_before)
