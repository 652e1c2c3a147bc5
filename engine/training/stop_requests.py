"""The stops a trainer answers at an update boundary: a signal, `--stop-at`, a STOP request.

A mixin of `engine.training.trainer.Trainer`, sharing its state: it uses the line's layout (STOP is
read from it), `stop_at`, the position and the ranks, and sets `_signal` (the signal received, which
`Trainer.run` turns into the exit status). In a group the ranks agree on one stop code, the largest:
a stop asked on any rank stops every rank at the same update.
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
