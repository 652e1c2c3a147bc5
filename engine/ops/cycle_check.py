"""`nsconsole check`'s look at the data cycle the line trains next: what the trainer refuses of it
(a manifest that is not one, or not the manifest its newest checkpoint trained on) and a shard
that is not the manifest's, which no start can train on until the cycle is rebuilt.

A cycle whose manifest is there and whose shards are not (deleted once the cycle was consumed,
then reopened by a rollback) is rebuilt from the manifest, byte for byte, by the data preparer the
line's supervisor runs, while the trainer waits for it as for any cycle not ready: it fails the
start only of a line that no preparer serves (`nsconsole run --no-supervisor`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from datalines import open_data_line
from datalines.consumption import consumer_of
from datalines.dataline import DataLine
from datalines.errors import DataLineError
from datalines.manifest import MANIFEST_NAME, load_manifest, manifest_placed, shard_files
from datalines.status import stopped_for_good
from engine.checkpoints.format import (
    list_checkpoints,
    read_checkpoint_state,
    read_latest,
    sized_resume_point,
    update_of,
)
from engine.config.run import RunConfig
from engine.errors import LineError
from engine.layout import LineLayout
from engine.ops.lines import open_line, resolve_data_path
from engine.training.position import Position


@dataclass(frozen=True)
class Finding:
    """What `current_cycle_finding` found: a `CheckResult`'s fields, and the cycle not prepared yet."""

    passed: bool
    message: str
    """One line, `current data cycle: ...`."""
    unprepared: int | None = None
    """The cycle the line trains next when its manifest is not written yet (the preparer makes it)."""
    warning: bool = False
    """Passed, with something the operator must do first (the preparer that makes the cycle stopped for good)."""


def current_cycle_finding(
    layout: LineLayout, config: RunConfig, resumed: Path | None, *, preparer_rebuilds: bool
) -> Finding:
    """The cycle at the newest checkpoint's position (cycle 0 before any): manifest and shards.
    `preparer_rebuilds`: a data preparer will serve the line's start (its supervisor's, or one
    running already), so missing shards are a wait, not a failure. `resumed`: the checkpoint the
    line resumes from (`latest`, or the one a start falls back to)."""
    try:
        data = open_data_line(resolve_data_path(layout, config.data.line))
    except (LineError, DataLineError) as error:
        # The data line's own check fails on this already: one failure, said once.
        return Finding(True, f"current data cycle: not checked, the data line does not open ({error})")
    latest = None if resumed is None else resumed.name
    state = (None if resumed is None else read_checkpoint_state(resumed)) or {}
    position: dict[str, Any] = state.get("position") if isinstance(state.get("position"), dict) else {}
    index = position.get("cycle", 0)
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        return Finding(True, "current data cycle: the newest checkpoint names none (the trainer decides)")
    directory = data.cycle_dir(index)
    last = data.last_cycle()
    if last is not None and index > last:
        return Finding(True, f"current data cycle: none, the data line ended with cycle {last}")
    if not manifest_placed(directory):  # one that is a directory is damage, said by the load below
        stopped = stopped_for_good(data.path)
        if stopped is not None:
            # Not a failure: once the operator mends it, the line's supervisor starts the preparer again.
            return Finding(
                True,
                f"current data cycle: {index} not prepared yet, and the data preparer stopped for good: "
                f"{stopped.get('last_error')}; to go on: {stopped.get('fix')} (the line waits for the cycle until then)",
                unprepared=index, warning=True,
            )  # fmt: skip
        return Finding(True, f"current data cycle: {index} not prepared yet (the preparer makes it)", unprepared=index)
    try:
        manifest, manifest_sha = load_manifest(directory)
    except (DataLineError, OSError) as error:
        return Finding(False, f"current data cycle: {error}; the trainer refuses to read it")
    data_state = state.get("data") if isinstance(state.get("data"), dict) else {}
    trained_on = data_state.get("manifest_sha256") if position.get("sample") else None
    if isinstance(trained_on, str) and trained_on != manifest_sha:
        return Finding(
            False,
            f"current data cycle: {directory / MANIFEST_NAME} sha256 is {manifest_sha[:16]}..., the checkpoint "
            f"{latest} trained on {trained_on[:16]}... (the data line changed); the trainer refuses to resume",
        )
    missing = [entry["name"] for entry in shard_files(manifest) if not (directory / entry["name"]).is_file()]
    if data.is_consumed(index):
        return _consumed_finding(layout, data, index, resumed, position, missing, preparer_rebuilds=preparer_rebuilds)
    problem = data.cycle_problem(index)
    if problem is not None and missing and preparer_rebuilds:
        return Finding(
            True,
            f"current data cycle: {index}'s shards are missing ({', '.join(missing)}); the line's data preparer "
            "rebuilds them from the manifest, byte for byte, and the trainer waits for them (a start without a "
            f"preparer must rebuild them first: `nsconsole data rebuild --work {data.path} --cycle {index}`)",
        )
    if problem is not None:
        return Finding(
            False,
            f"current data cycle: {problem}; no update can train on it until it is rebuilt from its manifest "
            f"(`nsconsole data rebuild --work {data.path} --cycle {index}`; a running line's preparer does it)",
        )
    order = _order_refusal(data, index, config, position, data_state, latest)
    if order is not None:
        return Finding(False, order)
    return Finding(True, f"current data cycle: {index}, every shard matches its manifest")


def _order_refusal(
    data: DataLine, index: int, config: RunConfig, position: dict[str, Any], data_state: dict[str, Any],
    latest: str | None,
) -> str | None:  # fmt: skip
    """The trainer's other resume check (`DataCycles._check_data_position`): the sample order at the
    checkpoint's position. `seeds.data` may change with `allow_changes`, and then the start is
    refused here, so `check` must say so too rather than pass a line whose start fails."""
    trained_on, seq_len = data_state.get("order_digest"), data_state.get("seq_len")
    if not isinstance(trained_on, str) or not isinstance(seq_len, int):
        return None  # at a cycle's start (sample 0, nothing earlier): no order read yet
    try:
        reads = Position(**position).reads()
        digest = data.cycle(index, verify=False).order_digest(seq_len, config.seeds.data, reads)
    except (TypeError, ValueError, DataLineError):
        return None  # a position or cycle the trainer reads otherwise: its own checks say what is wrong
    if digest == trained_on:
        return None
    return (
        f"current data cycle: {index}'s sample order at seq_len {seq_len} differs from the one the checkpoint "
        f"{latest} trained on (seeds.data or the data line changed); the trainer refuses to resume"
    )


def _consumed_by(data: DataLine, index: int, line: Path) -> bool:
    consumer = consumer_of(data.path, index)
    return consumer is not None and consumer.line is not None and Path(consumer.line) == line.absolute()


def _newer_checkpoints(resumed: Path) -> list[str]:
    """The checkpoints after `resumed` up to `latest`: those a start resuming from `resumed` skipped
    (those after `latest` belong to an abandoned continuation, which no start reads)."""
    latest = read_latest(resumed.parent)
    last = update_of(resumed.parent / latest) if latest is not None else None
    update = update_of(resumed) or 0
    return [
        path.name
        for path in list_checkpoints(resumed.parent)
        if (update_of(path) or 0) > update and (last is None or (update_of(path) or 0) <= last)
    ]


def consumed_resume_refusal(line: Path, data: DataLine, resumed: Path, index: int) -> str | None:
    """One line when a start resuming from the checkpoint `resumed`, inside cycle `index` (past its
    start), is refused: this line consumed the cycle (its shards deleted), since the checkpoint that
    ended it is damaged or gone and the start fell back before it; the trainer reads the cycle's
    manifest and sample order there and refuses a consumed cycle. The ways on: that checkpoint from
    a copy, or a rollback to `resumed`, which reopens the cycle (its manifest is kept, so the
    preparer rebuilds its shards byte for byte). None otherwise: the cycle not consumed, or consumed
    by another line (`data consumption` refuses that). A start at a cycle's start (sample 0) reads
    nothing of it yet and reopens it itself (`claim_cycle`): its callers leave that case out."""
    if not data.is_consumed(index) or not _consumed_by(data, index, line):
        return None
    newer = _newer_checkpoints(resumed)
    skipped = (f"{', '.join(newer)} after it {'is' if len(newer) == 1 else 'are'} damaged" if newer
               else "the checkpoints after it are gone")  # fmt: skip
    restore = f"restore {', '.join(newer)} from a copy if there is one" if newer else (
        f"put back a copy of the checkpoint that ended cycle {index} if there is one")  # fmt: skip
    return (
        f"{resumed}: a start resumes from it ({skipped}), inside cycle {index}, and {data.cycle_dir(index)}: "
        f"cycle {index} was consumed and its shards deleted, so the line cannot go on from there; {restore}, "
        f"or `nsconsole rollback {line} --to {update_of(resumed)}` reopens cycle {index} (the line's data "
        "preparer rebuilds its shards from the manifest, byte for byte)"
    )


def consumed_resume_problem(layout: LineLayout, config: RunConfig, resumed: Path) -> str | None:
    """`consumed_resume_refusal` of a start resuming from `resumed` past its cycle's start, read from
    its state.json and the line's data line, for a reader that has neither open (`nsconsole
    status`); None where either does not read (what reads them says so)."""
    position = (read_checkpoint_state(resumed) or {}).get("position")
    if not isinstance(position, dict) or not (position.get("sample") or position.get("earlier")):
        return None
    index = position.get("cycle")
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        return None
    try:
        data = open_data_line(resolve_data_path(layout, config.data.line))
    except (LineError, DataLineError):
        return None
    return consumed_resume_refusal(layout.root, data, resumed, index)


def _consumed_finding(
    layout: LineLayout, data: DataLine, index: int, resumed: Path | None, position: dict[str, Any],
    missing: list[str], *, preparer_rebuilds: bool,
) -> Finding:  # fmt: skip
    """The cycle a start resumes in was consumed (`missing`: its shards gone). Judged by `resumed`,
    the checkpoint the start takes, not by the cycle's end checkpoint on disk, which the start may
    skip as damaged."""
    if resumed is None or not _consumed_by(data, index, layout.root):
        # Another line's mark: `data consumption` fails on it. No checkpoint left of a line that
        # trained: `rows.jsonl` fails on it.
        return Finding(True, f"current data cycle: {index} ended (its end checkpoint moves the line on)")
    if position.get("sample") or position.get("earlier"):
        return Finding(False, f"current data cycle: {consumed_resume_refusal(layout.root, data, resumed, index)}")
    reopened = (f"current data cycle: {index} was consumed by this line after {resumed.name}, where a start resumes "
                f"at the cycle's start; the start reopens it")  # fmt: skip
    if not missing:
        return Finding(True, f"{reopened} (its shards are still there)")
    if preparer_rebuilds:
        return Finding(True, f"{reopened} and the line's data preparer rebuilds its shards from the manifest")
    return Finding(
        False,
        f"{reopened}, and no data preparer rebuilds its shards (`nsconsole data run-preparer --work {data.path}`, "
        f"or run the line under its supervisor, `nsconsole run {layout.root}`)",
    )


def start_without_preparer(root: Path | str) -> str | None:
    """For a line started without a supervisor (`nsconsole run --no-supervisor`) while no data
    preparer runs on its data line: `LineError` (one line) when the cycle it trains next fails
    `current_cycle_finding` (its trainer would wait for a rebuild nobody makes); a warning (one
    line) when that cycle is not prepared yet (it waits for a cycle nobody makes; not a refusal, a
    preparer started by hand after the trainer serves the wait); else None. A preparer running on
    the data line makes or rebuilds what the cycle lacks while the trainer waits."""
    from datalines.service import preparer_running

    layout = open_line(root)
    config = RunConfig.load(layout.run_json)
    data = resolve_data_path(layout, config.data.line)
    if preparer_running(data):
        return None
    # The start's own choice over the files' sizes: a checkpoint truncated is skipped as the start skips it.
    resumed = sized_resume_point(layout.checkpoints)[0]
    finding = current_cycle_finding(layout, config, resumed, preparer_rebuilds=False)
    if not finding.passed:
        raise LineError(
            f"{layout.root}: not started (no supervisor, and no data preparer runs on {data}): {finding.message}"
        )
    if finding.unprepared is None:
        return None
    return (f"{layout.root}: data cycle {finding.unprepared} is not prepared yet and no data preparer runs on {data}: the "
            f"trainer waits until one makes it (`nsconsole data run-preparer --work {data}`; a line run under its "
            f"supervisor, `nsconsole run {layout.root}`, has one)")  # fmt: skip
