"""The disk a line's checkpoints take: one checkpoint's size, what retention keeps over the line's
life, and whether a start has room for its next checkpoint.

Torch-free: the callers count the parameters (the trainer its model, `nsconsole check` and `new`
the model built on the meta device). A checkpoint's size is measured on the newest one when the
line has one (the next is as large), else estimated: fp32 weights, the two AdamW moments and the
average when one is kept, plus the tokenizer every checkpoint carries. What retention keeps
(`engine.checkpoints.format.apply_retention`): the line's start, every stage end (of the stages
that end on their tokens: an open-ended one ends at the data line's last cycle end), the newest
`keep_last` rolling ones, one more while a write is under way, and the cycle ends -- every one
unless `checkpoints.keep_cycle_ends` bounds them, so an open-ended trunk grows by one checkpoint a
cycle.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass
from pathlib import Path

from engine.checkpoints.format import CHECKPOINT_DISK_MARGIN, list_checkpoints
from engine.config.run import RunConfig
from engine.errors import DiskFull
from engine.models import presets
from engine.models.memory_budget import saved_buffer_bytes
from engine.units import GIB

FP32_BYTES = 4
"""Bytes of one fp32 value: weights, moments and the average are saved in fp32."""


@dataclass(frozen=True)
class CheckpointSize:
    """The size on disk of the line's next checkpoint and how it was found."""

    bytes: int
    """The size in bytes."""
    basis: str
    """`measured on u<N>` or `estimated: <parameters> x <bytes> (...) + the tokenizer`."""

    @property
    def text(self) -> str:
        return gib_text(self.bytes)


def gib_text(nbytes: float) -> str:
    """Free disk or a size in GiB to three significant digits (a tiny line's checkpoint is not
    `0.00 GiB`, and 21 MiB free is `0.0205 GiB`, not `0.0 GiB`), whole GiB from 1000 on, where three
    significant digits would need an exponent (`1,862 GiB`, not `1.86e+03 GiB`)."""
    gib = nbytes / GIB
    return f"{gib:,.0f} GiB" if gib >= 1000 else f"{gib:.3g} GiB"


def next_checkpoint_size(
    newest: Path | None, config: RunConfig, parameters: int, tokenizer_bytes: int
) -> CheckpointSize:
    """The size of `newest`, the checkpoint the line resumes from (`latest`, or the one a start falls
    back to), when it has one, else the estimate from the parameters."""
    if newest is not None:
        measured = sum(path.stat().st_size for path in newest.iterdir() if path.is_file())
        return CheckpointSize(measured, f"measured on {newest.name}")
    per_parameter = FP32_BYTES * (4 if config.ema is not None else 3)
    tensors = "fp32 weights, two AdamW moments" + (" and the average" if config.ema is not None else "")
    preset = config.model.preset
    buffers = saved_buffer_bytes(presets.family_of(preset), presets.preset_config(preset, config.model.overrides))
    return CheckpointSize(
        parameters * per_parameter + buffers + tokenizer_bytes,
        f"estimated: {parameters:,} parameters x {per_parameter} bytes ({tensors})"
        + (f" + model buffers {gib_text(buffers)}" if buffers else "") + " + the tokenizer",
    )


def refuse_a_start_without_room(
    root: Path, checkpoints_dir: Path, size: CheckpointSize, resumed_from: int | None
) -> None:
    """Raise DiskFull before a start trains anything when the free disk cannot hold its next
    checkpoint (with the write margin): that start would train until its first checkpoint and
    then stop for the operator, its work lost."""
    free = shutil.disk_usage(checkpoints_dir).free
    if free >= CHECKPOINT_DISK_MARGIN * size.bytes:
        return
    newest = f"the newest is update {resumed_from}" if resumed_from is not None else "none written yet"
    raise DiskFull(
        f"{root}: {gib_text(free)} free on its disk, too little for the next checkpoint "
        f"(about {size.text}, {size.basis}; {CHECKPOINT_DISK_MARGIN:g}x needed); {newest}; "
        "not started; free some space and run the line again"
    )


def planned_cycles(config: RunConfig, cycle_tokens: int, last_cycle: int | None) -> int | None:
    """The data cycles the line trains: its stages' tokens in cycles, or the data line's end when
    that is known; None for an open-ended line on a data line whose end is not known yet."""
    cycles = [last_cycle + 1] if last_cycle is not None else []
    if all(stage.tokens is not None for stage in config.plan):
        cycles.append(math.ceil(sum(stage.tokens or 0 for stage in config.plan) / cycle_tokens))
    return min(cycles) if cycles else None


@dataclass(frozen=True)
class RetentionNeed:
    """The disk the line's checkpoints take at most under its retention settings."""

    size: CheckpointSize
    """One checkpoint."""
    stages: int
    """Stage ends kept: the plan's stages that end on their tokens (an open-ended last stage ends with
    the data line, at a cycle end, which the cycle ends count)."""
    rolling: int
    """Rolling checkpoints kept (`checkpoints.keep_last`)."""
    cycle_ends: int | None
    """Cycle-end checkpoints kept at most; None: one per cycle without bound."""
    cycle_ends_why: str
    """What bounds the cycle ends (`checkpoints.keep_cycle_ends 2`, `3 cycles planned`), or why
    nothing does."""

    @property
    def steady(self) -> int:
        """Checkpoints on disk at once besides the cycle ends: the line's start, the stage ends, the
        rolling ones and the one being written."""
        return 1 + self.stages + self.rolling + 1

    def bytes(self) -> int | None:
        """The whole need in bytes; None when the cycle ends grow without bound."""
        if self.cycle_ends is None:
            return None
        return (self.steady + self.cycle_ends) * self.size.bytes

    def describe(self) -> str:
        """One clause: what is kept and what it takes."""
        stage_ends = f"{self.stages} stage end{'s' if self.stages != 1 else ''}, " if self.stages else ""
        kept = f"the line's start, {stage_ends}{self.rolling} rolling, 1 being written"
        total = self.bytes()
        if total is None:
            return (
                f"retention keeps {self.steady} checkpoints ({kept}) = {gib_text(self.steady * self.size.bytes)}, "
                f"and one at every cycle end: it grows by {self.size.text} per cycle, unbounded "
                f"({self.cycle_ends_why})"
            )
        return (
            f"retention keeps up to {self.steady + self.cycle_ends} checkpoints ({kept}, {self.cycle_ends} "
            f"cycle end{'s' if self.cycle_ends != 1 else ''}: {self.cycle_ends_why}) = {gib_text(total)}"
        )

    def shortfall(self, room: int) -> str | None:
        """What does not fit in `room` bytes (the free disk and what the line's checkpoints take
        now), with what to do; None when the need fits."""
        total = self.bytes()
        if total is not None:
            if total <= room:
                return None
            return (
                f"{gib_text(room)} for checkpoints holds {room // self.size.bytes} of them: "
                "free disk, or lower checkpoints.keep_last or checkpoints.keep_cycle_ends"
            )
        holds = max((room - self.steady * self.size.bytes) // self.size.bytes, 0)
        return (
            f"{gib_text(room)} for checkpoints holds {holds} cycle end{'s' if holds != 1 else ''}: "
            "set checkpoints.keep_cycle_ends to bound them (the newest N stay), or free disk as cycles pass"
        )


def retention_need(
    config: RunConfig, size: CheckpointSize, cycle_tokens: int, last_cycle: int | None
) -> RetentionNeed:
    """What the line's retention keeps on disk at most, for a data line of `cycle_tokens` cycles
    whose last cycle is `last_cycle` (None while unknown)."""
    planned = planned_cycles(config, cycle_tokens, last_cycle)
    bound = config.checkpoints.keep_cycle_ends
    if bound is not None and (planned is None or bound < planned):
        cycle_ends: int | None = bound
        why = f"checkpoints.keep_cycle_ends {bound}"
    elif planned is not None:
        cycle_ends, why = planned, f"{planned} cycle{'s' if planned != 1 else ''} planned"
    else:
        cycle_ends, why = None, "the plan runs until the data line ends, and its last cycle is not known yet"
    stage_ends = sum(1 for stage in config.plan if stage.tokens is not None)
    return RetentionNeed(size, stage_ends, config.checkpoints.keep_last, cycle_ends, why)


def checkpoints_bytes(checkpoints_dir: Path) -> int:
    """What the line's checkpoints take on disk now (they count toward the room retention has)."""
    return sum(
        path.stat().st_size
        for directory in list_checkpoints(checkpoints_dir)
        for path in directory.iterdir()
        if path.is_file()
    )
