"""What comes next for a line, in its screen's header: the next validation and checkpoint (update
and an estimate of when), and the tokens left in its plan and in its data line.

The trainer validates every `validation.every_updates` and at the update that ends the line (its
plan's last stage, or its data line's last cycle); it checkpoints every `checkpoints.every_updates`
and at the end of each stage and each data cycle. The next of each is the first of those to come:
a stage's end from the plan's tokens (the trainer cuts an update at it), at the newest row's tokens
per update; a cycle's end from the cycle's manifest (each source's tokens and weight: the
interleave stops when a source due has no window left), marked `~` (share rounding moves it by a
few updates).

The settings come from run.json (written atomically, so safe to read) and the data line's own
files (`dataline.json`, its plans: whether its last cycle is known; the current cycle's
manifest); a branch's plan counts from its fork, which the trunk's branches.json records.
`read_run_plan` reads them, off the UI thread; `eta_line` is a pure function of that, the line's
rows and the clock.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from rich.text import Text
from textual import work

from engine.config.run import RunConfig
from engine.errors import LineError
from engine.layout import LineLayout
from engine.ops.branch_records import read_branches
from engine.ops.lines import resolve_data_path
from engine.protocol.facts import LineState, Stage
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
class CycleSize:
    """What a data cycle's manifest tells of where the cycle ends."""

    index: int
    """The cycle."""
    start_tokens: float
    """The data line's token count at the cycle's start (what a row's `data_tokens` counts from)."""
    sources: tuple[tuple[int, int], ...]
    """(tokens, weight) of each of its sources."""
    last: bool
    """The data line's last cycle: its end ends the line."""

    def end_tokens(self, seq_len: int) -> float | None:
        """The data line's token count once the cycle is read at `seq_len` (None: no source has a
        weight). The reading order takes each source at its weight until one has no window left
        (`datalines.mixture.interleave_sources`): as many samples as the scarcest source allows."""
        weighted = [(tokens, weight) for tokens, weight in self.sources if weight > 0]
        if not weighted:
            return None
        total = sum(weight for _, weight in weighted)
        samples = min(max(0, tokens - 1) // seq_len * total // weight for tokens, weight in weighted)
        return self.start_tokens + samples * seq_len


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
    stage_ends: tuple[tuple[str, float], ...]
    """(name, tokens from the plan's start at its end) of each stage, up to one that runs until the
    data line ends."""
    data_line_tokens: float | None
    """The data line's tokens once its last cycle is planned; None: not known yet (or unreadable)."""
    fork: Fork | None
    """Where the line was branched from its trunk (None: a trunk); its plan counts from here."""
    cycle: CycleSize | None = None
    """The cycle asked for (`read_run_plan`'s `cycle`: the one the line trains), None: not read."""


def read_run_plan(path: str, parent: str | None, cycle: int | None = None) -> RunPlan:
    """The line's run plan, with the size of data cycle `cycle` (LineError naming the file when
    run.json does not load)."""
    layout = LineLayout(Path(path))
    config = RunConfig.load(layout.run_json)
    text = layout.run_json.read_text(encoding="utf-8")
    stages = [stage.tokens for stage in config.plan]
    plan_tokens = None if any(tokens is None for tokens in stages) else float(sum(stages))  # type: ignore[arg-type]
    stage_ends: list[tuple[str, float]] = []
    for stage in config.plan:
        if stage.tokens is None:
            break
        stage_ends.append((stage.name, (stage_ends[-1][1] if stage_ends else 0.0) + float(stage.tokens)))
    # Imported here (a worker thread): the console's first paint does without numpy and pyarrow.
    from datalines import open_data_line
    from datalines.errors import DataLineError

    size = None
    try:
        data_line = open_data_line(resolve_data_path(layout, config.data.line))
        last = data_line.last_cycle()
        data_tokens = None if last is None else float((last + 1) * data_line.cycle_tokens)
        if cycle is not None:
            size = read_cycle_size(data_line.cycle_dir(cycle), cycle, data_line.cycle_start_tokens(cycle), last)
    except (DataLineError, OSError, ValueError):
        data_tokens = None
    return RunPlan(
        run_json=text,
        validation_every=config.validation.every_updates,
        checkpoint_every=config.checkpoints.every_updates,
        plan_tokens=plan_tokens,
        stage_ends=tuple(stage_ends),
        data_line_tokens=data_tokens,
        fork=None if parent is None else read_fork(parent, path),
        cycle=size,
    )


def read_cycle_size(directory: Path, index: int, start_tokens: float, last: int | None) -> CycleSize | None:
    """Cycle `index`'s sources from its manifest.json (None: not prepared yet, or not readable)."""
    from datalines.manifest import MANIFEST_NAME

    try:
        manifest = json.loads((directory / MANIFEST_NAME).read_text(encoding="utf-8"))
        sources = tuple(
            (int(info["tokens"]), int(info["weight"])) for info in manifest["sources"].values()
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return CycleSize(index, float(start_tokens), sources, last is not None and index >= last)


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


def next_multiple(update: int, every: int) -> int | None:
    """The first update after `update` that is a multiple of `every` (None: `every` is off, 0)."""
    return (update // every + 1) * every if every > 0 else None


class Due(NamedTuple):
    """An event ahead: its update and why it comes then."""

    update: int
    why: str = ""
    """What ends there (`plan ends`, `cycle 0 ends`); "" for a multiple of the event's interval."""
    approximate: bool = False
    """Predicted within a few updates (a cycle's end: share rounding moves it)."""
    ends_line: bool = False
    """The line's last update (its plan's end, its data line's end): it validates too."""

    def text(self) -> str:
        """`u500`, `u293 (plan ends)`, `~u244 (cycle 0 ends)`."""
        mark = f"{'~' if self.approximate else ''}u{self.update}"
        return f"{mark} ({self.why})" if self.why else mark


def tokens_per_update(line: LineView) -> float | None:
    """The newest row's tokens per update (its own field, else the tokens between the last two rows)."""
    row = line.last_row or {}
    per_update = row.get("tokens_per_update")
    if isinstance(per_update, (int, float)) and not isinstance(per_update, bool) and per_update > 0:
        return float(per_update)
    tokens, updates = line.series.tokens, line.series.update
    if len(tokens) >= 2 and updates[-1] > updates[-2] and tokens[-1] > tokens[-2]:
        return (tokens[-1] - tokens[-2]) / (updates[-1] - updates[-2])
    return None


def ends_ahead(line: LineView, plan: RunPlan) -> list[Due]:
    """The next stage end, the plan's end and the current cycle's end, at the newest row's tokens per
    update; none where nothing tells (no pace yet, a stage that runs until the data line ends, a
    cycle whose manifest was not read)."""
    per_update = tokens_per_update(line)
    row = line.last_row
    if per_update is None or row is None or not line.series.update:
        return []
    update, tokens = line.series.update[-1], line.series.tokens[-1]

    def after(tokens_left: float) -> int:
        return update + math.ceil(tokens_left / per_update)

    ahead = []
    trained = tokens - (plan.fork.tokens if plan.fork is not None else 0.0)
    stage = next(((name, end) for name, end in plan.stage_ends if end > trained), None)
    if stage is not None and stage[1] != plan.plan_tokens:
        ahead.append(Due(after(stage[1] - trained), f"stage {stage[0]} ends"))
    if plan.plan_tokens is not None and plan.plan_tokens > trained:
        ahead.append(Due(after(plan.plan_tokens - trained), "plan ends", ends_line=True))
    cycle, data_tokens, seq_len = plan.cycle, row.get("data_tokens"), row.get("seq_len")
    if (cycle is not None and cycle.index == line.cycle and isinstance(data_tokens, (int, float))
            and isinstance(seq_len, int) and seq_len > 0):
        end = cycle.end_tokens(seq_len)
        if end is not None and end > data_tokens:
            why = "the data line ends" if cycle.last else f"cycle {cycle.index} ends"
            ahead.append(Due(after(end - data_tokens), why, approximate=True, ends_line=cycle.last))
    return ahead


def upcoming(update: int, every: int, ends: list[Due]) -> Due | None:
    """The first after `update` of the next multiple of `every` and `ends` (a multiple first on a tie:
    it is exact)."""
    multiple = next_multiple(update, every)
    candidates = [end for end in ends if end.update > update]
    if multiple is not None:
        candidates.insert(0, Due(multiple))
    return min(candidates, default=None, key=lambda due: due.update)


def eta_line(line: LineView, plan: RunPlan | None, problem: str | None = None) -> Text:
    """The header's line of what comes next (see the module docstring). A line that nothing runs
    (it ended, or its supervisor and trainer are gone) has no next validation or checkpoint: it
    says so, and what is left of its plan and data line."""
    text = Text()
    running = not line.ended
    if not running:
        text.append("next ", style="dim")
        text.append(f"nothing: no trainer runs the line ({fmt.state_label(line.display_state)})")
    if plan is None:
        if running:
            text.append(f"next: {problem or 'reading run.json…'}", style="dim")
        return text
    update = line.update or 0
    # A trainer waiting for its next data cycle trains nothing until it comes: no time to anything.
    waiting = (line.heartbeat or {}).get("stage") == Stage.WAITING_DATA
    rates = pace(line) if running and line.supervisor_state == LineState.TRAINING and not waiting else None

    def within(amount: float, rate_index: int) -> str:
        if rates is None or rates[rate_index] <= 0:
            return ""
        return f" in ~{_duration(amount / rates[rate_index])}"

    if running:
        ends = ends_ahead(line, plan)
        # A validation at every multiple and at the line's end; a checkpoint at every multiple and
        # at each stage's and cycle's end (the line's end is one of those).
        validation = upcoming(update, plan.validation_every, [end for end in ends if end.ends_line])
        checkpoint = upcoming(update, plan.checkpoint_every, ends)
        first = "next (once its data comes) " if waiting else "next "
        for lead, label, due in ((first, "◇ validation ", validation), ("  ", "⤓ checkpoint ", checkpoint)):
            text.append(f"{lead}{label}", style="dim")
            text.append("none ahead" if due is None else f"{due.text()}{within(due.update - update, 0)}")
    text.append("  plan ", style="dim")
    if plan.plan_tokens is None:
        text.append("until the data line ends")
    else:
        # No row of its own yet (a fresh line, or one rolled back to its start): it stands at its
        # start, so a branch has all of its plan left, not the tokens up to its fork as well.
        trained = 0.0 if line.tokens is None else line.tokens - (plan.fork.tokens if plan.fork is not None else 0.0)
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
        self._cycle_read: int | None = None
        """The data cycle whose size was last asked for (a new cycle is read at once)."""

    def show(self, line: LineView) -> None:
        if self._ticks % PLAN_REFRESH_TICKS == 0 or line.cycle != self._cycle_read:
            self._cycle_read = line.cycle
            self._read(line.path, line.parent, line.cycle)
        self._ticks += 1
        self.show_text(eta_line(line, self.plan, self.problem))

    @work(thread=True, exclusive=True, group="run-plan")
    def _read(self, path: str, parent: str | None, cycle: int | None) -> None:
        try:
            plan, problem = read_run_plan(path, parent, cycle), None
        except (LineError, OSError) as error:
            plan, problem = None, str(error)
        self.app.call_from_thread(self._take, plan, problem)

    def _take(self, plan: RunPlan | None, problem: str | None) -> None:
        self.plan, self.problem = plan if plan is not None else self.plan, problem
