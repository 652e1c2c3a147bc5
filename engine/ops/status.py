"""A line's state read from its files (`nsconsole status LINE` when no supervisor answers).

Everything here only reads, and tolerates files caught mid-write: a torn last line of rows.jsonl
is left out, an unreadable heartbeat or STOP is reported rather than raised.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from datalines.errors import DataLineError
from datalines.status import preparer_running, read_status
from engine.checkpoints.format import (
    branched_from,
    latest_file_problem,
    latest_name_problem,
    list_checkpoints,
    no_checkpoint_left_problem,
    read_latest,
    resume_clause,
    sized_resume_point,
)
from engine.config.run import RunConfig
from engine.errors import LineError
from engine.gpu.placement import gpus_label
from engine.layout import LineLayout
from engine.ops.branch_records import live_branches
from engine.ops.cycle_check import consumed_resume_problem
from engine.ops.line_end import line_end
from engine.ops.lines import load_accepted, open_line, resolve_data_path
from engine.ops.stop import StopRequest, read_stop
from engine.protocol.facts import FAULT_LINE_STATES, FINAL_LINE_STATES, LineState, Stage
from engine.rows import heartbeat_file_problem, rows_file_problem
from engine.supervisor.forks import QueuedFork
from engine.supervisor.lost import damaged_record
from engine.supervisor.reads import read_json, running_supervisor_pid, running_trainer_pid
from engine.wandb.recovery import Recovery, planned_recovery
from engine.wandb.state import WandbRunState

TAIL_BLOCK_BYTES = 64 * 1024
VALIDATION_MARKER = b'"val_'
"""Bytes every row of a validating update holds (its `val_<L>/...` keys) and no other row does."""
VALIDATION_SCAN_BYTES = 256 * 1024 * 1024
"""How far back from the end of rows.jsonl the last validation is looked for."""


@dataclass
class LineStatus:
    """A snapshot of a line's files."""

    root: Path
    """The line directory."""
    config: RunConfig | None
    """The parsed run.json (None when it does not load)."""
    config_error: str | None = None
    """Why run.json does not load."""
    last_rows: list[dict[str, Any]] = field(default_factory=list)
    """The newest complete rows of rows.jsonl, oldest first."""
    torn_last_row: bool = False
    """rows.jsonl ends in an incomplete line (a write was cut short; it is left out)."""
    heartbeat: dict[str, Any] | None = None
    """The trainer's last heartbeat (time, update, stage, pid)."""
    heartbeat_age_s: float | None = None
    """Seconds since the heartbeat was written."""
    checkpoints: list[str] = field(default_factory=list)
    """Finished checkpoint directories, oldest first."""
    latest: str | None = None
    """The checkpoint `checkpoints/latest` names (None: none, or `latest` is unreadable: a problem says so)."""
    resumes_from: str | None = None
    """The checkpoint a start resumes from where it is not `latest` (the one `latest` names is gone or
    damaged, or `latest` names none): the newest before it whose files are there at their sizes (not
    hashed); None otherwise, or when none is left."""
    resume_refused: bool = False
    """A start from `resumes_from` is refused: it stands inside a data cycle the line consumed (a
    problem says why and the way on)."""
    stop: StopRequest | None = None
    """A pending stop request."""
    problems: list[str] = field(default_factory=list)
    """Files that could not be read (one line each)."""
    disk_bytes: int = 0
    """Disk space the line directory uses."""
    checkpoints_disk_bytes: int = 0
    """Of `disk_bytes`, what its checkpoints use."""
    disk_free: int | None = None
    """Free space on the line's disk (None: unreadable)."""
    last_validation: dict[str, Any] | None = None
    """The newest row of a validating update (None: no validation in rows.jsonl yet)."""
    wandb: WandbRunState | None = None
    """The line's W&B run (wandb_run.json; None when there is none yet, or it is unreadable)."""
    wandb_unreadable: bool = False
    """wandb_run.json is there and cannot be read (its problem is among `problems`)."""
    wandb_recovery: Recovery | None = None
    """The run the next start continues, as a checkpoint records it, where wandb_run.json is
    unreadable or missing (engine.wandb.recovery; said among `problems`); None otherwise."""
    gpu: str | None = None
    """The GPU the line's supervisor leased, or the leases it waits for (supervisor.json; None: no
    supervisor has run it, or it trains on the CPU)."""
    state: str | None = None
    """supervisor.json's `state`: what the line's supervisor was doing when it last saved it (a
    `LineState`; None: no supervisor has run the line; `unknown` where supervisor.json is damaged)."""
    damaged_record: str | None = None
    """What is wrong with supervisor.json where it is damaged (not JSON, say; among `problems` too):
    nothing says what the line was doing (`state` unknown), and its operator must mend it."""
    supervisor_pid: int | None = None
    """The pid supervisor.json records while that very process runs (None: no supervisor runs)."""
    failures_in_a_row: int = 0
    """supervisor.json's crashes since the last one that left a newer checkpoint."""
    last_event: dict[str, Any] | None = None
    """supervisor.json's last notified event (`message` says what happened)."""
    queued_forks: list[dict[str, Any]] = field(default_factory=list)
    """Branches waiting for the end of their trunk cycle (supervisor.json `queued_forks`)."""
    parent: str | None = None
    """The line this one was branched from (None: a trunk)."""
    branches: list[str] = field(default_factory=list)
    """`PATH (cycle C, update U)` of each branch forked from this line (branches.json) whose
    directory is still there."""
    lone_trainer_pid: int | None = None
    """The pid of a trainer that trains the line with no supervisor running (`run --no-supervisor`,
    or one whose supervisor died, checkpointing before it goes); None otherwise."""
    ended_without_supervisor: str | None = None
    """Why the line has finished (`line_end`: its plan complete, its data line trained through) where
    supervisor.json does not say so and nothing runs it: a `run --no-supervisor` trainer trained it
    to its end after its supervisor stopped (or none ever ran it). None otherwise."""
    preparer_stopped: str | None = None
    """Why its data line's preparer stopped for good and what to do (the data line's preparer.json:
    state `failed`, and no preparer runs now); None otherwise. Said among `problems` too."""
    data_wait: str | None = None
    """Why a trainer of the line waits for data, when its data line's running preparer waits too (the
    preparer.json's `waiting_reason`: a disk other lines filled, say); None otherwise."""

    @property
    def waits_for_data_that_will_not_come(self) -> bool:
        """A trainer of the line runs and waits for a data cycle (its heartbeat says so) that no
        preparer will make: the data line's stopped for good."""
        return self.preparer_stopped is not None and _waits_for_data(self)

    @property
    def lost(self) -> bool:
        """Its supervisor died without saving a final state (killed, the host rebooted) and no trainer
        of the line runs: nothing runs it, and nothing will start it again by itself."""
        nothing_runs = self.supervisor_pid is None and self.lone_trainer_pid is None
        known = self.state is not None and self.damaged_record is None
        return known and self.state not in FINAL_LINE_STATES and nothing_runs

    @property
    def needs_operator(self) -> bool:
        """The line stopped without being asked to and will not go on by itself: it failed, got stuck
        or filled the disk, or it is `lost`, or it waits for data that will not come, or its
        supervisor.json is damaged (nothing says what it was doing). A line that runs
        otherwise does not, nor one that ended as asked; a trainer running it without a supervisor
        (`run --no-supervisor`, or an orphan finishing its checkpoint) counts as running, whatever
        state supervisor.json holds: the report says it trains."""
        if self.waits_for_data_that_will_not_come:
            return True
        if self.lone_trainer_pid is not None or self.ended_without_supervisor is not None:
            return False
        return self.state in FAULT_LINE_STATES or self.lost or self.damaged_record is not None


def line_status(root: Path | str, rows: int = 5, now: float | None = None) -> LineStatus:
    """Read a line's files: configuration, its supervisor's state and branches, newest rows,
    heartbeat, checkpoints, STOP, disk use."""
    layout = open_line(root)
    now = time.time() if now is None else now
    try:
        config: RunConfig | None = RunConfig.load(layout.run_json)
        status = LineStatus(layout.root, config)
    except LineError as error:
        status = LineStatus(layout.root, None, config_error=str(error))
    try:
        load_accepted(layout)
    except LineError as error:  # every start compares to it, so every start is refused
        status.problems.append(f"{error}; a start is refused until it is mended (`nsconsole check` says so)")
    rows_unusable = rows_file_problem(layout.rows_jsonl)  # a directory, say: said, not read
    if rows_unusable is not None:
        status.problems.append(rows_unusable)
        bad_rows = 0
    else:
        status.last_rows, status.torn_last_row, bad_rows = read_last_rows(layout.rows_jsonl, rows)
    if bad_rows:
        status.problems.append(f"{layout.rows_jsonl}: {bad_rows} malformed row(s) among the newest")
    _read_heartbeat(layout, status, now)
    _read_checkpoints(layout, status)
    try:
        status.stop = read_stop(layout)
    except LineError as error:
        status.problems.append(str(error))
    supervisor = read_supervisor_json(layout, status)
    status.gpu = gpu_summary(supervisor)
    _read_supervisor_state(supervisor, status)
    _read_unrecorded_end(layout, status)
    _read_data_preparer(layout, status)
    _read_branches(layout, supervisor, status)
    # One walk of the line: its checkpoints', then the rest's.
    status.checkpoints_disk_bytes = directory_bytes(layout.checkpoints)
    status.disk_bytes = status.checkpoints_disk_bytes + directory_bytes(layout.root, excluding=layout.checkpoints)
    with contextlib.suppress(OSError):
        status.disk_free = shutil.disk_usage(layout.root).free
    if rows_unusable is None:
        status.last_validation = read_last_validation(layout.rows_jsonl)
    _read_wandb(layout, status)
    return status


def _read_wandb(layout: LineLayout, status: LineStatus) -> None:
    """wandb_run.json; where it is unreadable, or missing while a checkpoint records the line's run,
    what the next start does instead (continue, rewind or fork a run: the mirror's own `planned_recovery`)."""
    problem: str | None = None
    if layout.wandb_run_json.exists():
        try:
            status.wandb = WandbRunState.load(layout.wandb_run_json)
            return
        except LineError as error:
            status.wandb_unreadable = True
            problem = str(error)
    mode = None if status.config is None else status.config.wandb.mode
    if mode != "disabled":
        status.wandb_recovery = planned_recovery(layout, online=mode == "online")
    if status.wandb_recovery is not None:
        problem = problem or f"{layout.wandb_run_json.name}: missing"
        aside = "sets it aside and " if status.wandb_unreadable else ""
        problem += f"; the next start {aside}{status.wandb_recovery.plan()}"
    if problem is not None:
        status.problems.append(problem)


def read_supervisor_json(layout: LineLayout, status: LineStatus) -> dict[str, Any]:
    """supervisor.json as its last supervisor left it ({} when there is none; where it is damaged, {}
    and `damaged_record`)."""
    status.damaged_record = damaged_record(layout.root)
    if status.damaged_record is not None:
        status.problems.append(f"{status.damaged_record}; the line's state is unknown")
        return {}
    return read_json(layout.supervisor_json) or {}


def _read_supervisor_state(supervisor: dict[str, Any], status: LineStatus) -> None:
    """The state, failures and last event supervisor.json records, and whether the supervisor that
    wrote it still runs."""
    state = supervisor.get("state")
    # A damaged record is no line that never ran under a supervisor (no state): its state is unknown.
    status.state = state if isinstance(state, str) else "unknown" if status.damaged_record is not None else None
    status.supervisor_pid = running_supervisor_pid(supervisor)
    if status.supervisor_pid is None:
        status.lone_trainer_pid = running_trainer_pid(status.heartbeat)
    failures = supervisor.get("failures_in_a_row")
    status.failures_in_a_row = failures if isinstance(failures, int) and not isinstance(failures, bool) else 0
    event = supervisor.get("last_event")
    status.last_event = event if isinstance(event, dict) else None


def _read_unrecorded_end(layout: LineLayout, status: LineStatus) -> None:
    """`ended_without_supervisor`: a line at rest whose supervisor.json ends in another state (or is
    missing) but whose latest checkpoint stands at the line's end. A lost supervisor's line is left
    to `lost` (`nsconsole resume` records its end and sends the notification it owed)."""
    nothing_runs = status.supervisor_pid is None and status.lone_trainer_pid is None
    at_rest = status.state is None or status.state in FINAL_LINE_STATES
    if not nothing_runs or not at_rest or status.state == LineState.FINISHED or status.config is None:
        return
    if status.damaged_record is not None or not status.checkpoints:
        return
    with contextlib.suppress(LineError, DataLineError, OSError, ValueError):
        status.ended_without_supervisor = line_end(layout.root)


def _read_data_preparer(layout: LineLayout, status: LineStatus) -> None:
    """Whether the data line's preparer stopped for good (preparer.json `failed`, and none runs now:
    one started since would have written its own state); a problem naming its reason and fix."""
    if status.config is None:
        return
    data = resolve_data_path(layout, status.config.data.line)
    preparer, damage = read_status(data)
    if damage is not None:
        status.problems.append(f"data preparer: {damage}")
    if preparer is None:
        return
    if preparer.get("state") == "waiting" and _waits_for_data(status) and preparer_running(data):
        # Else the line reads as training, waiting for a cycle, with no word of why: the preparer
        # waits for free disk (shared with other lines) or for its source, and says so only in data status.
        cycle = (status.heartbeat or {}).get("cycle")
        reason = preparer.get("waiting_reason") or preparer.get("message")
        status.data_wait = f"the trainer waits for data cycle {cycle}; the data preparer of {data} waits: {reason}"
    if preparer.get("state") != "failed" or preparer_running(data):
        return
    reason, fix = preparer.get("last_error") or preparer.get("message"), preparer.get("fix")
    status.preparer_stopped = f"{reason}; {fix}" if fix else str(reason)
    problem = f"data preparer of {data} stopped for good (pid {preparer.get('pid')}): {status.preparer_stopped}"
    if status.waits_for_data_that_will_not_come:
        cycle = (status.heartbeat or {}).get("cycle")
        problem += f"; the trainer waits for data cycle {cycle}, which no preparer will make"
    status.problems.append(problem)


def _waits_for_data(status: LineStatus) -> bool:
    """A trainer of the line runs and beats that it waits for a data cycle."""
    runs = status.supervisor_pid is not None or status.lone_trainer_pid is not None
    return runs and (status.heartbeat or {}).get("stage") == Stage.WAITING_DATA


def _read_branches(layout: LineLayout, supervisor: dict[str, Any], status: LineStatus) -> None:
    """The branches supervisor.json queues, those forked already (branches.json), and the line this
    one was branched from."""
    records = supervisor.get("queued_forks")
    forks = map(QueuedFork.from_json, records if isinstance(records, list) else [])
    status.queued_forks = [dataclasses.asdict(fork) for fork in forks if fork is not None]
    status.parent = branched_from(layout)
    try:
        records = live_branches(layout)
    except LineError as error:
        status.problems.append(str(error))
        return
    status.branches = [f"{entry['line']} (cycle {entry.get('at_cycle')}, update {entry.get('at_update')})"
                       for entry in records]


def gpu_summary(supervisor: dict[str, Any]) -> str | None:
    """One line on the line's GPU from supervisor.json: the GPU leased (NVML's index and UUID: the
    physical GPU, whatever CUDA_VISIBLE_DEVICES), or who holds the leases it waits for."""
    holders = supervisor.get("gpu_holders")
    if supervisor.get("state") == LineState.WAITING_GPU and supervisor.get("gpu_index") is None and holders:
        held = ", ".join(f"GPU {record.get('gpu')} by {record.get('line') or 'pid ' + str(record.get('pid'))}"
                         for record in holders if isinstance(record, dict))  # fmt: skip
        return f"waiting for a lease (held: {held})"
    index = supervisor.get("gpu_index")
    if not isinstance(index, int):
        return None
    gpu = f"GPU {index} ({supervisor.get('gpu_uuid') or 'UUID unknown'})"
    indices = supervisor.get("gpu_indices")
    if isinstance(indices, list) and len(indices) > 1:  # a line over several GPUs: every rank's
        gpu = f"{gpus_label(indices)} (rank 0 on {gpu})"
    if supervisor.get("state") in FINAL_LINE_STATES:
        return f"{gpu}, its last lease"
    if supervisor.get("state") == LineState.WAITING_GPU:
        return f"{gpu}, leased; waiting for other processes to leave it"
    return gpu


def read_last_validation(path: Path, limit: int = VALIDATION_SCAN_BYTES) -> dict[str, Any] | None:
    """The newest complete row holding validation metrics, read backwards from the end of rows.jsonl."""
    try:
        handle = path.open("rb")
    except FileNotFoundError:
        return None
    with handle:
        end = handle.seek(0, os.SEEK_END)
        position = end
        tail = b""  # the text after the last newline seen so far, read from further back
        while position > 0 and end - position < limit:
            step = min(TAIL_BLOCK_BYTES, position)
            position -= step
            handle.seek(position)
            data = handle.read(step) + tail
            lines = data.split(b"\n")
            tail = lines[0] if position > 0 else b""  # may be a partial line: joined with the next block
            complete = lines[1:] if position > 0 else lines
            if position + len(data) == end and not data.endswith(b"\n"):
                complete = complete[:-1]  # the torn last line
            for line in reversed(complete):
                if VALIDATION_MARKER in line:
                    try:
                        row = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(row, dict):
                        return row
    return None


def read_last_rows(path: Path, count: int) -> tuple[list[dict[str, Any]], bool, int]:
    """The last `count` complete rows of a JSONL file, whether its last line is torn, and bad lines seen.

    Reads backwards from the end in blocks, so a rows.jsonl of months costs what its tail does.
    """
    try:
        handle = path.open("rb")
    except FileNotFoundError:
        return [], False, 0
    with handle:
        end = handle.seek(0, os.SEEK_END)
        data = b""
        position = end
        # One more newline than rows wanted: the text before the first one may be a partial line.
        while position > 0 and data.count(b"\n") <= count:
            step = min(TAIL_BLOCK_BYTES, position)
            position -= step
            handle.seek(position)
            data = handle.read(step) + data
    torn = bool(data) and not data.endswith(b"\n")
    lines = data.split(b"\n")
    lines.pop()  # after the final newline: empty, or the torn line
    if position > 0:
        lines = lines[1:]  # the first piece may start mid-line
    rows: list[dict[str, Any]] = []
    bad = 0
    for line in lines[-count:] if count > 0 else []:
        try:
            row = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            bad += 1
    return rows, torn, bad


def _read_heartbeat(layout: LineLayout, status: LineStatus, now: float) -> None:
    unusable = heartbeat_file_problem(layout.heartbeat)
    if unusable is not None:
        status.problems.append(unusable)
        return
    try:
        data = layout.heartbeat.read_bytes()
        modified = layout.heartbeat.stat().st_mtime
    except FileNotFoundError:
        return
    try:
        heartbeat = json.loads(data)
    except ValueError:  # not UTF-8 included
        status.problems.append(f"{layout.heartbeat}: not JSON (caught mid-write?)")
        return
    if not isinstance(heartbeat, dict):
        status.problems.append(f"{layout.heartbeat}: not a JSON object")
        return
    status.heartbeat = heartbeat
    written = heartbeat.get("time")
    # The trainer writes its own clock; the file's mtime stands in when the field is absent.
    written_at = float(written) if isinstance(written, (int, float)) else modified
    status.heartbeat_age_s = max(0.0, now - written_at)


def _read_checkpoints(layout: LineLayout, status: LineStatus) -> None:
    """The checkpoints, the one `latest` names and, where a start does not resume from that one, the
    one it resumes from instead, chosen as a start chooses (`sized_resume_point`: its files there at
    their sizes; hashing them is `nsconsole check`'s, so that one is said to be not verified). Each
    thing the start skips is a problem, one line: `latest` missing, unreadable or naming a missing
    checkpoint, a checkpoint's state.json or meta.json unreadable or a file of it missing or
    truncated; the last says which checkpoint the start resumes from, or that none is left. With
    nothing skipped and no checkpoint, a line that has trained is a problem too (a start refuses it)."""
    if layout.checkpoints.is_dir():
        status.checkpoints = [directory.name for directory in list_checkpoints(layout.checkpoints)]
        refused = latest_file_problem(layout.checkpoints)  # a directory, a link: a start refuses it (it says why)
        if refused is not None:
            status.problems.append(refused)
            return
        status.latest = read_latest(layout.checkpoints)
    resumed, skipped = sized_resume_point(layout.checkpoints)
    if status.latest is None and status.checkpoints and not os.path.lexists(layout.latest):
        # A start takes the newest without a word; the user who removed `latest` should know.
        skipped.insert(0, latest_name_problem(layout.checkpoints))
    if not skipped:
        # `latest` reads; with no checkpoint to resume from, a line that has trained is refused a start.
        lost = no_checkpoint_left_problem(layout) if resumed is None else None
        if lost is not None:
            status.problems.append(lost)
        return
    status.resumes_from = None if resumed is None else resumed.name
    if resumed is not None:
        skipped[-1] += f"; {resume_clause(resumed, status.latest)} ({NOT_VERIFIED})"
    else:
        skipped[-1] += "; no checkpoint to resume from is left (a start is refused: `nsconsole check` says why)"
    status.problems += skipped
    # Fallen back inside a cycle the line consumed, the start is refused there: say so, and the way on.
    refused = None if resumed is None or status.config is None else (
        consumed_resume_problem(layout, status.config, resumed))  # fmt: skip
    if refused is not None:
        status.resume_refused = True
        status.problems.append(refused)


NOT_VERIFIED = "not verified: `nsconsole check` hashes its files"
"""What `status` says of the checkpoint a start resumes from instead of `latest`'s: it checked
that checkpoint's files are there at their sizes, not their hashes (a checkpoint can be GiBs)."""


def directory_bytes(root: Path, excluding: Path | None = None) -> int:
    """Disk space used under `root` (allocated blocks; symlinks are not followed), less the directory
    `excluding` (one of root's own, already counted)."""
    total = 0
    for directory, subdirectories, files in os.walk(root):
        if excluding is not None and Path(directory) == root:
            subdirectories[:] = [name for name in subdirectories if root / name != excluding]
        for name in files:
            try:
                info = os.lstat(os.path.join(directory, name))
            except FileNotFoundError:  # removed while we walk (a rolling checkpoint)
                continue
            total += getattr(info, "st_blocks", 0) * 512 or info.st_size
    return total
