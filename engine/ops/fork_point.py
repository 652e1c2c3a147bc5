"""Where a trunk will stand at the end of a data cycle it has not finished yet.

A branch asked for a cycle that is still to end is checked when it is asked (not only when the
fork is made, perhaps hours later): what the fork decides (the learning-rate piece it falls in,
the plan stage and so the training length, the batch) is decided here from the position the
trunk is expected to have at that cycle's end.

The estimate: the data line's count at the start of the next cycle (`cycle_start_tokens`,
nominal), shifted by the difference between the tokens trained and the data line's count at the
line's latest checkpoint (a branch's count carries on from its trunk's, and a skipped update
trains nothing). A prepared cycle holds whole documents and whole windows, a few tokens more or
fewer than nominal (the last cycle of a line that ends with its corpus holds the remainder), so
the real end may differ a little; the fork itself is checked again, exactly, when it is made.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.checkpoints.format import cycle_of_kept, list_checkpoints, read_checkpoint_state, resume_candidate
from engine.config.run import RunConfig
from engine.errors import LineError
from engine.layout import LineLayout

if TYPE_CHECKING:
    from datalines import DataLine


def latest_position(layout: LineLayout) -> dict[str, Any]:
    """The position saved in the checkpoint a start resumes from (`latest`, or the newest before it
    where `latest` is damaged); empty (the line's start) without one."""
    resume = resume_candidate(layout.checkpoints)
    state = None if resume is None else read_checkpoint_state(resume)
    position = (state or {}).get("position")
    return position if isinstance(position, dict) else {}


def check_cycle_comes(layout: LineLayout, position: dict[str, Any], cycle: int) -> None:
    """Refuse a fork at the end of a cycle the trunk left behind without its kept checkpoint
    (LineError); one past its data line's end is `engine.ops.branch_data.check_fork_cycle`'s."""
    now = int(position.get("cycle", 0))
    if now > cycle:
        raise LineError(
            f"{layout.checkpoints}: cycle {cycle} has ended (the line is in cycle {now}) but its "
            f"kept checkpoint is missing; {kept_cycle_ends(layout)}"
        )


def kept_cycle_ends(layout: LineLayout) -> str:
    """The cycle ends a line still keeps and what removed the others: a missing fork point's reason."""
    states = (read_checkpoint_state(directory) or {} for directory in list_checkpoints(layout.checkpoints))
    kept = [cycle for cycle in (cycle_of_kept(state.get("kept")) for state in states) if cycle is not None]
    have = f"it keeps the ends of cycles {', '.join(map(str, kept))}" if kept else "it keeps no cycle end"
    try:
        bound = RunConfig.load(layout.run_json).checkpoints.keep_cycle_ends
    except LineError:
        bound = None
    if bound is None:
        return f"{have} (retention keeps every cycle end: was it removed by hand?)"
    return f"{have} (checkpoints.keep_cycle_ends {bound}: retention keeps the newest {bound})"


def expected_fork_position(
    layout: LineLayout, trunk: RunConfig, trunk_data: DataLine, position: dict[str, Any], cycle: int
) -> dict[str, int]:
    """The position the trunk is expected to save at the end of `cycle` (see the module docstring):
    `tokens_trained`, `stage` and `cycle` (the next one), as a fork checkpoint's state has them.

    LineError when the trunk's plan ends before that cycle does: its trainer stops at the plan's
    end, so the cycle's end, and the fork, would never come.
    """
    stage = int(position.get("stage", 0))
    stage_tokens = int(position.get("stage_tokens", 0))
    plan = trunk.plan
    seq_len = plan[min(stage, len(plan) - 1)].seq_len
    # The cycle's reads at earlier lengths count too (a stage changed length inside it: Position.earlier).
    earlier = sum(int(length) * int(read) for length, read in position.get("earlier", []))
    data_now = trunk_data.cycle_start_tokens(int(position.get("cycle", 0))) + earlier + int(position.get("sample", 0)) * seq_len
    ahead = max(0, trunk_data.cycle_start_tokens(cycle + 1) - data_now)
    tokens_trained = int(position.get("tokens_trained", 0)) + ahead
    # The trainer ends a stage before the cycle when both end at one update, as here.
    while stage < len(plan) and plan[stage].tokens is not None and stage_tokens + ahead >= plan[stage].tokens:
        ahead -= int(plan[stage].tokens) - stage_tokens
        stage, stage_tokens = stage + 1, 0
    if stage >= len(plan):
        raise LineError(
            f"{layout.run_json}: the plan ends before cycle {cycle} does, so the trunk never reaches "
            f"the end of cycle {cycle}; grow the plan first"
        )
    return {"tokens_trained": tokens_trained, "stage": stage, "cycle": cycle + 1}
