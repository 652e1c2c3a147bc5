"""`wandb_run.json`: what a line knows about its W&B run, kept across starts.

The file is small and replaced atomically on every change (engine.atomic), so a crash leaves the
old state or the new one. It holds the run id, how the run was started and from what parent, the
last step the server acknowledged (a resume re-sends every row after it), a start that a rollback
or a branch planned and the next start carries out, the rows the mirror gave up on, the runs this
line superseded, the client's local directories (removed at a later start once finished), and the
replayed updates whose rows differed from the server's copy.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field
from pathlib import Path
from typing import Any

from engine.atomic import write_text_atomic
from engine.config.json_fields import malformed_json
from engine.errors import LineError

STATE_VERSION = 1
START_KINDS = ("new", "resume", "fork", "rewind")
METHODS = ("native", "backfill")
KEPT_REPLAY_MISMATCHES = 100
"""wandb_run.json keeps the latest this many replay mismatches (all are counted, and each is in run.log)."""
RUN_ID_RESERVED = ":;,#?/'"
"""Characters W&B refuses in a run id (wandb_settings.validate_run_id). A run id holding one, or
empty, or with spaces at an end, is none of the line's runs (their ids are wandb's own); taken as
sound, it would fail every `wandb.init` of every start, so the file is treated as damaged."""


class WandbStateError(LineError):
    """wandb_run.json is unreadable or malformed."""


@dataclass
class RunPoint:
    """A run and a step of it: the parent a run was forked or rewound from."""

    run_id: str
    """The W&B run id."""
    step: int
    """The W&B step (= the line's update) the new run continues after."""


@dataclass
class PendingStart:
    """A fork or rewind planned by `branch` / `rollback`, carried out by the next start."""

    kind: str
    """`rewind` (a rollback of this line) or `fork` (this line is a new branch)."""
    at_update: int
    """Rewind: the update rolled back to. Fork: the parent's update the branch continues from."""
    parent_run_id: str | None = None
    """Fork: the parent line's run (None: the parent never had one, so only a backfill is possible)."""
    parent_rows: str | None = None
    """Fork: the parent line's rows.jsonl, the source of the backfill."""
    parent_acknowledged: int | None = None
    """Fork: the last step of the parent's run the server had acknowledged when the branch was made."""
    new_run_id: str | None = None
    """The id chosen for the new run when the start was first tried, so a retry reuses it."""
    initialized: bool = False
    """True once W&B accepted the new run: a retry then continues it instead of creating it again."""


@dataclass
class Gap:
    """Rows the mirror gave up sending (W&B unreachable too long); re-sent when W&B is back."""

    from_update: int
    """The first row not sent."""
    to_update: int
    """The last row not sent (grows while W&B stays unreachable)."""


@dataclass
class SupersededRun:
    """A run this line replaced by a new one (a rollback where the server cannot rewind)."""

    run_id: str
    """The old run."""
    by_run_id: str
    """The run that replaced it."""
    at_update: int
    """The update the line was rolled back to."""
    marked: bool = False
    """True once the old run carries the mark on W&B (tag `superseded`, summary `superseded_by`)."""


@dataclass
class LocalRunFiles:
    """One directory the W&B client wrote for a run of this line."""

    path: str
    """The client's run directory (`<line>/wandb/run-...` or `offline-run-...`)."""
    run_id: str
    """The run it belongs to."""
    offline: bool
    """Written in offline mode: its data reaches W&B only through `wandb sync`."""
    finished: bool = False
    """The run was finished cleanly (everything handed over, `finish()` returned in time)."""


@dataclass
class ReplayMismatch:
    """A metric of a replayed update whose value differs from the server's copy of that step."""

    update: int
    """The update (W&B step) trained again after a resume."""
    metric: str
    """The differing key of the row (`(row)`: the server has no row at that step)."""
    line_value: str
    """The value rows.jsonl holds now, as JSON (`absent`: the row lacks the key)."""
    server_value: str
    """The value the server holds, as JSON (`absent`: the server's row lacks the key)."""


@dataclass
class WandbRunState:
    """The content of `wandb_run.json`."""

    run_id: str | None = None
    """The line's current W&B run (None: no run was started yet)."""
    start: str | None = None
    """The kind of the latest start: new, resume, fork or rewind."""
    method: str | None = None
    """How the run's fork or rewind was done: `native` (W&B's fork_from / resume_from) or `backfill`."""
    parent: RunPoint | None = None
    """The run and step this run was forked or rewound from."""
    acknowledged_step: int | None = None
    """The last step of `run_id` the server (offline: the local log) acknowledged."""
    pending: PendingStart | None = None
    """A fork or rewind the next start must carry out."""
    gap: Gap | None = None
    """Rows given up after W&B stayed unreachable; the next start (or W&B's return) re-sends them."""
    superseded: list[SupersededRun] = field(default_factory=list)
    """Runs this line replaced after rollbacks."""
    local_files: list[LocalRunFiles] = field(default_factory=list)
    """The client's local directories of this line's runs not removed yet."""
    fork_unsupported: bool = False
    """The server refused a native fork once: branches of this line are backfilled."""
    rewind_unsupported: bool = False
    """The server refused a native rewind once: rollbacks start a new, backfilled run."""
    replay_mismatches: list[ReplayMismatch] = field(default_factory=list)
    """The latest replayed updates' values that differed from the server's copy (not sent again)."""
    replay_mismatch_count: int = 0
    """How many such differences were found over the line's life (the list keeps the latest ones)."""

    def plan_rewind(self, to_update: int) -> bool:
        """Plan the rewind a rollback to `to_update` asks of the next start; False: nothing to plan.

        Nothing is planned for a branch whose fork has not begun (its fork starts it as planned;
        the caller refuses a rollback before the fork point) or for a line without a run (its first
        start sends the rows as they are then). Where a rewind planned earlier has not begun (W&B
        out since), the run still holds the steps that rollback abandoned past its point: the earlier
        point is kept, for a rewind to the later one would keep those steps.
        """
        if self.pending is not None and self.pending.kind == "fork":
            return False
        if self.run_id is None:
            return False
        if self.pending is not None and not self.pending.initialized:
            to_update = min(to_update, self.pending.at_update)
        self.pending = PendingStart(kind="rewind", at_update=to_update)
        self.gap = None  # the rewound run is rebuilt from rows.jsonl up to the rollback point
        return True

    def record_replay_mismatches(self, mismatches: list[ReplayMismatch]) -> None:
        self.replay_mismatch_count += len(mismatches)
        self.replay_mismatches = (self.replay_mismatches + mismatches)[-KEPT_REPLAY_MISMATCHES:]

    @classmethod
    def load(cls, path: Path) -> WandbRunState:
        """Read `path`; a missing file is a line that has no run yet."""
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return cls()
        except OSError as error:
            raise WandbStateError(f"{path.name}: cannot be read: {error.strerror}") from error
        except UnicodeDecodeError as error:
            raise WandbStateError(f"{path.name}: not UTF-8 text (byte {error.start})") from error
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise WandbStateError(f"{path.name}: {malformed_json(error)}") from error
        except ValueError as error:  # an integer past Python's 4,300-digit conversion limit
            raise WandbStateError(f"{path.name}: cannot be parsed ({str(error).split(';')[0]})") from error
        return cls.from_dict(data, source=path.name)

    @classmethod
    def from_dict(cls, data: Any, source: str = "wandb_run.json") -> WandbRunState:
        reader = _Reader(source)
        reader.expect_object("", data)
        version = data.get("version")
        if version != STATE_VERSION:
            raise WandbStateError(f"{source}: version must be {STATE_VERSION}, got {version!r}")
        state = cls(
            run_id=reader.optional(data, "run_id", str),
            start=reader.optional_choice(data, "start", START_KINDS),
            method=reader.optional_choice(data, "method", METHODS),
            acknowledged_step=reader.optional(data, "acknowledged_step", int),
            fork_unsupported=reader.optional(data, "fork_unsupported", bool) or False,
            rewind_unsupported=reader.optional(data, "rewind_unsupported", bool) or False,
            replay_mismatch_count=reader.optional(data, "replay_mismatch_count", int) or 0,
        )
        if data.get("parent") is not None:
            state.parent = reader.record(data, "parent", RunPoint)
        if data.get("pending") is not None:
            state.pending = reader.record(data, "pending", PendingStart)
            if state.pending.kind not in ("rewind", "fork"):
                kind = state.pending.kind
                raise WandbStateError(f"{source}: pending.kind must be rewind or fork, got {kind!r}")
        if data.get("gap") is not None:
            state.gap = reader.record(data, "gap", Gap)
        state.superseded = reader.records(data, "superseded", SupersededRun)
        state.local_files = reader.records(data, "local_files", LocalRunFiles)
        state.replay_mismatches = reader.records(data, "replay_mismatches", ReplayMismatch)
        return state

    def to_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, **asdict(self)}

    def save(self, path: Path) -> None:
        """Replace `path` atomically and durably."""
        write_text_atomic(path, json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")


class _Reader:
    """Type checks with messages that name the file and the key."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, key: str, problem: str) -> WandbStateError:
        return WandbStateError(f"{self.source}: {key} {problem}")

    def expect_object(self, key: str, value: Any) -> None:
        if not isinstance(value, dict):
            raise self.fail(key or "the top level", f"must be an object, got {type(value).__name__}")

    def optional(self, data: dict[str, Any], key: str, kind: type, prefix: str = "") -> Any:
        value = data.get(key)
        # bool is an int in Python; a step of `true` is still an error.
        if value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
            raise self.fail(prefix + key, f"must be {kind.__name__} or null, got {json.dumps(value)}")
        # Every whole number of the file is a step, an update or a count: below 0 is no line's.
        if kind is int and value is not None and value < 0:
            raise self.fail(prefix + key, f"must be 0 or more, got {value}")
        # Every run id of the file (run_id, parent_run_id, new_run_id, by_run_id) ends so.
        if key.endswith("run_id") and value is not None and not _is_run_id(value):
            raise self.fail(prefix + key, f"must be a W&B run id, got {json.dumps(value)}")
        return value

    def optional_choice(self, data: dict[str, Any], key: str, choices: tuple[str, ...]) -> str | None:
        value = self.optional(data, key, str)
        if value is not None and value not in choices:
            raise self.fail(key, f"must be one of {', '.join(choices)}, got {value!r}")
        return value

    def record(self, data: dict[str, Any], key: str, kind: type, label: str | None = None) -> Any:
        """Build dataclass `kind` from `data[key]`; `label` names it in messages (default: key)."""
        label = label or key
        value = data[key]
        self.expect_object(label, value)
        fields = kind.__dataclass_fields__
        unknown = sorted(set(value) - set(fields))
        if unknown:
            raise self.fail(f"{label}.{unknown[0]}", "is not a known key")
        arguments: dict[str, Any] = {}
        for name, spec in fields.items():
            # Annotations are strings here (postponed evaluation): "int", "str | None", "bool".
            annotation = str(spec.type)
            field_type = bool if "bool" in annotation else int if "int" in annotation else str
            required = spec.default is MISSING and spec.default_factory is MISSING
            if required and value.get(name) is None:
                raise self.fail(f"{label}.{name}", "is missing")
            if name in value:
                arguments[name] = self.optional(value, name, field_type, prefix=f"{label}.")
        return kind(**arguments)

    def records(self, data: dict[str, Any], key: str, kind: type) -> list[Any]:
        values = data.get(key) or []
        if not isinstance(values, list):
            raise self.fail(key, f"must be a list, got {type(values).__name__}")
        return [
            self.record({key: item}, key, kind, label=f"{key}[{index}]") for index, item in enumerate(values)
        ]


def _is_run_id(value: str) -> bool:
    """Whether W&B takes `value` as a run id (wandb_settings.validate_run_id)."""
    return bool(value) and value == value.strip() and not any(character in RUN_ID_RESERVED for character in value)


def synced_after_last_write(directory: Path) -> bool:
    """Whether `wandb sync` marked the directory's log synced after the log's last write.

    A sync of a log still being written (a cron job beside a running line) marks it synced all the
    same; the rows written after that are only in the directory, so it must stay.
    """
    for marker in directory.glob("*.wandb.synced"):
        log = marker.with_suffix("")  # run-<id>.wandb.synced -> run-<id>.wandb
        try:
            written = log.stat().st_mtime_ns
        except FileNotFoundError:
            return True  # no log: nothing in it to lose
        return marker.stat().st_mtime_ns >= written
    return False
