"""The trainer's data position: where a line stands in its plan and its data line.

It is saved in every checkpoint's state.json (`position`) and is an exact resume point: the
update count, the tokens the schedule has seen, the plan stage, the data cycle and the samples of
that cycle consumed at the stage's sequence length. Torch-free, so branch and status read it too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class _CycleStarts(Protocol):
    def cycle_start_tokens(self, index: int) -> int: ...


@dataclass
class Position:
    """Where the line stands after `update` updates."""

    update: int = 0
    """Updates done (finite or skipped)."""
    tokens_trained: int = 0
    """Tokens of the finite updates (the learning-rate schedule's clock)."""
    stage: int = 0
    """Index of the plan stage in progress."""
    stage_tokens: int = 0
    """Tokens consumed by the current stage."""
    cycle: int = 0
    """The data cycle in progress."""
    sample: int = 0
    """Samples of that cycle consumed, at the stage's sequence length."""

    def data_tokens(self, data_line: _CycleStarts, seq_len: int) -> int:
        """The data line's token count here: the cycle's start plus the samples read of it (each
        `seq_len` new tokens). The batch-size ramp (`tokens_per_update`) is read at this count."""
        return data_line.cycle_start_tokens(self.cycle) + self.sample * seq_len
