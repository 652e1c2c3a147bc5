"""The client's directories over a line's many restarts: offline ones removed once `wandb sync`
uploaded everything their log holds (or at once when it holds nothing), kept while anything in them
is not uploaded yet, and listed even when a trainer killed during `wandb.init` could not list them;
online ones of crashed sessions kept only for the newest few."""

from __future__ import annotations

import os
from pathlib import Path

from engine.wandb.local_files import (
    CRASHED_ONLINE_KEPT,
    adopt_untracked_local_files,
    remove_finished_local_files,
)
from engine.wandb.state import LocalRunFiles, WandbRunState
from engine.wandb.txlog import FILE_HEADER

SECOND = 1_000_000_000


def offline_directory(
    root: Path, name: str, run_id: str, log_written: int, synced: int | None, records: bool = True
) -> Path:
    """An offline run directory whose log (with some records, or only its header) was last written
    at `log_written` (s) and marked synced by `wandb sync` at `synced` (None: never)."""
    directory = root / name
    directory.mkdir()
    log = directory / f"run-{run_id}.wandb"
    log.write_bytes(FILE_HEADER + (b"records" if records else b""))
    os.utime(log, ns=(log_written * SECOND, log_written * SECOND))
    if synced is not None:
        marker = directory / f"run-{run_id}.wandb.synced"
        marker.touch()
        os.utime(marker, ns=(synced * SECOND, synced * SECOND))
    return directory


def test_a_directory_synced_while_it_was_still_written_is_kept(tmp_path: Path) -> None:
    # `wandb sync` ran at 100 s while the session went on writing until 200 s and then finished:
    # the rows of 100..200 s are in this directory alone (and the acknowledgement is past them).
    directory = offline_directory(tmp_path, "offline-run-1-a", "a", log_written=200, synced=100)
    state = WandbRunState(local_files=[LocalRunFiles(str(directory), "a", offline=True, finished=True)])
    remove_finished_local_files(state)
    assert directory.exists() and [entry.run_id for entry in state.local_files] == ["a"]


def test_a_crashed_sessions_directory_goes_once_synced_after_its_last_write(tmp_path: Path) -> None:
    # Each kill -9 leaves a directory that was never finished; a weeks-long line has hundreds.
    synced = offline_directory(tmp_path, "offline-run-1-a", "a", log_written=100, synced=150)
    unsynced = offline_directory(tmp_path, "offline-run-2-a", "a", log_written=300, synced=None)
    state = WandbRunState(local_files=[
        LocalRunFiles(str(synced), "a", offline=True, finished=False),
        LocalRunFiles(str(unsynced), "a", offline=True, finished=False),
    ])
    remove_finished_local_files(state)
    assert not synced.exists() and unsynced.exists()
    assert [entry.path for entry in state.local_files] == [str(unsynced)]


def test_directories_a_killed_start_left_unlisted_are_listed_and_an_empty_one_removed(tmp_path: Path) -> None:
    # A trainer killed while wandb.init ran (seconds, at each start) left a directory that
    # wandb_run.json never listed: never removed, and a log with only its header.
    wandb_dir = tmp_path / "wandb"
    wandb_dir.mkdir()
    empty = offline_directory(wandb_dir, "offline-run-20260101_000000-a", "a", 100, synced=None, records=False)
    logged = offline_directory(wandb_dir, "offline-run-20260101_000100-a", "a", log_written=200, synced=None)
    other = offline_directory(wandb_dir, "offline-run-20260101_000200-z", "z", log_written=300, synced=None)
    state = WandbRunState(run_id="a")
    adopt_untracked_local_files(state, wandb_dir)
    assert [(entry.path, entry.offline, entry.finished) for entry in state.local_files] == [
        (str(empty), True, False),
        (str(logged), True, False),
    ]
    adopt_untracked_local_files(state, wandb_dir)  # listed once only
    assert len(state.local_files) == 2
    remove_finished_local_files(state)
    assert not empty.exists() and logged.exists() and other.exists()  # another run's: not this line's
    assert [entry.path for entry in state.local_files] == [str(logged)]


def test_online_directories_of_crashed_sessions_are_kept_only_for_the_newest(tmp_path: Path) -> None:
    # Online, the server is the record and rows.jsonl re-sends what it lacks: a crashed session's
    # directory (its rows again) is kept only for the debug logs of the newest few.
    directories = []
    for index in range(5):
        directory = tmp_path / f"run-{index}-a"
        directory.mkdir()
        directories.append(directory)
    finished = tmp_path / "run-5-a"
    finished.mkdir()
    unsynced = offline_directory(tmp_path, "offline-run-6-a", "a", log_written=300, synced=None)
    state = WandbRunState(local_files=[
        *(LocalRunFiles(str(directory), "a", offline=False) for directory in directories),
        LocalRunFiles(str(finished), "a", offline=False, finished=True),
        LocalRunFiles(str(unsynced), "a", offline=True),
    ])
    remove_finished_local_files(state)
    assert [entry.path for entry in state.local_files] == [*(str(d) for d in directories[-CRASHED_ONLINE_KEPT:]),
                                                           str(unsynced)]  # fmt: skip
    assert [directory.exists() for directory in directories] == [False, False, False, True, True]
    assert not finished.exists()
