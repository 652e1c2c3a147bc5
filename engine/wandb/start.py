"""Starting a line's W&B run so that its curve has no hole: new, resume, fork or rewind.

`start_run` is one attempt; when W&B fails part-way it raises, and the mirror calls it again
later. Every attempt is idempotent: the state in wandb_run.json is saved before each step that
W&B could half-do (a new run's id is chosen and saved before the run is created; a planned fork
or rewind stays `pending` until its run exists and its backfill was handed over), so a retry, or
the next start after a crash, continues instead of starting yet another run.

What each kind sends (rows from rows.jsonl, never anything invented):
- new: every row of the line;
- resume: every row after the last step the server holds (online: what it reports at the
  resume; offline: the last step the local log acknowledged);
- rewind to U (a rollback): natively `resume_from=RUN?_step=S` with S = min(U, acknowledged),
  then the rows S < update <= R; without native rewind, a new run backfilled with the rows up
  to R, and the old run marked superseded. R is the update of the checkpoint the trainer resumed
  from: U at the start right after the rollback, later where the rewind waited out sessions that
  trained on (W&B out); U where the caller does not say (`_rows_through`);
- fork at N (a branch): natively `fork_from=PARENT?_step=S` with S = min(N, the parent's
  acknowledged step), then the parent's rows S < update <= N; without it, a new run backfilled
  from the parent's rows up to N. Then the branch's own rows after N.
A native attempt that W&B refuses while the plain start right after it works means the server
lacks the feature: that is recorded, and later starts of the line go straight to the backfill.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.layout import LineLayout
from engine.wandb.backend import StartedRun, WandbBackend
from engine.wandb.rows import read_rows, row_update, row_values
from engine.wandb.state import LocalRunFiles, PendingStart, RunPoint, SupersededRun, WandbRunState

logger = logging.getLogger("nsconsole.wandb")


@dataclass
class StartContext:
    """What one start attempt works with."""

    backend: WandbBackend
    layout: LineLayout
    state: WandbRunState
    """The line's wandb_run.json, updated and saved by the attempt."""
    run_config: dict[str, Any]
    """The run's W&B config (the line's run.json)."""
    new_run_id: Callable[[], str]
    """Chooses the id of a run that does not exist yet."""
    server_through: int | None = None
    """Set when the attempt continued an existing run online: the last step the server said it
    holds. The trainer's replayed updates up to it are compared with the server's, not sent."""
    say: Callable[[str], None] = logger.warning
    """One line for the operator: the mirror's run.log writer (a refused fork or rewind changes
    what the line's W&B record looks like, so the user must see it where they look)."""
    resumed_from: int | None = None
    """The update of the checkpoint the trainer resumed from, rows.jsonl cut back to it before the
    mirror started; None: a new line, or a caller that does not say."""

    def save(self) -> None:
        # The attempt goes no further than its state is saved (a retry must find it), so a failure
        # here is the attempt's failure; its message names the file (ENOSPC alone does not).
        path = self.layout.wandb_run_json
        try:
            self.state.save(path)
        except OSError as error:
            raise OSError(error.errno, f"could not save {path}: {error.strerror or error}") from error


def start_run(context: StartContext) -> int | None:
    """Start (or continue) the line's run and hand it every row it lacks; returns the last step sent.

    Raises whatever W&B raised when it failed; the state on disk is then safe to retry from.
    """
    state = context.state
    if state.pending is not None and state.pending.kind == "rewind" and state.run_id is not None:
        return _rewind(context, state.pending)
    if state.pending is not None and state.pending.kind == "fork":
        return _fork(context, state.pending)
    if state.pending is not None:
        # A rollback of a line that never had a run: its first run simply holds the line's rows.
        through = _rows_through(context, state.pending)
        state.pending = None
        return _new_or_resume(context, through=through)
    return _new_or_resume(context, through=None)


def _new_or_resume(context: StartContext, through: int | None) -> int | None:
    state = context.state
    if state.run_id is None:
        state.run_id = context.new_run_id()
        state.start, state.method, state.parent, state.acknowledged_step = "new", None, None, None
        context.save()
    else:
        state.start = "resume"
    sent_through = _continue(context, state.run_id)
    rows = read_rows(context.layout.rows_jsonl, after=sent_through, through=through)
    sent_through = _send(context, rows, sent_through)
    context.save()
    return sent_through


def _rewind(context: StartContext, pending: PendingStart) -> int | None:
    state = context.state
    old_run_id = state.run_id
    assert old_run_id is not None
    target = pending.at_update
    if pending.initialized:
        # The rewound (or replacing) run exists: continue it and finish handing over its rows.
        # rows.jsonl was cut back to the trainer's checkpoint before this run began, so every row
        # in it now, up to or past the rollback point, belongs to the line's present.
        sent_through = _continue(context, old_run_id)
        rows = read_rows(context.layout.rows_jsonl, after=sent_through)
        return _finish_pending(context, rows, sent_through)
    acknowledged = state.acknowledged_step
    native_error: Exception | None = None
    if context.backend.supports_rewind() and not state.rewind_unsupported and acknowledged is not None:
        point = RunPoint(old_run_id, min(target, acknowledged))
        try:
            _init(context, None, resume_from=point)
        except Exception as error:  # any refusal: the backfill right after tells refusal from outage
            native_error = error
        else:
            state.start, state.method, state.parent = "rewind", "native", point
            state.acknowledged_step = point.step
            pending.initialized = True
            context.save()
            return _finish_pending(context, _own_rows(context, pending, point.step), point.step)
    # Without native rewind: a new run holding the line's rows.
    if pending.new_run_id is None:
        pending.new_run_id = context.new_run_id()
        context.save()
    new_run_id = pending.new_run_id
    _init(context, new_run_id, resume=True)
    if native_error is not None:
        context.say(f"W&B refused to rewind run {old_run_id} ({native_error}); the rollback starts a new run")
        state.rewind_unsupported = True
    if not any(entry.run_id == old_run_id for entry in state.superseded):
        state.superseded.append(SupersededRun(run_id=old_run_id, by_run_id=new_run_id, at_update=target))
    state.run_id, state.start, state.method = new_run_id, "rewind", "backfill"
    state.parent = RunPoint(old_run_id, target)
    state.acknowledged_step = None
    # The pending record moves with the state: a retry now continues the new run.
    pending.initialized = True
    context.save()
    return _finish_pending(context, _own_rows(context, pending, None), None)


def _fork(context: StartContext, pending: PendingStart) -> int | None:
    state = context.state
    if pending.new_run_id is None:
        pending.new_run_id = context.new_run_id()
        context.save()
    new_run_id = pending.new_run_id
    if pending.initialized:
        sent_through = _continue(context, new_run_id)
        return _finish_pending(context, _branch_rows(context, pending, sent_through), sent_through)
    native_error: Exception | None = None
    if (
        context.backend.supports_fork()
        and not state.fork_unsupported
        and pending.parent_run_id is not None
        and pending.parent_acknowledged is not None
    ):
        point = RunPoint(pending.parent_run_id, min(pending.at_update, pending.parent_acknowledged))
        try:
            _init(context, new_run_id, fork_from=point)
        except Exception as error:  # any refusal: the backfill right after tells refusal from outage
            native_error = error
        else:
            state.run_id, state.start, state.method, state.parent = new_run_id, "fork", "native", point
            state.acknowledged_step = point.step
            pending.initialized = True
            context.save()
            return _finish_pending(context, _branch_rows(context, pending, point.step), point.step)
    _init(context, new_run_id, resume=True)
    if native_error is not None:
        parent = pending.parent_run_id
        context.say(f"W&B refused to fork run {parent} ({native_error}); the branch starts a new run")
        state.fork_unsupported = True
    state.run_id, state.start, state.method = new_run_id, "fork", "backfill"
    state.parent = RunPoint(pending.parent_run_id, pending.at_update) if pending.parent_run_id else None
    state.acknowledged_step = None
    pending.initialized = True
    context.save()
    return _finish_pending(context, _branch_rows(context, pending, None), None)


def _own_rows(context: StartContext, pending: PendingStart, after: int | None) -> Iterator[dict[str, Any]]:
    """A rolled-back line's rows after `after`, up to `_rows_through`."""
    return read_rows(context.layout.rows_jsonl, after=after, through=_rows_through(context, pending))


def _rows_through(context: StartContext, pending: PendingStart) -> int:
    """The last update a rollback's start sends from rows.jsonl; the rows after it come through the
    mirror's queue as the trainer writes them.

    The update the trainer resumed from: rows.jsonl holds the line's rows up to it and no further
    (cut back there before the start). It lies past the rollback point where the rewind waited out
    a session that trained on (W&B out all along, each checkpoint recording the rewind as
    pending): the rows of that session are the line's, and W&B has none of them. Where the caller
    does not say, the rollback point: past it, a rows.jsonl not cut back yet may still hold the
    abandoned continuation, which must never reach W&B.
    """
    return pending.at_update if context.resumed_from is None else context.resumed_from


def _branch_rows(context: StartContext, pending: PendingStart, after: int | None) -> Iterator[dict[str, Any]]:
    """The parent's rows up to the fork point, then the branch's own rows after it."""
    if pending.parent_rows is not None:
        yield from read_rows(Path(pending.parent_rows), after=after, through=pending.at_update)
    own_after = pending.at_update if after is None else max(after, pending.at_update)
    yield from read_rows(context.layout.rows_jsonl, after=own_after)


def _finish_pending(
    context: StartContext, rows: Iterator[dict[str, Any]], sent_through: int | None
) -> int | None:
    sent_through = _send(context, rows, sent_through)
    context.state.pending = None
    context.save()
    return sent_through


def _continue(context: StartContext, run_id: str) -> int | None:
    """Continue an existing run; returns the last step it already holds.

    Online, the server says which step it expects next, and its word wins over the recorded
    acknowledgement (it may hold more: rows sent just before a crash; or less: a run the server
    never had). Offline nothing is said, and the recorded acknowledgement stands.
    """
    started = _init(context, run_id, resume=True)
    if started.next_step is not None:
        context.state.acknowledged_step = started.next_step - 1 if started.next_step > 0 else None
        context.server_through = context.state.acknowledged_step
    return context.state.acknowledged_step


def _init(context: StartContext, run_id: str | None, **arguments: Any) -> StartedRun:
    started = context.backend.init(run_id, config=context.run_config, **arguments)
    if started.local_dir is not None:
        path = str(started.local_dir)
        if not any(entry.path == path for entry in context.state.local_files):
            entry = LocalRunFiles(path=path, run_id=started.run_id, offline=started.offline)
            context.state.local_files.append(entry)
    return started


def _send(context: StartContext, rows: Iterator[dict[str, Any]], sent_through: int | None) -> int | None:
    for row in rows:
        update = row_update(row)
        assert update is not None  # read_rows yields rows only
        context.backend.log(row_values(row), step=update)
        sent_through = update
    return sent_through


def mark_superseded_runs(context: StartContext) -> None:
    """Put the superseded mark on old runs that did not get it yet; W&B unreachable: next time."""
    for entry in context.state.superseded:
        if entry.marked:
            continue
        try:
            started = context.backend.mark_superseded(entry.run_id, entry.by_run_id, entry.at_update)
        except Exception as error:  # W&B may be down: the mark waits for a later start
            context.say(f"W&B: could not mark run {entry.run_id} superseded ({error}); the next start tries again")
            return
        entry.marked = True
        if started.local_dir is not None:
            directory = str(started.local_dir)
            files = LocalRunFiles(directory, entry.run_id, offline=started.offline, finished=True)
            context.state.local_files.append(files)
        context.save()
