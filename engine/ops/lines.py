"""Operations on a training line's files: create one, accept its configuration, request a stop.

Each operation validates everything before it writes anything, and every file it writes is
replaced atomically, so a refusal or a crash leaves the line as it was.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import datalines
from datalines.errors import DataLineError
from engine.checkpoints.format import read_checkpoint_state, resume_candidate
from engine.config.run import (
    RunConfig,
    TrainedSoFar,
    accepted_changes,
    check_changes,
)
from engine.errors import ConfigError, LineError
from engine.layout import LineLayout
from engine.models import presets
from engine.training.position import Position

DATA_LINE_MARKER = "dataline.json"


def open_line(root: Path | str) -> LineLayout:
    """The layout of an existing training line (a directory holding run.json)."""
    layout = LineLayout(root)
    if not layout.root.is_dir():
        if layout.root.exists():  # a file named for a line (its run.json, say): not "no such" line
            raise LineError(f"{layout.root}: not a directory; a training line is a directory holding run.json")
        raise LineError(f"{layout.root}: no such training line directory")
    if layout.run_json.is_dir():
        raise LineError(f"{layout.run_json}: a directory, not the line's run.json; move it away")
    if not layout.run_json.is_file():
        raise LineError(f"{layout.root}: not a training line (no run.json)")
    return layout


def refuse_an_unwritable_directory(directory: Path, doing: str) -> None:
    """`LineError` (one line) when `directory` takes no new file (a read-only file system, no write
    permission) while `doing` must write there: said before anything starts, where the write would
    otherwise fail part-way through as a traceback."""
    if directory.is_dir() and not os.access(directory, os.W_OK | os.X_OK):
        raise LineError(
            f"{directory}: not writable (a read-only file system, or no write permission), and {doing} writes "
            "there; nothing was changed"
        )


@contextmanager
def failed_writes_said(doing: str, where: Path) -> Iterator[None]:
    """An `OSError` inside (a full disk, an I/O error) as a `LineError` of one line naming the file
    (`where` when the error names none: a failed write(2) does not) and what `doing` was: a
    traceback would hide which file, and what to do."""
    try:
        yield
    except OSError as error:
        named = error.filename if error.filename is not None else where
        raise LineError(
            f"{named}: {error.strerror or error} ({doing} stopped there; free some space if the disk is full, "
            "and run it again)"
        ) from None


def refuse_an_unwritable_line(layout: LineLayout, doing: str) -> None:
    """`refuse_an_unwritable_directory` for the line's directory and its checkpoints' (where
    `latest` and the pins are replaced)."""
    for directory in (layout.root, layout.checkpoints):
        refuse_an_unwritable_directory(directory, doing)


def resolve_data_path(layout: LineLayout, data_line: str) -> Path:
    """A data line path from run.json: absolute, or relative to the training line's directory."""
    path = Path(data_line).expanduser()
    return path if path.is_absolute() else layout.root / path


# -- data lines -----------------------------------------------------------------------------------


@dataclass
class DataLineFacts:
    """What a training line needs to know of its data line."""

    path: Path
    """The data line directory."""
    vocab_size: int
    """The tokenizer's vocabulary size."""
    eos_id: int
    """The end-of-document token id."""


def inspect_data_line(path: Path) -> DataLineFacts:
    """Open a data line and read its vocabulary; DataLineError / LineError when it is missing or broken."""
    if not path.is_dir():
        raise LineError(f"{path}: no such data line directory")
    if not (path / DATA_LINE_MARKER).is_file():
        raise LineError(f"{path}: not a data line (no {DATA_LINE_MARKER})")
    data_line = datalines.open_data_line(path)  # loads numpy and pyarrow: only when a line is opened
    return DataLineFacts(path, int(data_line.vocab_size), int(data_line.eos_id))


def model_vocab_size(config: RunConfig) -> int:
    """The vocabulary of the model a configuration builds (its preset with overrides)."""

    return int(presets.preset_config(config.model.preset, config.model.overrides).vocab_size)


# -- new ------------------------------------------------------------------------------------------


# -- accepting a configuration --------------------------------------------------------------------


def load_accepted(layout: LineLayout) -> RunConfig | None:
    """The accepted configuration (None when the line has never been accepted)."""
    if not layout.accepted_run_json.exists():
        return None
    return RunConfig.load(layout.accepted_run_json)


def unaccepted_changes(layout: LineLayout, config: RunConfig) -> list[str]:
    """The lifelong-key changes of `config` that accepted_run.json does not allow (one message each),
    the schedule's and the ramp's growth judged from where the line stands (`trained_so_far`): `check`,
    every start of the trainer (a supervisor's relaunch included) and `accept` ask here alike."""
    accepted = load_accepted(layout)
    return [] if accepted is None else _refusals(layout, accepted, config)


def _refusals(layout: LineLayout, accepted: RunConfig, config: RunConfig) -> list[str]:
    trained = trained_so_far(layout, config)
    return [f"{layout.run_json.name}: {message}" for message in check_changes(accepted, config, trained)]


def trained_so_far(layout: LineLayout, config: RunConfig) -> TrainedSoFar | None:
    """Where the line stands by its checkpoint `latest` (None: none yet, or unreadable, which the
    checkpoint checks report): the clocks a schedule's growth must not start before."""
    resumed = resume_candidate(layout.checkpoints)  # `latest`, or the one a start falls back to
    state = None if resumed is None else read_checkpoint_state(resumed)
    if state is None:
        return None
    try:
        position = Position(**state["position"])
        seq_len = int(state["data"]["seq_len"])
        data_line = datalines.open_data_line(resolve_data_path(layout, config.data.line))
        return TrainedSoFar(position.tokens_trained, position.data_tokens(data_line, seq_len))
    except (TypeError, KeyError, ValueError, LineError, DataLineError):
        return None


def accept(root: Path | str, config: RunConfig | None = None) -> list[str]:
    """Record run.json (or `config`, read from it) as the accepted configuration of a checked start;
    what it accepts that accepted_run.json did not hold (`accepted_changes`, for run.log).

    Refuses (ConfigError, nothing written) when a lifelong key changed without allow_changes or a
    schedule was rewritten rather than grown. A listing in allow_changes permits one change: once
    accepted, the list is cleared in accepted_run.json and in run.json (unless run.json was
    edited again meanwhile), so a later accidental edit of the same key is caught again.
    """
    layout = open_line(root)
    current = config if config is not None else RunConfig.load(layout.run_json)
    previous = load_accepted(layout)
    problems = [] if previous is None else _refusals(layout, previous, current)
    if problems:
        raise ConfigError("; ".join(problems))
    accepted = dataclasses.replace(current, allow_changes=[])
    accepted.save(layout.accepted_run_json)
    if current.allow_changes and _load_or_none(layout.run_json) == current:
        accepted.save(layout.run_json)
    return [] if previous is None else accepted_changes(previous, current)


def _load_or_none(path: Path) -> RunConfig | None:
    try:
        return RunConfig.load(path)
    except ConfigError:
        return None


# -- stop -----------------------------------------------------------------------------------------


