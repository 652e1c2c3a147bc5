"""The trainer's data position: where a line stands in its plan and its data line.

It is saved in every checkpoint's state.json (`position`) and is an exact resume point: the
update count, the tokens the schedule has seen, the plan stage, the data cycle and the samples of
that cycle consumed at the stage's sequence length. Torch-free, so branch and status read it too.

A stage that changes the sequence length inside a cycle keeps what the cycle read at the old
length (`earlier`) and reads the rest of it as a relay at the new one (datalines.relay), from its
first sample: every target of the cycle is trained once. A checkpoint written before `earlier`
existed has none, which is what it meant then.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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
    """Samples of that cycle consumed, at the stage's sequence length (of the relay, after `earlier`)."""
    earlier: list[list[int]] = field(default_factory=list)
    """The cycle's reads at earlier stages' lengths, oldest first: [seq_len, samples] each (empty:
    the stage's order is the cycle's own)."""

    def reads(self) -> tuple[tuple[int, int], ...]:
        """`earlier` as the data line's readers take it (datalines.cycle.Reads)."""
        return tuple((int(seq_len), int(samples)) for seq_len, samples in self.earlier)

    def change_length(self, old: int, new: int) -> bool:
        """A stage change from `old` to `new` tokens a sample inside the cycle: what was read at
        `old` joins `earlier` and the new length starts on the relay of the rest (True: it did)."""
        if new == old or self.sample == 0:
            return False  # the same order goes on, or the new length's replaces one not yet read
        self.earlier.append([old, self.sample])
        self.sample = 0
        return True

    def next_cycle(self) -> None:
        """The cycle ended: the next one, from its first sample at the stage's length."""
        self.cycle += 1
        self.sample = 0
        self.earlier = []

    def data_tokens(self, data_line: _CycleStarts, seq_len: int) -> int:
        """The data line's token count here: the cycle's start plus the tokens read of it (each
        sample `seq_len` new tokens, at its own length for the earlier reads). The batch-size ramp
        (`tokens_per_update`) is read at this count."""
        before = sum(length * samples for length, samples in self.reads())
        return data_line.cycle_start_tokens(self.cycle) + before + self.sample * seq_len
