"""The stops a trainer answers at an update boundary: a signal, `--stop-at`, a STOP request.

A mixin of `engine.training.trainer.Trainer`, sharing its state: it uses the line's layout (STOP is
read from it), `stop_at`, the position and the ranks, and sets `_signal` (the signal received, which
`Trainer.run` turns into the exit status). In a group the ranks agree on one stop code, the largest:
a stop asked on any rank stops every rank at the same update. The cycle the trainer's beats name,
which `nsconsole stop --at-cycle-end` is checked against before it writes STOP, is here too.
"""

from __future__ import annotations

import signal
from typing import Any

from engine.ops.stop import read_stop
from engine.protocol.facts import StopReason

# Stop codes agreed across a group's ranks (the largest wins): a signal's is this base + its number.
STOP_AT_CODE, STOP_FILE_CODE, SIGNAL_STOP_CODE = 1, 2, 1000


class StopRequests:
    """The trainer's stop requests (mixed into `Trainer`, whose position, ranks and layout it reads)."""

    def _on_signal(self, number: int, _frame: Any) -> None:
        self._signal = number

    def _stop_requested(self) -> str | None:
        """A stop at this update boundary: a signal, --stop-at, STOP (now, or a cycle end passed).

        In a group every rank stops at the same boundary: any rank's signal stops them all (and
        each then exits as if it had received it), the STOP file is rank 0's to read."""
        code = 0
        if self._signal is not None:
            code = SIGNAL_STOP_CODE + self._signal
        elif self.stop_at is not None and self.position.update >= self.stop_at:
            code = STOP_AT_CODE
        elif self.ranks.writes:
            request = read_stop(self.layout)
            # A cycle end already behind the line (or the one it stands at) stops it now.
            if request is not None and (request.at_cycle_end is None or request.at_cycle_end < self.position.cycle):
                code = STOP_FILE_CODE
        (code,) = self.ranks.agree_max([code])
        if code >= SIGNAL_STOP_CODE:
            self._signal = code - SIGNAL_STOP_CODE
            return f"signal {signal.Signals(self._signal).name}"
        return {STOP_AT_CODE: StopReason.STOP_AT, STOP_FILE_CODE: StopReason.STOP_FILE}.get(code)

    def _beaten_cycle(self) -> int:
        """The cycle the trainer's beats name (the heartbeat's `cycle`, but waiting for data's): the
        cycle its last update read from. That is the one in progress, but at a cycle's very start,
        none of it read yet, the one that ended there: a stop at that cycle's end still stops the
        line exactly there (`_stop_requested`, or the cycle's end itself, which reads STOP after its
        checkpoint), so `nsconsole stop --at-cycle-end` refuses only the cycles before this one
        (engine.ops.stop)."""
        position = self.position
        # (A stage's change of length inside the cycle keeps what it read at the old one in `earlier`.)
        started = position.sample > 0 or bool(position.earlier)
        return position.cycle if started or position.cycle == 0 else position.cycle - 1
