"""Cycle planning: which documents of which files each cycle takes, decided from pinned inputs only.

A cycle of C tokens gives source s the budget C x share_s (the shares in force at the cycle's
start). A source's budget is split over its strata by their estimated tokens (file bytes x the
stratum's calibrated text bytes per file byte x tokens per text byte), so every cycle holds
every stratum at its share of the source. A stratum is a stream: its files in pinned order,
each file's training documents in their shuffled order; a cycle takes documents from where the
previous cycle stopped until it has its byte budget, cut at a document end. The overshoot or
shortfall is carried to the stratum's next budget, so shares hold over the whole line.

A plan is a pure function of the previous plan's end state and the pinned inputs; it is written
once (`plans/cNNNN.json`) and never changes, which is what lets `data rebuild` redo a cycle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from datalines.calibration import stratum_shares as stratum_shares_of
from datalines.corpus import DocumentLengths
from datalines.errors import DataLineError, SourceExhausted
from datalines.files import read_json, write_json_atomic

if TYPE_CHECKING:
    from datalines.dataline import DataLine

LAST_CYCLE_MIN_FILL = 0.5
"""In `last_cycle` mode a cycle is the last when what would remain after it is under this part of a budget."""
EXHAUSTED_SHORTFALL = 0.01
"""A stratum whose files end more than this part of a budget short of it has run out (max epochs 1)."""


@dataclass
class StratumCursor:
    """Where a stratum's stream stands: the next document to take and the carried byte budget."""

    file: int
    """Position in the stratum's file list (not the source's file index)."""
    document: int
    """The next training document of that file."""
    carry_bytes: float
    """Budget bytes owed (positive) or overdrawn (negative) from earlier cycles."""

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "document": self.document, "carry_bytes": self.carry_bytes}


def plan_path(line: DataLine, index: int) -> Any:
    return line.path / "plans" / f"c{index:04d}.json"


def load_plan(line: DataLine, index: int) -> dict[str, Any] | None:
    path = plan_path(line, index)
    return read_json(path) if path.exists() else None


def ensure_plan(line: DataLine, index: int) -> dict[str, Any]:
    """The plan of cycle `index`, planning it (and every earlier cycle) first if need be."""
    existing = load_plan(line, index)
    if existing is not None:
        return existing
    previous = ensure_plan(line, index - 1) if index > 0 else None
    if previous is not None and previous["last"]:
        raise DataLineError(f"{line.path}: cycle {index} is past the line's last cycle {index - 1}")
    plan = Planner(line).plan(index, previous)
    write_json_atomic(plan_path(line, index), plan)
    return plan


class Planner:
    def __init__(self, line: DataLine) -> None:
        self.line = line
        self.lengths = {name: DocumentLengths(line.source(name), line.recipe.seed) for name in line.sources}

    def stratum_files(self, source_name: str, stratum: str) -> list[int]:
        files = self.line.source(source_name).files
        return [index for index, file in enumerate(files) if file.stratum == stratum]

    def remaining_bytes(self, source_name: str, stratum: str, cursor: StratumCursor) -> int:
        files = self.stratum_files(source_name, stratum)
        remaining = 0
        for position in range(cursor.file, len(files)):
            lengths = self.lengths[source_name].of(files[position])
            remaining += int(lengths[cursor.document :].sum() if position == cursor.file else lengths.sum())
        return remaining

    def plan(self, index: int, previous: dict[str, Any] | None) -> dict[str, Any]:
        line = self.line
        start_tokens = index * line.cycle_tokens
        shares = line.recipe.shares_at(start_tokens)
        budgets: dict[str, dict[str, float]] = {}
        cursors: dict[str, dict[str, StratumCursor]] = {}
        for name in line.sources:
            stratum_shares = stratum_shares_of(line.source(name), line.calibration[name])
            ends = previous["end"][name] if previous else {}
            cursors[name] = {
                stratum: StratumCursor(**ends[stratum]) if stratum in ends else StratumCursor(0, 0, 0.0)
                for stratum in stratum_shares
            }
            budgets[name] = {}
            for stratum, stratum_share in stratum_shares.items():
                tokens_per_byte = line.calibration[name][stratum]["tokens_per_text_byte"]
                budgets[name][stratum] = line.cycle_tokens * shares[name] * stratum_share / tokens_per_byte
        last = line.recipe.at_corpus_end == "last_cycle" and self._is_last(budgets, cursors)
        plan_sources: dict[str, Any] = {}
        for name in line.sources:
            strata_plan = {}
            for stratum, budget in budgets[name].items():
                cursor = cursors[name][stratum]
                ranges: list[list[int]] = []
                taken = 0
                if budget > 0:  # a source without a share in this piece waits, its carry kept
                    owed = math.inf if last else budget + cursor.carry_bytes
                    ranges, taken = self._take(name, stratum, cursor, owed, index, exhaust_ok=last)
                    cursor.carry_bytes = 0.0 if last else owed - taken
                strata_plan[stratum] = {"budget_bytes": budget, "bytes": taken, "ranges": ranges}
            plan_sources[name] = {"share": shares[name], "strata": strata_plan}
        return {
            "cycle": index,
            "start_tokens": start_tokens,
            "last": last,
            "sources": plan_sources,
            "end": {name: {s: c.to_json() for s, c in strata.items()} for name, strata in cursors.items()},
        }

    def _is_last(
        self, budgets: dict[str, dict[str, float]], cursors: dict[str, dict[str, StratumCursor]]
    ) -> bool:
        """Whether some stratum would be left with less than part of a budget after this cycle."""
        for name, strata in budgets.items():
            for stratum, budget in strata.items():
                if budget <= 0:
                    continue
                cursor = cursors[name][stratum]
                after = self.remaining_bytes(name, stratum, cursor) - (budget + cursor.carry_bytes)
                if after < LAST_CYCLE_MIN_FILL * budget:
                    return True
        return False

    def _take(
        self, name: str, stratum: str, cursor: StratumCursor, owed: float, index: int, exhaust_ok: bool
    ) -> tuple[list[list[int]], int]:
        """Advance the cursor over documents until `owed` bytes are taken; returns ranges and bytes."""
        files = self.stratum_files(name, stratum)
        ranges: list[list[int]] = []
        taken = 0
        while taken < owed:
            if cursor.file < len(files) and cursor.document >= len(self.lengths[name].of(files[cursor.file])):
                cursor.file, cursor.document = cursor.file + 1, 0
                continue
            if cursor.file >= len(files):
                if exhaust_ok or owed - taken <= EXHAUSTED_SHORTFALL * owed:
                    break
                raise SourceExhausted(
                    f"{self.line.path}: source {name} has no untrained documents left for cycle {index} "
                    f"(stratum {stratum} ran out; max epochs 1)"
                )
            lengths = self.lengths[name].of(files[cursor.file])
            cumulative = np.cumsum(lengths[cursor.document :])
            # A document is taken when its middle falls within the budget: the cut lands on the
            # document end nearest the budget, and the difference is carried to the next cycle.
            middles = cumulative - lengths[cursor.document :] / 2
            count = int(np.searchsorted(middles, owed - taken, side="right"))
            if count == 0:
                break
            ranges.append([files[cursor.file], cursor.document, cursor.document + count])
            taken += int(cumulative[count - 1])
            cursor.document += count
        return ranges, taken
