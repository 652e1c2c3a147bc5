"""What a supervisor's start makes of what it finds: a finished line, a stale stop, earlier crashes.

A mixin of `engine.supervisor.supervisor.Supervisor`: `run` asks these once it holds the line's
lock, before the line is served. They read the line (its layout: run.json's end, the STOP file)
and what the supervisor before left in supervisor.json, and tell through `_say`; they set nothing
of the supervisor's own (`run` keeps the crash count they return).
"""

from __future__ import annotations

from typing import Any

from datalines.errors import DataLineError
from engine.errors import LineError
from engine.ops.line_end import finished_line_error, line_end
from engine.protocol.facts import FINAL_LINE_STATES
from engine.supervisor.reads import discard_served_stop, pending_stop


class StartupChecks:
    """The supervisor's checks at its start (mixed into `Supervisor`, whose layout and log it uses)."""

    def _refuse_a_finished_line(self) -> None:
        """`LineError` when the line has nothing left to train, decided here, under the line's lock.

        Whoever started this supervisor looked before it (`nsconsole run` seconds before: its start
        checks load torch), and a trainer started without a supervisor may have finished the line
        since and let go of it: a trainer launched now would stop at once, and the line would read as
        finished by this supervisor. Nothing is written before this (no supervisor.json, no entry, no
        run.log line): the line stays as the trainer that finished it left it. A line whose end
        cannot be read (a broken run.json, a data line gone) starts as before: its trainer's start
        says what is wrong, and the supervisor records that."""
        try:
            ended = line_end(self.layout.root)
        except (LineError, DataLineError, OSError):
            return
        if ended is not None:
            raise finished_line_error(self.layout.root, ended)

    def _discard_a_stop_from_before(self) -> None:
        """Discard a stop at the next update still pending from before this supervisor started.

        Nothing served it: it was asked of an orphan trainer finishing its checkpoint after its
        supervisor died, or just before the host went down. Kept, it ended this start at once, and
        `nsconsole run` said the supervisor "did not start: exit status 0". This start is the newer
        request (`nsconsole resume` leaves such a line alone, `engine.supervisor.lost`). A stop at a
        cycle end stays: the trainer serves it when that cycle ends."""
        stop = pending_stop(self.layout)
        if stop is None or stop.at_cycle_end is not None:
            return
        discard_served_stop(self.layout)
        self._say(f"a stop requested {stop.requested} was pending from before this start, with nothing "
                  "to serve it: discarded (`nsconsole stop` asks again)")

    def _crashes_before(self, previous: dict[str, Any]) -> int:
        """The crash count of the supervisors before this one, plus one when the last of them died
        with the line running (killed, or the host went down): it ended in a state that is not final."""
        crashes = previous.get("crashes")
        count = crashes if isinstance(crashes, int) and not isinstance(crashes, bool) and crashes > 0 else 0
        state = previous.get("state")
        if state is not None and state not in FINAL_LINE_STATES:
            self._say(f"the previous supervisor (pid {previous.get('pid')}) ended in state {state} without "
                      "ending the line: counted as a crash")
            count += 1
        return count
