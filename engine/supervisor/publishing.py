"""What the line writes, passed on: rows and heartbeats to subscribers, run.log to a terminal.

A mixin of `engine.supervisor.supervisor.Supervisor`, sharing its state: it keeps the tail of
rows.jsonl (`rows_tail`, set from its saved index at the start, and `_rows_indexed_at`), the
heartbeat last pushed (`_heartbeat_seen`) and how far run.log was echoed (`_echo_offset`), and
pushes through the server (`_server`, None before it serves). `_pump` is one turn of the
supervisor's loops, so it also keeps the preparer (`_preparer`), the queued forks (`forks`) and the
branches' supervisors (`_branches`) going; it echoes only when `settings.echo`, and tells through `_say`.
"""

from __future__ import annotations

import sys

from engine.supervisor.reads import file_size, parse_json
from engine.supervisor.rows_digest import is_validation_row
from engine.supervisor.rows_tail import RowsTail

ROWS_INDEX_EVERY = 4096
"""Rows between two saves of the index of rows.jsonl (`RowsTail.save`): at ns-2b's 2 s an update,
about every 2 h, so a start after a crash or a reboot reads at most this many rows of the file."""


class Publishing:
    """The supervisor's pushes (mixed into `Supervisor`, whose layout, server and log it uses)."""

    def _index_rows(self) -> None:
        """Index rows.jsonl from where the saved index left off (`RowsTail.load`): a line of months
        is read through only once, not at every start (a minute for 3 GB)."""
        self.rows_tail = RowsTail.load(self.layout.rows_jsonl, self.layout.rows_index)
        restored = self.rows_tail.count
        self.rows_tail.catch_up()
        read = self.rows_tail.rows_read
        if restored or read >= ROWS_INDEX_EVERY:
            self._say(f"rows.jsonl: {self.rows_tail.count} rows, {read} read from the file "
                      f"({'the rest from rows.index.json' if restored else 'no saved index'})")
        if read >= ROWS_INDEX_EVERY:
            self._save_rows_index()

    def _save_rows_index(self) -> None:
        """Save the index of rows.jsonl (a cache: a full disk or another failure only costs a longer start)."""
        try:
            self.rows_tail.save(self.layout.rows_index)
        except OSError as error:
            self._say(f"{self.layout.rows_index}: not saved ({error}); the next start reads rows.jsonl through")
        self._rows_indexed_at = self.rows_tail.count

    def _publish_rows(self) -> None:
        """Push the rows appended to rows.jsonl since the last look to subscribers; save the index
        every `ROWS_INDEX_EVERY` rows (a supervisor killed with the host reads only what came after)."""
        server = self._server
        for index, row in self.rows_tail.poll_indexed():
            if server is not None:
                server.publish("validation" if is_validation_row(row) else "row", row, index=index)
        if abs(self.rows_tail.count - self._rows_indexed_at) >= ROWS_INDEX_EVERY:
            self._save_rows_index()

    def _pump(self) -> None:
        """Push new rows and a changed heartbeat to subscribers; echo run.log in a terminal; keep
        the data preparer running."""
        if self._preparer is not None:
            self._preparer.tick()
        self._publish_rows()
        try:
            raw = self.layout.heartbeat.read_bytes()
        except FileNotFoundError:
            raw = None
        if raw is not None and raw != self._heartbeat_seen:
            self._heartbeat_seen = raw
            heartbeat = parse_json(raw)
            if heartbeat is not None and self._server is not None:
                self._server.publish("heartbeat", heartbeat)
        self.forks.poll()
        self._branches.reap()
        if self.settings.echo:
            self._echo_run_log()

    def _echo_run_log(self) -> None:
        size = file_size(self.layout.run_log)
        if size < self._echo_offset:
            self._echo_offset = 0  # rotated
        if size == self._echo_offset:
            return
        with open(self.layout.run_log, "rb") as handle:
            handle.seek(self._echo_offset)
            data = handle.read(size - self._echo_offset)
        whole = data[: data.rfind(b"\n") + 1]
        self._echo_offset += len(whole)
        sys.stdout.write(whole.decode("utf-8", errors="replace"))
        sys.stdout.flush()
