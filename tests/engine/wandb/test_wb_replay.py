"""Comparing a replayed row with the server's copy: values as W&B hands them back."""

from __future__ import annotations

import pytest

from engine.wandb.replay import ReplayWindow, same_value
from engine.wandb.state import ReplayMismatch


@pytest.mark.parametrize(
    ("line", "server"),
    [
        (2.0, 2),  # an integral float comes back from W&B as an integer
        (float("nan"), float("nan")),
        (float("inf"), float("inf")),
        ({"a": [1, 0.5]}, {"a": [1, 0.5]}),
        ((1, 2), [1, 2]),
        ("trunk", "trunk"),
        (None, None),
    ],
)
def test_values_w_and_b_hands_back_unchanged_are_the_same(line: object, server: object) -> None:
    assert same_value(line, server)


@pytest.mark.parametrize(
    ("line", "server"),
    [(2.5, 2.4999999999999996), (True, 1), (False, 0), ({"a": 1}, {"a": 1, "b": 2}), ([1], [1, 2]), ("a", None)],
)
def test_any_other_difference_counts(line: object, server: object) -> None:
    assert not same_value(line, server)


def test_how_an_update_ran_is_not_compared_and_a_missing_key_is() -> None:
    window = ReplayWindow(after=4, through=6, server_rows={5: {"loss": 1.5, "time": 1.0, "tokens_per_s": 9.0}})
    replayed = {"loss": 1.5, "time": 2.0, "tokens_per_s": 3.0, "gpu_mode": "shared", "grad_norm": 0.1}
    assert window.compare(5, replayed) == [ReplayMismatch(5, "grad_norm", "0.1", "absent")]
    assert window.compare(6, {"loss": 1.0}) == [ReplayMismatch(6, "(row)", "present", "missing")]
    assert window.covers(6) and not window.covers(4) and not window.covers(7)
