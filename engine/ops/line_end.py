"""Whether a training line has anything left to train, as its trainer would find at a start, and
the one line that refuses to start a supervisor for a line that has none (its trainer would stop
at once: "runs in the background" followed by "finished" seconds later misleads)."""

from __future__ import annotations

from pathlib import Path

from engine.checkpoints.format import read_latest
from engine.config.run import RunConfig
from engine.errors import LineError
from engine.layout import LineLayout
from engine.ops.fork_point import latest_position
from engine.ops.lines import resolve_data_path
from engine.protocol.facts import StopReason


def line_end(root: Path | str) -> str | None:
    """Why the line at `root` has nothing left to train, from the position its `latest` checkpoint
    saved: its plan is complete, or it trained every cycle of its data line. None while it has more
    to train (a new line, a stopped one, one rolled back)."""
    layout = LineLayout(root)
    config = RunConfig.load(layout.run_json)
    position = latest_position(layout)
    stage, cycle = position.get("stage", 0), position.get("cycle", 0)
    if isinstance(stage, int) and stage >= len(config.plan):
        return str(StopReason.PLAN_END)
    last = data_last_cycle(layout, config)
    if last is not None and isinstance(cycle, int) and cycle > last:
        return f"it trained every cycle of its data line, 0 to {last}"
    return None


def data_last_cycle(layout: LineLayout, config: RunConfig) -> int | None:
    """The last cycle of the line's data line, where the line finishes; None while its planning has
    not reached the corpus end (an open-ended recipe)."""
    from datalines import open_data_line

    return open_data_line(resolve_data_path(layout, config.data.line)).last_cycle()


def refuse_a_finished_line(
    root: Path, what: str = "the line", again: str | None = None, refused: str = "supervisor"
) -> None:
    """`LineError` (one line) when the line has finished (`line_end`): what it finished with and how
    to train on from it. `what` names it ("the demo line"); `again` is the command that starts it
    after a rollback (`nsconsole run LINE` unless given); `refused` is what was not started
    (`run --no-supervisor` starts a trainer, not a supervisor)."""
    ended = line_end(root)
    if ended is not None:
        raise finished_line_error(root, ended, what, again, refused)


def finished_line_error(
    root: Path, ended: str, what: str = "the line", again: str | None = None, refused: str = "supervisor"
) -> LineError:
    """What `refuse_a_finished_line` raises, `ended` being what `line_end` said (the supervisor, which
    asks again under the line's lock, raises it too)."""
    again = again or f"nsconsole run {root}"
    return LineError(
        f"{root}: {what} has finished ({ended}, latest checkpoint {read_latest(root / 'checkpoints')}); "
        f"nothing is left to train, so no {refused} was started. Train on from it with a branch at a cycle "
        f"end (`nsconsole branch NEW --from {root} --at-cycle N --plan decay:TOKENS --data DIR`) or a rollback "
        f"(`nsconsole rollback {root} --to UPDATE`, then `{again}`); `nsconsole status {root}` shows it"
    )
