"""Replayed updates against the server's copy: a resumed line must train again exactly what W&B has.

A trainer killed after W&B received rows past its last checkpoint trains those updates again
after the resume ("replayed updates"). The server keeps the rows it has (a step not above the
run's last one is dropped), so sending them again would hide any difference. Instead each
replayed row is compared with the server's row at that step, value by value; a difference is a
`ReplayMismatch` for wandb_run.json and run.log, never a silent second send.

Only what the update computed is compared: the keys that describe when and where it ran (its
wall-clock time, its speed, the GPU mode it ran in) differ in a replay by nature. Values are
compared as W&B hands them back: numbers as numbers (an integral float comes back as
an integer), NaN equal to NaN, nested objects key by key.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from engine.wandb.state import ReplayMismatch

CIRCUMSTANTIAL_KEYS = frozenset({"time", "tokens_per_s", "gpu_mode"})
"""Row keys that say how an update ran, not what it computed (engine.training.trainer's rows)."""
WHOLE_ROW = "(row)"
"""The metric name of a mismatch where the server has no row at all at that step."""


@dataclass
class ReplayWindow:
    """The server's rows at the steps a resume may train again: `after < step <= through`."""

    after: int
    through: int
    server_rows: dict[int, dict[str, Any]]

    def covers(self, update: int) -> bool:
        return self.after < update <= self.through

    def compare(self, update: int, values: dict[str, Any]) -> list[ReplayMismatch]:
        """Compare a replayed row's values (without `update`) with the server's row at `update`."""
        server = self.server_rows.pop(update, None)
        if server is None:
            return [ReplayMismatch(update=update, metric=WHOLE_ROW, line_value="present", server_value="missing")]
        mismatches = []
        for metric in sorted((set(values) | set(server)) - CIRCUMSTANTIAL_KEYS):
            line_value, server_value = values.get(metric, _ABSENT), server.get(metric, _ABSENT)
            if not same_value(line_value, server_value):
                mismatches.append(ReplayMismatch(update, metric, _text(line_value), _text(server_value)))
        return mismatches


class _Absent:
    """A metric one side does not have."""

    def __repr__(self) -> str:
        return "absent"


_ABSENT = _Absent()


def same_value(line: Any, server: Any) -> bool:
    """Whether a value of rows.jsonl and the server's value for it are the same."""
    if isinstance(line, bool) or isinstance(server, bool):
        return line is server
    if isinstance(line, (int, float)) and isinstance(server, (int, float)):
        if isinstance(line, float) and isinstance(server, float) and math.isnan(line) and math.isnan(server):
            return True
        return line == server
    if isinstance(line, dict) and isinstance(server, dict):
        return line.keys() == server.keys() and all(same_value(line[key], server[key]) for key in line)
    if isinstance(line, (list, tuple)) and isinstance(server, (list, tuple)):
        return len(line) == len(server) and all(same_value(a, b) for a, b in zip(line, server))
    return line == server


def _text(value: Any) -> str:
    return repr(value) if value is _ABSENT else json.dumps(value, sort_keys=True)


def describe(run_id: str | None, mismatches: list[ReplayMismatch]) -> str:
    """One run.log line for one replayed update whose row differs from the server's."""
    update = mismatches[0].update
    if mismatches[0].metric == WHOLE_ROW:
        differences = "the server has no row at that step"
    else:
        differences = "; ".join(
            f"{item.metric} {item.line_value} here, {item.server_value} on W&B" for item in mismatches
        )
    return f"W&B: replayed update {update} differs from run {run_id}'s copy on the server: {differences} (not sent again)"
