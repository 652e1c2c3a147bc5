"""What the supervisor tells: run.log lines, events to subscribers and the operator, supervisor.json.

A mixin of `engine.supervisor.supervisor.Supervisor`, sharing its state: it writes run.log through
`_log`, pushes events through `_server` (None before it serves), notifies through host.json's
`notify` (`_notify_command`; the threads it starts are kept in `_notifying` while they run, for
`run` to join) and writes `state` to supervisor.json with the request log (`request_log`) and the
queued forks (`forks`) in it, under `_lock` (which guards `state` against the RPC threads) and
`_save_lock`.
On a full disk the line's reserve (`_reserve`) makes room for what must be written.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict
from typing import Any

from engine.atomic import write_text_atomic
from engine.protocol.facts import NOTIFIED_EVENTS
from engine.supervisor.notify import make_event, notify_in_background
from engine.supervisor.reads import heartbeat_update
from engine.supervisor.reserve import is_disk_full


class Telling:
    """The supervisor's record and news (mixed into `Supervisor`, whose layout, state and server it uses)."""

    def _say(self, message: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
        line = f"{stamp} supervisor: {message}\n"
        try:
            self._log.write(line)
        except OSError as error:
            if not (is_disk_full(error) and self._reserve.release()):
                return  # a full disk loses this line; the supervisor goes on
            with contextlib.suppress(OSError):
                self._log.write(line)

    def _publish_event(self, kind: str, message: str, **details: Any) -> dict[str, Any]:
        event = {"event": kind, "line": str(self.layout.root), "message": message, "time": time.time()}
        event.update(details)
        if self._server is not None:
            self._server.publish("event", event)
        return event

    def _event(self, kind: str, message: str, **details: Any) -> None:
        """An event the operator is told about: run.log, subscribers, supervisor.json, notify."""
        assert kind in NOTIFIED_EVENTS
        self._say(f"{kind}: {message}")
        event = make_event(kind, str(self.layout.root), message, update=heartbeat_update(self.layout), **details)
        if self._server is not None:
            self._server.publish("event", event)
        self._set(last_event=event)
        if self._notify_command:
            thread = notify_in_background(
                self._notify_command, event,
                on_failure=lambda detail: self._say(f"notify {kind} failed: {detail}"),
            )
            # Only the notifications still under way are kept for `run` to wait for: a line of weeks
            # tells of thousands of events, and each finished thread held its event.
            with self._lock:
                self._notifying[:] = [*(other for other in self._notifying if other.is_alive()), thread]

    def _set(self, **changes: Any) -> None:
        with self._lock:
            for name, value in changes.items():
                setattr(self.state, name, value)
        self._save()

    def _save(self) -> None:
        # RPC and fork threads save too: the lock orders the writes, so the newest state lands last.
        with self._save_lock:
            queued_forks = self.forks.export()
            with self._lock:
                self.state.requests = self.request_log.export()
                self.state.queued_forks = queued_forks
                document = asdict(self.state)
            text = json.dumps(document, indent=1, default=str) + "\n"
            try:
                write_text_atomic(self.layout.supervisor_json, text)
            except OSError as error:
                if not is_disk_full(error):
                    raise
                # The state must reach the file (`disk-full`, above all): the reserve makes room.
                if self._reserve.release():
                    write_text_atomic(self.layout.supervisor_json, text)
