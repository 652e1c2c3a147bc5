"""What comes next for a line, in its screen's header: the next validation and checkpoint (update
and an estimate of when), and the tokens left in its plan and in its data line.

The settings come from run.json (written atomically, so safe to read) and the data line's own
files (`dataline.json`, its plans: whether its last cycle is known); a branch's plan counts from
its fork, which the trunk's branches.json records. `read_run_plan` reads them, off the UI thread;
`eta_line` is a pure function of that, the line's rows and the clock.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.text import Text
from textual import work

from engine.config.run import RunConfig
from engine.errors import LineError
from engine.layout import LineLayout
from engine.ops.branch import read_branches
from engine.ops.lines import resolve_data_path
from engine.protocol.facts import LineState
from nsconsole.state import LineView
from nsconsole.widgets import format as fmt
from nsconsole.widgets.quiet_static import QuietStatic

RATE_WINDOW = 50
"""Newest rows whose pace estimates the times ahead."""


@dataclass(frozen=True)
class Fork:
    """Where a branch left its trunk (the trunk's branches.json entry for it)."""

    trunk: str
    """The trunk's line directory."""
    update: int
    """The trunk's update the branch continues from."""
    tokens: float
    """Tokens the trunk had trained at the fork."""


@dataclass(frozen=True)
class RunPlan:
    """A line's run.json and what its header computes from it and its data line."""

    run_json: str
    """run.json's text as read (the `run.json` view shows it)."""
    validation_every: int
    """validation.every_updates."""
    checkpoint_every: int
    """checkpoints.every_updates (rolling checkpoints; cycle and stage ends add kept ones)."""
    plan_tokens: float | None
    """Tokens the whole plan trains; None: its last stage runs until the data line ends."""
    data_line_tokens: float | None
    """The data line's tokens once its last cycle is planned; None: not known yet (or unreadable)."""
    fork: Fork | None
    """Where the line was branched from its trunk (None: a trunk); its plan counts from here."""


def read_run_plan(path: str, parent: str | None) -> RunPlan:
    """The line's run plan (LineError naming the file when run.json does not load)."""
    layout = LineLayout(Path(path))
    config = RunConfig.load(layout.run_json)
    text = layout.run_json.read_text(encoding="utf-8")
    stages = [stage.tokens for stage in config.plan]
    plan_tokens = None if any(tokens is None for tokens in stages) else float(sum(stages))  # type: ignore[arg-type]
    # Imported here (a worker thread): the console's first paint does without numpy and pyarrow.
    from datalines import open_data_line
    from datalines.errors import DataLineError

    try:
        data_line = open_data_line(resolve_data_path(layout, config.data.line))
        last = data_line.last_cycle()
        data_tokens = None if last is None else float((last + 1) * data_line.cycle_tokens)
    except (DataLineError, OSError, ValueError):
        data_tokens = None
    return RunPlan(
        run_json=text,
        validation_every=config.validation.every_updates,
        checkpoint_every=config.checkpoints.every_updates,
        plan_tokens=plan_tokens,
        data_line_tokens=data_tokens,
        fork=None if parent is None else read_fork(parent, path),
    )


def read_fork(trunk: str, branch: str) -> Fork | None:
    """The trunk's record of `branch` (None: not recorded, or branches.json unreadable)."""
    try:
        entries = read_branches(LineLayout(Path(trunk)))
    except LineError:
        return None
    wanted = Path(branch).resolve()
    for entry in entries:
        if isinstance(entry, dict) and Path(str(entry.get("line"))).resolve() == wanted:
            update, tokens = entry.get("at_update"), entry.get("at_tokens")
            if isinstance(update, int) and isinstance(tokens, (int, float)):
                return Fork(trunk, update, float(tokens))
    return None


def pace(line: LineView) -> tuple[float, float] | None:
    """(updates/s, tokens/s) over the newest rows with times; None when they do not tell."""
    series = line.series
    timed = [index for index in range(max(0, len(series) - RATE_WINDOW), len(series)) if math.isfinite(series.time[index])]
    if len(timed) < 2:
        return None
    first, last = timed[0], timed[-1]
    seconds = series.time[last] - series.time[first]
    if seconds <= 0:
        return None
    return (series.update[last] - series.update[first]) / seconds, (series.tokens[last] - series.tokens[first]) / seconds


def next_multiple(update: int, every: int) -> int:
    """The first update after `update` that is a multiple of `every`."""
    return (update // every + 1) * every


def eta_line(line: LineView, plan: RunPlan | None, problem: str | None = None) -> Text:
    """The header's line of what comes next (see the module docstring). A line that nothing runs
    (it ended, or its supervisor and trainer are gone) has no next validation or checkpoint: it
    says so, and what is left of its plan and data line."""
    text = Text()
    state = line.display_state
    running = state not in fmt.FINAL_STATES and state != fmt.SUPERVISOR_LOST
    if not running:
        text.append("next ", style="dim")
        text.append(f"nothing: no trainer runs the line ({fmt.state_label(state)})")
    if plan is None:
        if running:
            text.append(f"next: {problem or 'reading run.json…'}", style="dim")
        return text
    update = line.update or 0
    rates = pace(line) if running and line.supervisor_state == LineState.TRAINING else None

    def within(amount: float, rate_index: int) -> str:
        if rates is None or rates[rate_index] <= 0:
            return ""
        return f" in ~{_duration(amount / rates[rate_index])}"

    if running:
        validation = next_multiple(update, plan.validation_every)
        checkpoint = next_multiple(update, plan.checkpoint_every)
        text.append("next ◇ validation ", style="dim")
        text.append(f"u{validation}{within(validation - update, 0)}")
        text.append("  ⤓ checkpoint ", style="dim")
        text.append(f"u{checkpoint}{within(checkpoint - update, 0)}")
    tokens = line.tokens or 0.0
    text.append("  plan ", style="dim")
    if plan.plan_tokens is None:
        text.append("until the data line ends")
    else:
        trained = tokens - (plan.fork.tokens if plan.fork is not None else 0.0)
        left = max(0.0, plan.plan_tokens - trained)
        text.append(f"{fmt.count(left)} tokens left{within(left, 1)}")
    text.append("  data line ", style="dim")
    row = line.last_row or {}
    data_position = row.get("data_tokens")
    if plan.data_line_tokens is None or not isinstance(data_position, (int, float)):
        text.append("end not planned yet")
    else:
        left = max(0.0, plan.data_line_tokens - float(data_position))
        text.append(f"{fmt.count(left)} tokens left{within(left, 1)}")
    return text


def _duration(seconds: float) -> str:
    """A time ahead as its two largest units: 45s, 12m, 3h05m, 2d04h."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f}s"
    minutes = int(seconds // 60)
    if minutes < 60:
        return f"{minutes}m"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def pretty_run_json(text: str) -> str:
    """run.json indented for reading (as written when it is not JSON: the view shows what is there)."""
    try:
        return json.dumps(json.loads(text), indent=2)
    except ValueError:
        return text


PLAN_REFRESH_TICKS = 10
"""Refreshes between readings of run.json and the data line (a tune or an edit shows within 10 s)."""


class EtaLine(QuietStatic):
    """The header's line of what comes next; reads the run plan itself, off the UI thread."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.plan: RunPlan | None = None
        self.problem: str | None = None
        """Why run.json could not be read (None: it was, or is being)."""
        self._ticks = 0

    def show(self, line: LineView) -> None:
        if self._ticks % PLAN_REFRESH_TICKS == 0:
            self._read(line.path, line.parent)
        self._ticks += 1
        self.show_text(eta_line(line, self.plan, self.problem))

    @work(thread=True, exclusive=True, group="run-plan")
    def _read(self, path: str, parent: str | None) -> None:
        try:
            plan, problem = read_run_plan(path, parent), None
        except (LineError, OSError) as error:
            plan, problem = None, str(error)
        self.app.call_from_thread(self._take, plan, problem)

    def _take(self, plan: RunPlan | None, problem: str | None) -> None:
        self.plan, self.problem = plan if plan is not None else self.plan, problem
