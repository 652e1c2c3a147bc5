"""The mirror's check of replayed updates: online, the rows of updates the trainer trains again after
a resume (the server got them before the crash) are compared with the server's copy instead of being
sent again (engine.wandb.replay); a difference is recorded in wandb_run.json and reported in run.log.

A mixin of `engine.wandb.mirror.WandbMirror`, sharing its state: it reads the lock, the backend, the
replayed rows taken off the queue (`_replayed`), the last step the server held at the resume
(`_replay_through`, cleared where the server's copy cannot be read) and the window of the server's
rows read last (`_replay_window`), and it saves the state and reports through the mirror.
"""

from __future__ import annotations

from engine.wandb.replay import ReplayWindow, describe
from engine.wandb.rows import row_update, row_values
from engine.wandb.state import ReplayMismatch


class ReplayCheck:
    """Replayed rows compared with the server's copy (mixed into `WandbMirror`)."""

    def _compare_replayed(self) -> None:
        """Compare the replayed rows taken off the queue with the server's rows at their steps."""
        with self._lock:
            replayed, self._replayed = self._replayed, []
        found: list[list[ReplayMismatch]] = []
        for row in replayed:
            update = row_update(row)
            assert update is not None
            window = self._replay_window
            if window is None or not window.covers(update):
                window = self._read_replay_window(after=update - 1)
                if window is None:
                    break  # no server copy to compare with (offline, or it could not be read)
            mismatches = window.compare(update, row_values(row))
            if mismatches:
                found.append(mismatches)
        if not found:
            return
        with self._lock:
            for mismatches in found:
                self._state.record_replay_mismatches(mismatches)
            run_id = self._state.run_id
        self._save_state()
        for mismatches in found:
            self._report(describe(run_id, mismatches))

    def _read_replay_window(self, after: int) -> ReplayWindow | None:
        """The server's rows from `after` to the step it held at the resume; None: none to compare."""
        with self._lock:
            through = self._replay_through
        if through is None or after >= through:
            return None
        try:
            rows = self._backend.server_rows(after, through)
        except Exception as error:  # reading back is a check: its failure never stops the mirror
            self._report(
                f"W&B: could not read the server's copy of updates {after + 1}..{through} ({error}); "
                "the replayed updates are not compared"
            )
            rows = None
        if rows is None:
            with self._lock:
                self._replay_through = None
            return None
        self._replay_window = ReplayWindow(after, through, rows)
        return self._replay_window
