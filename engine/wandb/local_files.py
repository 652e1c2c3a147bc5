"""The W&B client's local directories of a line's runs (`<line>/wandb/`): found, listed in
wandb_run.json, and removed at a later start once nothing needs them."""

from __future__ import annotations

import shutil
from pathlib import Path

from engine.wandb.state import LocalRunFiles, WandbRunState, synced_after_last_write
from engine.wandb.txlog import FILE_HEADER, transaction_log_of

CRASHED_ONLINE_KEPT = 2
"""Directories of crashed online sessions kept (the newest), for their debug logs. Nothing else needs
them: the server holds what their client uploaded, and the next start re-sends from rows.jsonl what
it lacks; each holds its session's rows again, so a line killed hundreds of times kept GiBs."""


def remove_finished_local_files(state: WandbRunState) -> None:
    """Remove the client's directories of earlier sessions that nothing needs any more: online, of
    cleanly finished runs, and of crashed ones but the newest `CRASHED_ONLINE_KEPT`; offline, once
    `wandb sync` uploaded all their log holds, crashed sessions' included (a line that restarts
    hundreds of times would keep every one of those otherwise)."""
    crashed_online = [entry for entry in state.local_files if not entry.offline and not entry.finished]
    kept_crashed = {id(entry) for entry in crashed_online[len(crashed_online) - CRASHED_ONLINE_KEPT:]}
    kept = []
    for entry in state.local_files:
        directory = Path(entry.path)
        if not directory.exists():
            continue
        if entry.offline:
            needless = synced_after_last_write(directory) or log_is_empty(directory)
        else:
            needless = entry.finished or id(entry) not in kept_crashed
        if needless:
            shutil.rmtree(directory, ignore_errors=True)
            continue
        kept.append(entry)
    state.local_files = kept


def adopt_untracked_local_files(state: WandbRunState, wandb_dir: Path) -> None:
    """List the client's directories of this line's runs that wandb_run.json lacks: a trainer
    killed while `wandb.init` ran (seconds, at each start) left one before the mirror recorded it,
    and a directory never listed is never removed.

    A listed directory that is not one of `wandb_dir`'s is none of this line's (a wandb_run.json
    damaged or edited by hand, or copied with its line, whose paths name the original's): it is
    unlisted, so that `remove_finished_local_files` never deletes what the client did not write here.
    """
    own = wandb_dir.resolve()
    state.local_files = [entry for entry in state.local_files if Path(entry.path).resolve().parent == own]
    run_ids = {state.run_id, *(entry.run_id for entry in state.superseded)}
    if state.pending is not None:
        run_ids.add(state.pending.new_run_id)
    listed = {Path(entry.path).resolve() for entry in state.local_files}
    # The client names them `run-<time>-<id>` (online) and `offline-run-<time>-<id>`.
    for directory in sorted(wandb_dir.glob("*run-*-*")):
        run_id = directory.name.rsplit("-", 1)[1]
        if directory.is_symlink() or not directory.is_dir() or run_id not in run_ids:
            continue
        if directory.resolve() not in listed:
            offline = directory.name.startswith("offline-")
            state.local_files.append(LocalRunFiles(str(directory), run_id, offline=offline))


def log_is_empty(directory: Path) -> bool:
    """Whether the directory's log holds no record (its session ended before it logged any)."""
    log = transaction_log_of(directory)
    return log is None or log.stat().st_size <= len(FILE_HEADER)
