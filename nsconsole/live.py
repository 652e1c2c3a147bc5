"""The console's live attachment to every supervisor on this host.

`LiveLines` lists the registered supervisors (`engine.supervisor.registry.list_supervisors`) every few
seconds, keeps one `SupervisorLink` per line (reconnects with backoff, re-subscribes, tells us
when it is back) and feeds each line's `LineView`: on every (re)connection the hello, the
status and, from a new supervisor, the newest rows of rows.jsonl whole and the older ones as a
downsampled history (fetched in pages: an attach costs the same on a line of months); then the pushed
notifications, and a status poll while connected. A line whose supervisor is gone stays in the
book with its last state (the link keeps trying), marked `orphaned` once the trainer's pid has
gone too (nothing runs it then, whatever its last state said); mutations go through `mutate`, which keeps one
request_id across reconnects so a retry is applied once, and fails at once when no supervisor is
registered for the line any more (it exited: no reconnect will come).

Lines no supervisor runs (ended, stopped, failed; in the work roots or the history of registered
lines, `nsconsole/history.py`) are read from their files at rest every `HISTORY_INTERVAL_S` and
shown with the state they ended in; once a supervisor registers for one, it is attached as any other.
A line no supervisor runs whose directory was removed (its supervisor.json gone) leaves the book.

Everything runs on the console's asyncio loop; `on_change(line)` is called after each change.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from engine.config.run import RunConfig
from engine.errors import LineError
from engine.layout import LineLayout
from engine.protocol import wire
from engine.protocol.facts import EventKind
from engine.supervisor.reads import read_log_chunk
from engine.supervisor.registry import SupervisorEntry, line_id, list_supervisors
from engine.training.schedule import learning_rate
from nsconsole.client import (
    AsyncSupervisorClient,
    Notification,
    RemoteError,
    SupervisorLink,
    SupervisorUnavailable,
    missing_methods,
    new_request_id,
    older_supervisor_words,
)
from nsconsole.history import RestingLine, Signature, files_signature, line_candidates, read_at_rest
from nsconsole.row_fetch import line_rows, whole_row
from nsconsole.state import LineBook, LineFacts, LineView

DISCOVERY_INTERVAL_S = 2.0
HISTORY_INTERVAL_S = 10.0
"""How often the lines that no supervisor runs are looked for (their files read again only when changed)."""
STATUS_INTERVAL_S = 1.0
MUTATION_ATTEMPTS = 5
GONE_CHECK_S = 0.5
"""How often a mutation waiting for its line's link looks whether a supervisor still serves the line."""
MUTATION_REPLY_TIMEOUT_S = 3600.0
"""How long a mutation's reply may take on a live connection: the supervisor answers a rollback or
a tune once it is done (the trainer's checkpoint, then minutes of measuring on a GPU); a dropped
connection fails the call at once and the retry waits on the same request_id."""


def gone_words(line: LineView, method: str, sent: bool) -> str:
    """The answer to a mutation whose line's supervisor has exited: the request was not sent, or it
    was and no reply came (it may have been carried out: the line's status says)."""
    who = f"its supervisor (pid {line.supervisor_pid})" if line.supervisor_pid is not None else "its supervisor"
    if sent:
        return (f"{line.path}: {who} exited before it answered the {method}; "
                f"`nsconsole status {line.path}` shows whether it was done")
    state = "" if line.supervisor_state is None else f" (state {line.supervisor_state})"
    return f"{line.path}: {who} has exited{state}; the {method} was not sent"


def removed_lines(shown: list[tuple[str, str]]) -> list[str]:
    """The keys of the (key, path) lines, none of them run by a supervisor, whose supervisor.json is
    gone: their directory was removed by hand (a finished branch cleaned up), so there is nothing to
    show, open or resume (the history and the work roots leave such a line out as well)."""
    return [key for key, path in shown if not LineLayout(path).supervisor_json.is_file()]


def read_line_facts(line: str | Path) -> LineFacts:
    """The facts the console needs from a line's run.json (empty facts when it does not load)."""
    try:
        config = RunConfig.load(Path(line) / "run.json")
    except (LineError, OSError):
        return LineFacts()
    return LineFacts(
        preset=config.model.preset,
        schedule=lambda tokens: learning_rate(config, tokens),
        share_reserve_gb=config.guards.share_reserve_gb,
        min_free_disk_gb=config.guards.min_free_disk_gb,
    )


def process_running(pid: int | None) -> bool:
    """Whether `pid` is a process that has not exited (a zombie has)."""
    if pid is None:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True  # it exists


def nothing_runs(entry: SupervisorEntry, trainer_pid: int | None) -> bool:
    """The supervisor is gone (its socket removed, or its process dead) and so is the trainer."""
    supervisor_gone = not os.path.exists(entry.socket) or not entry.is_alive()
    return supervisor_gone and not process_running(trainer_pid)


class _Attachment:
    """One line's link, the task running it and its status poll."""

    def __init__(self, owner: LiveLines, state: LineView, entry: SupervisorEntry) -> None:
        self.owner = owner
        self.state = state
        self.entry = entry
        self.link = SupervisorLink(
            entry.socket, self._on_connected, self._on_notification, self._on_disconnected,
            initial_backoff=owner.initial_backoff, max_backoff=owner.max_backoff, call_timeout=owner.call_timeout,
        )
        self.task: asyncio.Task[None] | None = None
        self._poll: asyncio.Task[None] | None = None
        self.reconnected = asyncio.Event()
        self._rolling_back = asyncio.Lock()
        """Held while a `rolled_back` event's rows are fetched again: a status reply meanwhile (which
        records the rollback too) waits, so no screen shows the rollback with the rows it set aside."""

    def start(self) -> None:
        self.task = asyncio.create_task(self.link.run(), name=f"link {self.state.name}")

    async def stop(self) -> None:
        for task in (self._poll, self.task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _on_connected(self, client: AsyncSupervisorClient) -> None:
        owner, state = self.owner, self.state
        fresh = state.apply_hello(client.server, owner.clock())
        state.facts = await asyncio.to_thread(read_line_facts, state.path)
        state.apply_status(await client.call("status"))
        if fresh:
            await self._fetch_rows(client)
        owner.changed(state)
        if self._poll is not None:
            self._poll.cancel()
        self._poll = asyncio.create_task(self._poll_status(client))
        self.reconnected.set()

    async def _fetch_rows(self, client: AsyncSupervisorClient) -> None:
        """The line's rows as the console holds them (`nsconsole.row_fetch.line_rows`)."""
        self.state.apply_rows(await line_rows(client.call, client.server.get("methods") or ()), 0)

    async def _poll_status(self, client: AsyncSupervisorClient) -> None:
        while not client.closed.is_set():
            await asyncio.sleep(self.owner.status_interval)
            try:
                status = await client.call("status")
            except SupervisorUnavailable:
                # A reply held up behind a mutation the supervisor is still carrying out (a tune, a
                # rollback waiting for the update in flight) times out: ask again at the next poll.
                # A lost connection sets `closed` and ends the loop.
                continue
            async with self._rolling_back:
                self.state.apply_status(status)
                self.owner.changed(self.state)

    async def _on_notification(self, notification: Notification) -> None:
        client = self.link.client
        data = notification.data
        if "omitted" in data and notification.kind in ("row", "validation") and client is not None:
            # Read whole before the next notification is handled: the rows stay in order.
            data = await whole_row(client.call, client.server.get("methods") or (), data)
        if notification.kind == "event" and notification.data.get("event") == EventKind.ROLLED_BACK and client:
            # rows.jsonl was cut back to the checkpoint's rows, and no row may come to say so (a
            # stopped line): the rows and validations set aside leave the screen with the event, in
            # one change (the rows fetched first, the event then; no status reply in between).
            async with self._rolling_back:
                await self._fetch_rows(client)
                self.state.apply_notification(notification.kind, data, self.owner.clock())
                self.owner.changed(self.state)
            return
        self.state.apply_notification(notification.kind, data, self.owner.clock())
        self.owner.changed(self.state)

    async def _on_disconnected(self, reason: str) -> None:
        self.reconnected.clear()
        if self._poll is not None:
            self._poll.cancel()
            self._poll = None
        self.state.mark_disconnected(reason, self.owner.clock())
        self.check_orphaned()
        self.owner.changed(self.state)

    def check_orphaned(self) -> None:
        """While detached: mark the line orphaned once its supervisor and its trainer are both gone."""
        state = self.state
        orphaned = not state.connected and nothing_runs(self.entry, state.trainer_pid)
        if orphaned != state.orphaned:
            state.orphaned = orphaned
            state.version += 1
            self.owner.changed(state)


class LiveLines:
    """Discovery and links for every line (see the module docstring)."""

    def __init__(
        self,
        book: LineBook,
        on_change: Callable[[LineView], None],
        clock: Callable[[], float] = time.time,
        discover: Callable[[], list[SupervisorEntry]] = list_supervisors,
        discovery_interval: float = DISCOVERY_INTERVAL_S,
        status_interval: float = STATUS_INTERVAL_S,
        initial_backoff: float = 0.2,
        max_backoff: float = 5.0,
        call_timeout: float = 30.0,
        find_lines: Callable[[], list[str]] = line_candidates,
        history_interval: float = HISTORY_INTERVAL_S,
    ) -> None:
        self.book = book
        self.on_change = on_change
        self.clock = clock
        self.discover = discover
        self.discovery_interval = discovery_interval
        self.status_interval = status_interval
        self.initial_backoff = initial_backoff
        self.max_backoff = max_backoff
        self.call_timeout = call_timeout
        """How long a read call (a status poll) waits for its reply."""
        self._attachments: dict[str, _Attachment] = {}
        self.problem: str | None = None
        """Why discovery fails (None while it works)."""
        self.find_lines = find_lines
        """Every line that may have ended (`nsconsole.history.line_candidates`)."""
        self.history_interval = history_interval
        self._history_due = 0.0  # time.monotonic() of the next look for lines at rest
        self._rested: dict[str, Signature] = {}  # the files' signature of each line read at rest

    def changed(self, state: LineView) -> None:
        self.on_change(state)

    async def run(self) -> None:
        """Discover until cancelled; then close every link."""
        try:
            while True:
                await self.discover_once()
                await asyncio.sleep(self.discovery_interval)
        finally:
            for attachment in list(self._attachments.values()):
                await attachment.stop()

    async def discover_once(self) -> None:
        try:
            entries = await asyncio.to_thread(self.discover)
        except LineError as error:
            self.problem = str(error)  # the runtime directory is unusable: the lines screen says why
            return
        self.problem = None
        for attachment in self._attachments.values():
            if not attachment.state.connected and attachment.state.ever_connected:
                attachment.check_orphaned()
        for entry in entries:
            if entry.id in self._attachments:
                continue
            state = self.book.add(LineView(entry.id, entry.line))
            attachment = _Attachment(self, state, entry)
            self._attachments[entry.id] = attachment
            attachment.start()
            self.changed(state)
        registered = {entry.id for entry in entries}
        for line in self.book:
            if line.registered != (line.key in registered):
                line.registered = line.key in registered
                self.changed(line)
        if time.monotonic() >= self._history_due:
            self._history_due = time.monotonic() + self.history_interval
            await self.discover_at_rest(registered)

    async def discover_at_rest(self, registered: set[str]) -> None:
        """Read the lines that no supervisor runs (the ones not attached, not registered) whose files changed."""
        # An attached line is read from its files too once its supervisor is gone (killed, say): the
        # files hold what its trainer did after the last reply (`read_at_rest` reads no line still written).
        attached = {key for key, attachment in self._attachments.items() if attachment.state.connected}
        try:
            resting = await asyncio.to_thread(self._read_resting, registered | attached)
        except LineError as error:
            self.problem = str(error)  # host.json is unusable: the lines screen says why
            return
        for line_key, found, facts in resting:
            state = self.book.add(LineView(line_key, found.path))
            state.facts = facts
            state.apply_rest(found.supervisor, found.heartbeat, found.rows, self.clock())
            self._rested[line_key] = found.signature
            self.changed(state)
        shown = [(line.key, line.path) for line in self.book if line.key not in registered | attached]
        for line_key in await asyncio.to_thread(removed_lines, shown):
            await self._forget(line_key)

    async def _forget(self, key: str) -> None:
        """Leave out a line whose directory was removed: its row goes, and its link (to a supervisor
        that exited) stops trying; a line made again at that path is attached or read anew."""
        attachment = self._attachments.pop(key, None)
        if attachment is not None:
            await attachment.stop()
        self._rested.pop(key, None)
        line = self.book.remove(key)
        if line is not None:
            self.changed(line)

    def _read_resting(self, skip: set[str]) -> list[tuple[str, RestingLine, LineFacts]]:
        """(key, line at rest, run.json's facts) of each candidate not in `skip` whose files changed."""
        found = []
        for path in self.find_lines():
            key = line_id(path)
            if key in skip or self._rested.get(key) == files_signature(path):
                continue
            resting = read_at_rest(path)
            if resting is not None:
                found.append((key, resting, read_line_facts(path)))
        return found

    async def read_log(self, key: str, offset: int, length: int) -> dict[str, Any]:
        """run.log from `offset`: through the line's supervisor, or from the file of a line at rest."""
        line = self.book.get(key)
        if line is not None and line.at_rest and self.client_of(key) is None:
            return await asyncio.to_thread(read_log_chunk, LineLayout(line.path).run_log, offset, length)
        return await self.call(key, "log", offset=offset, length=length)

    def client_of(self, key: str) -> AsyncSupervisorClient | None:
        attachment = self._attachments.get(key)
        return None if attachment is None else attachment.link.client

    def methods(self, key: str) -> frozenset[str]:
        """The methods the supervisor of the line `key` named in its hello (none while it is not attached)."""
        client = self.client_of(key)
        return frozenset(client.server.get("methods") or ()) if client is not None else frozenset()

    async def call(self, key: str, method: str, **params: Any) -> Any:
        """A read call to a line's supervisor; `SupervisorUnavailable` when it is not attached."""
        client = self.client_of(key)
        if client is None:
            raise SupervisorUnavailable(f"{key}: the supervisor is not attached")
        return await client.call(method, **params)

    async def mutate(self, key: str, method: str, **params: Any) -> Any:
        """A mutation, retried over reconnects with one request_id (the supervisor applies it once);
        `SupervisorUnavailable` at once when the line's supervisor has exited (`_wait_for_link`)."""
        params["request_id"] = new_request_id()
        attachment = self._attachments.get(key)
        if attachment is None:
            raise SupervisorUnavailable(f"{key}: the supervisor is not attached")
        sent = False
        for attempt in range(MUTATION_ATTEMPTS):
            client = attachment.link.client
            try:
                if client is None or client.closed.is_set():
                    raise SupervisorUnavailable(f"{attachment.state.path}: the supervisor is not attached")
                sent = True
                return await client.call(method, reply_timeout=MUTATION_REPLY_TIMEOUT_S, **params)
            except RemoteError as error:
                missing = [] if client is None else missing_methods(client.server)
                if client is None or error.code != wire.INTERNAL_ERROR or not missing:
                    raise
                # An older supervisor failing inside: most likely on code installed since it started.
                words = older_supervisor_words(attachment.state.path, client.server.get("pid"), missing)
                raise LineError(f"{attachment.state.path}: {error}; {words}") from None
            except SupervisorUnavailable:
                if attempt == MUTATION_ATTEMPTS - 1:
                    raise
                await self._wait_for_link(attachment, method, sent)
        raise AssertionError("unreachable")

    async def _wait_for_link(self, attachment: _Attachment, method: str, sent: bool) -> None:
        """Wait (up to two of the longest backoffs) for the line's link to come back, as long as a
        supervisor still serves the line: one restarting, or whose connection alone dropped, gets the
        request once reconnected. `SupervisorUnavailable` at once when none does (its process gone,
        or its entry: a supervisor unregisters before it closes its socket, and it ends with its line):
        no link comes back then, and the user would wait out every retry to learn it."""
        deadline = time.monotonic() + self.max_backoff * 2
        while not attachment.reconnected.is_set():
            if await asyncio.to_thread(self._supervisor_gone, attachment.entry.id):
                raise SupervisorUnavailable(gone_words(attachment.state, method, sent))
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(attachment.reconnected.wait(), min(GONE_CHECK_S, remaining))

    def _supervisor_gone(self, key: str) -> bool:
        """No live supervisor is registered for the line (False when discovery cannot tell)."""
        try:
            entries = self.discover()
        except LineError:
            return False
        return not any(entry.id == key and entry.is_alive() for entry in entries)
