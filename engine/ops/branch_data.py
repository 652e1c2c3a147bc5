"""How far a data line goes, for a branch: the trunk's last cycle (a fork point past it never
comes) and the tokens the branch's own data line holds (a plan longer than them runs out of data).

Both are asked when the branch is asked for, possibly weeks before the trunk's preparer plans the
last cycle. What is known then:

- once planning has reached the corpus end (`DataLine.last_cycle`; the demo's `data init
  --embedded` plans every cycle at once), the last cycle exactly, and each cycle's tokens: exact
  for a prepared cycle (its manifest), the plan's estimate for one only planned;
- before that, an estimate from what `data init` pinned: each file's size, each stratum's
  calibrated text bytes per file byte and tokens per text byte, the held-out fraction, where the
  last plan left each stratum, and the schedule as it stands. The cycles are walked as the planner
  takes them (each source `cycle_tokens x share` a cycle; `last_cycle`: the cycle after which a
  source would have less than half its target left is the last and takes the rest; `error`: the
  last cycle is the last that every source can fill).

Not knowable exactly before the last cycle is planned: a document's tokens are known only once it
is tokenized (the calibration measured the first files of each stratum), a hub parquet file's text
only once it is downloaded, and `data schedule` may append shares that move the end. So a fork
point is refused only when it lies past the estimated end even with `ESTIMATE_MARGIN` more tokens
than estimated (one within it is queued and, should its cycle not come, failed at the trunk's end
as before), while a plan is refused past the estimate itself: a plan is shortened at no cost,
and a branch that runs out of data ends before its decay does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from datalines.errors import DataLineError
from datalines.manifest import MANIFEST_NAME, load_manifest
from datalines.planning import EXHAUSTED_SHORTFALL, LAST_CYCLE_MIN_FILL, load_plan, plan_path
from engine.errors import LineError

if TYPE_CHECKING:
    from datalines import DataLine
    from engine.config.run import StageConfig

ESTIMATE_MARGIN = 0.1
"""Part of a data line's estimated tokens it may hold beyond the estimate (calibration error)."""
ESTIMATED = "estimated from its files' pinned sizes, calibration and schedule: its last cycle is not planned yet"


@dataclass(frozen=True)
class Cycles:
    """`count` consecutive cycles, each with `tokens` of each source."""

    count: int
    tokens: dict[str, float]


@dataclass(frozen=True)
class DataExtent:
    """A data line's cycles 0 to `last_cycle`, exactly (`known`) or as estimated."""

    path: Path
    last_cycle: int
    known: bool
    planned: int
    """Cycles 0 to planned - 1 are planned (their tokens are read from their manifests or plans)."""
    unplanned: list[Cycles]
    """The cycles after them, as estimated."""

    def rows_tokens(self, line: DataLine, row_len: int) -> int:
        """Tokens in whole rows of `row_len` targets: a row reads row_len + 1 tokens of one source, so
        each cycle's source keeps its first token and a tail shorter than a row unread."""
        planned = [Cycles(1, _cycle_tokens(line, index)) for index in range(self.planned)]
        rows = sum(
            block.count * sum(max(0, math.floor((tokens - 1) / row_len)) for tokens in block.tokens.values())
            for block in planned + self.unplanned
        )
        return rows * row_len


def data_extent(line: DataLine, surplus: float = 0.0) -> DataExtent:
    """The line's cycles (module docstring); `surplus`: the part of its unplanned tokens it is taken
    to hold beyond the estimate."""
    last_known = line.last_cycle()
    planned = _planned_cycles(line)
    if last_known is not None:
        return DataExtent(line.path, last_known, True, planned, [])
    last, estimated = _walk_unplanned(line, planned, _tokens_left(line, planned, surplus))
    # The planner found the last plan not last: in `last_cycle` mode one more cycle comes for sure.
    floor = planned if line.recipe.at_corpus_end == "last_cycle" else planned - 1
    if last < floor:
        last, estimated = floor, [Cycles(floor - planned + 1, {name: 0.0 for name in line.sources})]
    return DataExtent(line.path, last, False, planned, estimated)


def check_fork_cycle(trunk_data: DataLine, cycle: int) -> None:
    """Refuse a fork at the end of a cycle past the trunk's data line's last one (LineError)."""
    extent = data_extent(trunk_data)
    if extent.known:
        if cycle > extent.last_cycle:
            raise LineError(
                f"{trunk_data.path}: the trunk's data line has {_cycles(extent.last_cycle)}, so cycle {cycle} "
                f"never ends on it; the last cycle a branch can fork at is {extent.last_cycle}"
            )
        return
    bound = data_extent(trunk_data, ESTIMATE_MARGIN).last_cycle
    if cycle > bound:
        raise LineError(
            f"{trunk_data.path}: the trunk's data line will have about {_cycles(extent.last_cycle, ESTIMATED)}, "
            f"and at most {bound + 1} even with {ESTIMATE_MARGIN:.0%} more tokens than estimated, so cycle {cycle} "
            f"never ends on it; the last cycle a branch can fork at is about {extent.last_cycle}"
        )


def check_plan_fits(data: DataLine, stages: list[StageConfig]) -> None:
    """Refuse a plan that trains more tokens than the branch's data line holds (LineError): its
    trainer would stop where the data ends, before the plan (and its decay) does. The branch reads
    the data line from cycle 0; counted in rows of the plan's longest length (the fewest)."""
    plan_tokens = int(sum(stage.tokens or 0 for stage in stages))
    row_len = max(stage.seq_len for stage in stages)
    extent = data_extent(data)
    held = extent.rows_tokens(data, row_len)
    if plan_tokens <= held:
        return
    about = "" if extent.known else "about "
    how = "" if extent.known else ESTIMATED
    stage_tokens = ", ".join(f"{stage.name} {int(stage.tokens or 0):,}" for stage in stages)
    raise LineError(
        f"{data.path}: the branch's plan trains {plan_tokens:,} tokens ({stage_tokens}) but its data line "
        f"holds {about}{held:,} tokens to train in rows of {row_len} in {_cycles(extent.last_cycle, how)}, "
        f"{plan_tokens - held:,} too few; shorten the plan or give the branch a larger data line"
    )


def _cycles(last: int, note: str = "") -> str:
    """`4 cycles (0 to 3)`, with `note` inside the parentheses."""
    if last < 0:
        return f"no cycle ({note})" if note else "no cycle"
    return f"{last + 1} cycle{'' if last == 0 else 's'} (0 to {last}{'; ' + note if note else ''})"


def _planned_cycles(line: DataLine) -> int:
    """Cycles planned so far (plans are made in order, from cycle 0)."""
    planned = 0
    while plan_path(line, planned).is_file():
        planned += 1
    return planned


def _cycle_tokens(line: DataLine, index: int) -> dict[str, float]:
    """A planned cycle's tokens by source: its manifest's where it is prepared, else its plan's estimate."""
    directory = line.cycle_dir(index)
    if (directory / MANIFEST_NAME).is_file():
        try:
            manifest, _sha256 = load_manifest(directory)
            return {name: float(source["tokens"]) for name, source in manifest["sources"].items()}
        except (DataLineError, KeyError, TypeError):
            pass  # a damaged manifest: its plan says as much
    plan = load_plan(line, index) or {"sources": {}}
    return {name: float(source["planned_tokens"]) for name, source in plan["sources"].items()}


def _tokens_left(line: DataLine, planned: int, surplus: float) -> dict[str, float]:
    """Each source's estimated training tokens not taken by the planned cycles: its files' pinned
    sizes at the calibrated rates, less the held-out part, less what the last plan's cursors took."""
    previous = load_plan(line, planned - 1) if planned else None
    left: dict[str, float] = {}
    for name in line.sources:
        rates = line.calibration[name]
        spec = line.recipe.source(name)
        total = sum(
            file.size * rates[file.stratum]["text_bytes_per_file_byte"] * rates[file.stratum]["tokens_per_text_byte"]
            for file in line.source(name).files
            if file.stratum in rates
        )
        ends = previous["end"].get(name, {}) if previous else {}
        taken = sum(end["taken_bytes"] * rates[stratum]["tokens_per_text_byte"]
                    for stratum, end in ends.items() if stratum in rates)  # fmt: skip
        left[name] = total * (1 - spec.heldout_fraction) * (1 + surplus) - taken
    return left


def _walk_unplanned(line: DataLine, start: int, left: dict[str, float]) -> tuple[int, list[Cycles]]:
    """The last cycle and the cycles from `start` to it, walked as the planner would take them with
    `left` tokens of each source; a stretch of the schedule at a time (a line may have millions of cycles)."""
    size = line.cycle_tokens
    firsts = (math.ceil(piece.from_tokens / size) for piece in line.recipe.schedule)
    starts = sorted({start} | {first for first in firsts if first > start})
    ends: list[float] = [*starts[1:], math.inf]  # the schedule's last stretch never ends
    walked: list[Cycles] = []
    for first, end in zip(starts, ends, strict=True):
        targets = {name: size * share for name, share in line.shares(first * size).items() if share > 0}
        if any(left[name] <= 0 for name in targets):
            return first - 1, walked  # a source with a share has nothing for this cycle
        if line.recipe.at_corpus_end == "last_cycle":
            # The k-th cycle is the last when a source has less than 1.5 targets before it.
            reach = 1 + LAST_CYCLE_MIN_FILL
            count = min(max(0, math.floor(left[name] / target - reach) + 1) for name, target in targets.items())
            if first + count < end:
                rest = {name: left[name] - count * target for name, target in targets.items()}
                return first + count, [*walked, Cycles(count, targets), Cycles(1, rest)]
        else:
            # The k-th cycle is planned while every source has nearly a target left before it.
            reach = 1 - EXHAUSTED_SHORTFALL
            count = min(max(0, math.floor(left[name] / target - reach) + 1) for name, target in targets.items())
            if first + count < end:
                return first + count - 1, [*walked, Cycles(count, targets)]
        count = int(end) - first
        walked.append(Cycles(count, targets))
        left = {name: left[name] - count * targets.get(name, 0.0) for name in left}
    raise AssertionError("the last stretch of the schedule, which never ends, returned")
