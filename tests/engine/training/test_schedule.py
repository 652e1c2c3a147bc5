"""Schedules: hand-computed values at and between piece boundaries."""

from __future__ import annotations

import math
from typing import Any

import pytest

from engine.config.run import RunConfig
from engine.training.schedule import learning_rate, tokens_per_update, update_weight_decay


def config_with(**sections: Any) -> RunConfig:
    # Schedules read only their own sections; the preset is never looked up here.
    document = {"model": {"preset": "tiny-test"}, "data": {"line": "/d"}, **sections}
    return RunConfig.from_dict(document)


WSD = {
    "peak": 1e-3,
    "pieces": [
        {"kind": "warmup", "until": 100},
        {"kind": "constant", "until": 1000},
        {"kind": "decay", "until": 2000, "to": 0.1, "shape": "linear"},
        {"kind": "constant", "to": 0.1},
    ],
}


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [
        (0, 0.0),
        (25, 0.25e-3),
        (100, 1e-3),  # a boundary belongs to the next piece, which starts where the last ended
        (999.5, 1e-3),
        (1000, 1e-3),
        (1500, 0.55e-3),  # halfway from 1.0 to 0.1
        (2000, 1e-4),
        (1e12, 1e-4),
    ],
)
def test_warmup_constant_linear_decay(tokens: float, expected: float) -> None:
    assert learning_rate(config_with(lr=WSD), tokens) == pytest.approx(expected, rel=1e-12, abs=1e-18)


@pytest.mark.parametrize(
    ("shape", "quarter"),
    [
        ("linear", 1.0 - 0.75 * 0.25),
        ("cosine", 0.25 + 0.75 * 0.5 * (1 + math.cos(math.pi / 4))),
        ("sqrt", 0.25 + 0.75 * (1 - math.sqrt(0.25))),
    ],
)
def test_decay_shapes(shape: str, quarter: float) -> None:
    lr = {"peak": 2.0, "pieces": [{"kind": "decay", "until": 400, "to": 0.25, "shape": shape}]}
    config = config_with(lr=lr)
    assert learning_rate(config, 0) == pytest.approx(2.0)  # a first decay starts at the peak
    assert learning_rate(config, 100) == pytest.approx(2.0 * quarter)
    assert learning_rate(config, 400) == pytest.approx(0.5)
    assert learning_rate(config, 10_000) == pytest.approx(0.5)  # past a closed last piece: held


def test_warmup_after_decay_starts_from_the_decayed_rate() -> None:
    lr = {"peak": 1.0, "pieces": [{"kind": "decay", "until": 10, "to": 0.2, "shape": "cosine"},
                                  {"kind": "warmup", "until": 20, "to": 0.6}]}
    config = config_with(lr=lr)
    assert learning_rate(config, 10) == pytest.approx(0.2)
    assert learning_rate(config, 15) == pytest.approx(0.4)
    assert learning_rate(config, 20) == pytest.approx(0.6)


RAMP = [
    {"from": 0, "to": 4.7e9, "tokens": 262144},
    {"from": 4.7e9, "to": 9e9, "tokens": 393216},
    {"from": 9e9, "to": None, "tokens": 524288},
]


@pytest.mark.parametrize(
    ("data_tokens", "expected"),
    [(0, 262144), (4.7e9 - 1, 262144), (4.7e9, 393216), (8.99e9, 393216), (9e9, 524288), (1e15, 524288)],
)
def test_ramp_is_read_at_the_data_lines_token_count(data_tokens: float, expected: int) -> None:
    assert tokens_per_update(config_with(tokens_per_update=RAMP), data_tokens) == expected


def test_single_number_and_closed_last_piece() -> None:
    assert tokens_per_update(config_with(tokens_per_update=8192), 1e12) == 8192
    closed = [{"from": 0, "to": 100, "tokens": 64}]
    assert tokens_per_update(config_with(tokens_per_update=closed), 500) == 64


def test_weight_decay_follows_the_batch() -> None:
    plain = config_with(optimizer={"weight_decay": 0.1})
    assert update_weight_decay(plain, 393216) == 0.1
    scaled = config_with(optimizer={"weight_decay": 0.1, "weight_decay_batch": 1048576})
    assert update_weight_decay(scaled, 1048576) == pytest.approx(0.1)
    assert update_weight_decay(scaled, 262144) == pytest.approx(0.025)
    assert update_weight_decay(scaled, 393216) == pytest.approx(0.0375)
