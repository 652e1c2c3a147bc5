"""Disk retention: `checkpoints.keep_cycle_ends` bounds the kept cycle ends; one checkpoint's size
(estimated before the first, measured after); what retention keeps over a line's life."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_checkpoints import make_snapshot

from engine.checkpoints.disk_budget import (
    CheckpointSize,
    next_checkpoint_size,
    planned_cycles,
    retention_need,
)
from engine.checkpoints.format import (
    BRANCH_START_KEPT,
    LINE_START_KEPT,
    apply_retention,
    cycle_end_kept,
    list_checkpoints,
    pin_checkpoint,
    stage_end_kept,
)
from engine.checkpoints.tensors import CheckpointWriter
from engine.config.run import EMAConfig, RunConfig, StageConfig
from engine.errors import ConfigError
from engine.units import GIB


def config(**checkpoints: int | None) -> RunConfig:
    document = {"model": {"preset": "transformer-tiny"}, "data": {"line": "data"}, "checkpoints": checkpoints}
    loaded = RunConfig.from_dict(document)
    loaded.validate()
    return loaded


def names(checkpoints_dir: Path) -> list[int]:
    return [int(path.name[1:]) for path in list_checkpoints(checkpoints_dir)]


def test_keep_cycle_ends_keeps_the_newest_cycle_ends_and_every_other_kept_one(tmp_path: Path) -> None:
    # Cycle ends at 2, 4, 6, 8; the line's start and a stage end are never removed by the bound.
    kept = {0: LINE_START_KEPT, 2: cycle_end_kept(0), 4: cycle_end_kept(1), 5: stage_end_kept("trunk"),
            6: cycle_end_kept(2), 8: cycle_end_kept(3)}  # fmt: skip
    writer = CheckpointWriter(tmp_path, keep_last=1, keep_cycle_ends=2)
    for update in range(10):
        writer.save(make_snapshot(update, kept=kept.get(update)))
    writer.wait()
    assert names(tmp_path) == [0, 5, 6, 8, 9]


def test_without_keep_cycle_ends_every_cycle_end_stays(tmp_path: Path) -> None:
    writer = CheckpointWriter(tmp_path, keep_last=1)
    for update in range(8):
        writer.save(make_snapshot(update, kept=cycle_end_kept(update) if update % 2 else BRANCH_START_KEPT))
    writer.wait()
    assert names(tmp_path) == list(range(8))


def test_keep_cycle_ends_spares_latest_and_pinned(tmp_path: Path) -> None:
    for update in range(1, 5):
        CheckpointWriter(tmp_path, keep_last=1).save_and_wait(make_snapshot(update, kept=cycle_end_kept(update)))
    pin_checkpoint(tmp_path, "u00000001")  # a rollback's target
    (tmp_path / "latest").write_text("u00000002\n")  # resumed from an older cycle end
    assert apply_retention(tmp_path, keep_last=1, keep_cycle_ends=1) == ["u00000003"]
    assert names(tmp_path) == [1, 2, 4]


def test_keep_cycle_ends_must_be_at_least_one() -> None:
    assert config(keep_cycle_ends=3).checkpoints.keep_cycle_ends == 3
    assert config().checkpoints.keep_cycle_ends is None  # the spec's rule: every cycle end stays
    with pytest.raises(ConfigError, match=r"^run.json: checkpoints.keep_cycle_ends must be at least 1, got 0$"):
        config(keep_cycle_ends=0)


def test_the_size_is_estimated_before_the_first_checkpoint_and_measured_after(tmp_path: Path) -> None:
    plain, averaged = config(), config()
    averaged.ema = EMAConfig(horizon_tokens=1e9)
    size = next_checkpoint_size(None, plain, 1000, 300)
    assert size.bytes == 1000 * 12 + 300
    assert size.basis == "estimated: 1,000 parameters x 12 bytes (fp32 weights, two AdamW moments) + the tokenizer"
    assert next_checkpoint_size(None, averaged, 1000, 300).bytes == 1000 * 16 + 300
    written = CheckpointWriter(tmp_path, keep_last=1).save_and_wait(make_snapshot(3))
    measured = next_checkpoint_size(written, plain, 1000, 300)
    assert measured.basis == "measured on u00000003"
    assert measured.bytes == sum(path.stat().st_size for path in written.iterdir())


def test_a_pssa_line_s_first_checkpoint_counts_its_banks_and_dreaming_cache(tmp_path: Path) -> None:
    """A bank of a million slots is GiBs on disk that no parameter counts: the estimate before the
    first checkpoint (the start's room check, `check`'s disk line) holds it."""
    document = {"model": {"preset": "pssa-1.5m", "overrides": {"mem_capacity": 10**6}}, "data": {"line": "data"}}
    line = RunConfig.from_dict(document)
    line.validate()
    size = next_checkpoint_size(None, line, 1000, 300)
    banks = 10**6 * (4 * (32 + 256) + 20)  # one block: fp32 keys and values, 20 bytes of rule state
    dreams = (10**6 + 1) * 64 * 2 * 8  # the dreaming cache: int64 tokens and targets of each chunk
    assert size.bytes == 1000 * 12 + banks + dreams + 300
    assert " + model buffers 2.05 GiB + the tokenizer" in size.basis


def test_cycles_planned_come_from_the_stages_or_the_data_lines_end() -> None:
    line = config()
    assert planned_cycles(line, 1000, None) is None  # open-ended trunk, end of data unknown
    assert planned_cycles(line, 1000, 4) == 5
    line.plan = [StageConfig("trunk", 32, 2500.0)]
    assert planned_cycles(line, 1000, None) == 3
    assert planned_cycles(line, 1000, 1) == 2  # the data line ends first


GIB_CHECKPOINT = CheckpointSize(GIB, "measured on u00000001")


def test_an_open_ended_trunk_grows_by_a_checkpoint_per_cycle_and_says_how_to_bound_it() -> None:
    need = retention_need(config(keep_last=2), GIB_CHECKPOINT, 1000, None)
    assert need.bytes() is None
    # No stage end: the open-ended trunk ends with its data line, at a cycle end (found in the disk
    # walkthrough: "1 stage end" counted a checkpoint no trunk ever holds, 14.6 GiB for ns-1p3b).
    assert need.describe() == (
        "retention keeps 4 checkpoints (the line's start, 2 rolling, 1 being written) = 4 GiB, "
        "and one at every cycle end: it grows by 1 GiB per cycle, unbounded (the plan runs until the data "
        "line ends, and its last cycle is not known yet)"
    )
    assert need.shortfall(8 * GIB) == (
        "8 GiB for checkpoints holds 4 cycle ends: set checkpoints.keep_cycle_ends to bound them "
        "(the newest N stay), or free disk as cycles pass"
    )


def test_only_stages_that_end_on_their_tokens_keep_a_stage_end() -> None:
    line = config(keep_last=2)
    line.plan = [StageConfig("decay", 32, 1000.0), StageConfig("long", 64, 1000.0)]
    need = retention_need(line, GIB_CHECKPOINT, 1000, None)
    assert need.stages == 2 and need.describe().startswith(
        "retention keeps up to 8 checkpoints (the line's start, 2 stage ends, 2 rolling, 1 being written, "
        "2 cycle ends: 2 cycles planned) = 8 GiB")
    line.plan = [StageConfig("decay", 32, 1000.0), StageConfig("trunk", 32, None)]
    assert retention_need(line, GIB_CHECKPOINT, 1000, 4).stages == 1


def test_keep_cycle_ends_bounds_the_need() -> None:
    need = retention_need(config(keep_last=2, keep_cycle_ends=3), GIB_CHECKPOINT, 1000, None)
    assert need.bytes() == 7 * GIB
    assert need.describe().endswith("3 cycle ends: checkpoints.keep_cycle_ends 3) = 7 GiB")
    assert need.shortfall(7 * GIB) is None
    assert need.shortfall(6 * GIB) == (
        "6 GiB for checkpoints holds 6 of them: free disk, or lower checkpoints.keep_last or "
        "checkpoints.keep_cycle_ends"
    )
    # A bound above the cycles planned changes nothing: the plan bounds them.
    planned = retention_need(config(keep_cycle_ends=30), GIB_CHECKPOINT, 1000, 1)
    assert planned.cycle_ends == 2 and planned.cycle_ends_why == "2 cycles planned"
