"""The trainer's reading of its data line: cycles, their readiness, an update's rows, their ends.

A mixin of `engine.training.trainer.Trainer`, sharing its state: it uses the run's config, the
model (told of a cycle's end), the data line, the layout, the ranks, the log, the heartbeat and the
start-up clock, and the position, which it advances at a cycle's and a stage's end (an update's own
advance is `OneUpdate`'s). It keeps the open cycle (`_cycles`: one at a time; the loop empties it
when a shard changed under it) and the sample orders' digests (`_digests`), both made empty by
`Trainer.__init__`. A cycle's and a stage's end write a kept checkpoint (`Checkpointing`); a wait
for a cycle answers a stop meanwhile (`StopRequests`).

In a group rank 0 reads the data line's files for every rank (one line directory): whether a cycle
is ready, whether the data line has ended, whether a shard changed, and the group follows it.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from datalines.consumption import claim_cycle
from datalines.cycle import Cycle
from datalines.errors import ShardChanged
from datalines.status import preparer_running
from engine.checkpoints.format import cycle_end_kept, stage_end_kept
from engine.errors import CheckpointError
from engine.ops.cycle_check import consumed_resume_refusal
from engine.ops.stop import read_stop
from engine.protocol.facts import Stage, StopReason
from engine.training.schedule import tokens_per_update
from engine.training.stop_requests import STOP_FILE_CODE

WAIT_POLL_SECONDS = 1.0
"""How often a trainer waiting for the next data cycle looks again (and at STOP)."""

# Rank 0's reading of the data line, shared with the group (`_cycle_state`, `_end_of_cycle`, where
# DATA_ENDED meets STOP_FILE_CODE: the codes differ).
CYCLE_READY, DATA_ENDED = 1, 3


class DataCycles:
    """The trainer's data cycles (mixed into `Trainer`, whose data line, position and ranks it uses)."""

    _stage_ended: str | None = None
    """The kept reason of a stage that ended on the update that ends the cycle too: `_end_of_stage`
    leaves it to `_end_of_cycle`, which follows at once, so the update has one checkpoint with both
    reasons (before, the cycle end's replaced the stage end's, and `keep_cycle_ends` removed it)."""

    def _cycle(self, index: int) -> Cycle:
        if index not in self._cycles:
            with self.startup.segment("data cycle"):  # the first one's shards are hashed in the start-up
                self._cycles = {index: self.data_line.cycle(index)}  # one open cycle at a time
        return self._cycles[index]

    def _order_digest(self, cycle: int, seq_len: int) -> str:
        reads = self.position.reads()
        key = (cycle, seq_len, reads)
        if key not in self._digests:
            self._digests[key] = self._cycle(cycle).order_digest(seq_len, self.config.seeds.data, reads)
        return self._digests[key]

    def _seq_len(self) -> int:
        return self.config.plan[self.position.stage].seq_len

    def _where(self) -> str:
        p = self.position
        stage = self.config.plan[p.stage].name if p.stage < len(self.config.plan) else "done"
        tokens = f"{p.tokens_trained:,} tokens"
        return f"update {p.update}, {tokens}, stage {stage}, cycle {p.cycle}, sample {p.sample}"

    def _check_data_position(self, data: dict[str, Any], where: Path) -> None:
        """Refuse a resume whose cycle manifest or sample order differs from the checkpoint's."""
        position = self.position
        if (position.sample == 0 and not position.earlier) or data.get("manifest_sha256") is None:
            if position.cycle > 0 and not self.data_line.is_consumed(position.cycle - 1):
                # The cycle-end checkpoint was durable but the consumed mark was not written.
                self.data_line.mark_consumed(position.cycle - 1, by=self.layout.root)
            return
        # Fallen back inside a cycle this line consumed (its end checkpoint damaged): say why, and the way on.
        refusal = consumed_resume_refusal(self.layout.root, self.data_line, where, position.cycle)
        if refusal is not None:
            raise CheckpointError(refusal)
        # The manifest only: damaged shards are the preparer's to rebuild while the loop waits for them.
        cycle = self.data_line.cycle(position.cycle, verify=False)
        if cycle.manifest_sha256 != data["manifest_sha256"]:
            raise CheckpointError(
                f"{where}: cycle {position.cycle}'s manifest sha256 is {cycle.manifest_sha256[:16]}..., "
                f"the checkpoint trained on {data['manifest_sha256'][:16]}... (the data line changed)"
            )
        digest = cycle.order_digest(data["seq_len"], self.config.seeds.data, position.reads())
        if digest != data["order_digest"]:
            raise CheckpointError(
                f"{where}: cycle {position.cycle}'s sample order digest differs from the checkpoint's "
                f"(seeds.data or the data line changed); resuming would train other samples"
            )

    def _cycle_state(self, index: int) -> int:
        """Rank 0's reading of cycle `index`, shared with every rank: CYCLE_READY, DATA_ENDED
        (past the data line's last cycle) or 0 (not prepared yet)."""
        state = 0
        if self.ranks.writes:
            last = self.data_line.last_cycle()
            if self.data_line.cycle_ready(index):
                state = CYCLE_READY
            elif last is not None and index > last:
                state = DATA_ENDED
        return self.ranks.from_writer([state])[0]

    def _check_shards(self, cycle: Cycle) -> None:
        """`ShardChanged` when a shard of `cycle` is no longer the manifest's (rewritten in place
        while open): rank 0 checks for the group, which reads one line directory's files."""
        problem = ""
        if self.ranks.writes:
            try:
                cycle.verify_unchanged()
            except ShardChanged as error:
                problem = str(error)
        if self.ranks.from_writer([int(bool(problem))])[0]:
            raise ShardChanged(problem or f"{cycle.directory}: a shard changed under rank 0")

    def _wait_for_cycle(self, index: int) -> str | None:
        """Block until cycle `index` is ready; returns a stop reason if one arrives meanwhile."""
        announced = False
        while (state := self._cycle_state(index)) != CYCLE_READY:
            if state == DATA_ENDED:
                return StopReason.DATA_END
            if not announced:
                # A cycle another line consumed meanwhile never comes back: refuse it, don't wait.
                claim_cycle(self.data_line, index, self.layout.root, writes=False)
                problem = self.data_line.cycle_problem(index) if self.ranks.writes else None
                self.log.write(f"waiting for data cycle {index}" + (f" ({problem})" if problem else "")
                               + self._no_preparer_words())  # fmt: skip
                announced = True
            self.heartbeat.beat(self.position.update, Stage.WAITING_DATA, cycle=index)
            reason = self._stop_requested()
            if reason is not None:
                return reason
            time.sleep(WAIT_POLL_SECONDS)
        return None

    def _no_preparer_words(self) -> str:
        """What to run when no preparer holds the data line now (a trainer run without a supervisor
        waits for a cycle nobody makes, as `nsconsole run --no-supervisor` warns of at its start)."""
        path = self.data_line.path
        if not self.ranks.writes or preparer_running(path):
            return ""
        return (f"; no data preparer runs on {path} now: `nsconsole data run-preparer --work {path}` makes "
                "it (a line run under its supervisor has one)")

    def _update_rows(self, cycle: Cycle, seq_len: int) -> int:
        """Rows of the next update: the ramp's batch, cut at the cycle's and the stage's end."""
        position = self.position
        data_tokens = position.data_tokens(self.data_line, seq_len)
        wanted = max(1, tokens_per_update(self.config, data_tokens) // seq_len)
        left_in_cycle = cycle.num_samples(seq_len, self.config.seeds.data, position.reads()) - position.sample
        stage_budget = self.config.plan[position.stage].tokens
        if stage_budget is not None:
            left_in_stage = math.ceil((stage_budget - position.stage_tokens) / seq_len)
            return max(0, min(wanted, left_in_cycle, left_in_stage))
        return max(0, min(wanted, left_in_cycle))

    def _stage_and_cycle_done(self, cycle: Cycle, seq_len: int) -> tuple[bool, bool]:
        """Whether the updates so far end the current stage (its tokens trained) and the current
        cycle (its windows at `seq_len` all read)."""
        position = self.position
        stage = self.config.plan[position.stage]
        stage_done = stage.tokens is not None and position.stage_tokens >= stage.tokens
        cycle_done = position.sample >= cycle.num_samples(seq_len, self.config.seeds.data, position.reads())
        return stage_done, cycle_done

    def _end_of_cycle(self) -> str | None:
        """The update just done ended its cycle: kept checkpoint, consumed mark, next cycle."""
        position = self.position
        finished = position.cycle
        self.model.on_cycle_end(finished)
        position.next_cycle()
        # The stage that this update ended too (`_end_of_stage`) is kept in the same checkpoint:
        # kept for good as a stage end, and still the fork point of a branch at this cycle's end.
        stage_ended, self._stage_ended = self._stage_ended, None
        kept = cycle_end_kept(finished) if stage_ended is None else [stage_ended, cycle_end_kept(finished)]
        self._checkpoint(kept=kept, wait=True)
        self.log.write(f"cycle {finished} done at update {position.update}")
        reason = 0  # rank 0 marks the cycle and reads STOP and the data line; the group follows it
        if self.ranks.writes:
            self.data_line.mark_consumed(finished, by=self.layout.root)
            request = read_stop(self.layout)
            last = self.data_line.last_cycle()
            if request is not None and request.at_cycle_end is not None and request.at_cycle_end <= finished:
                reason = STOP_FILE_CODE
            elif last is not None and finished >= last:
                reason = DATA_ENDED
        (reason,) = self.ranks.from_writer([reason])
        return {STOP_FILE_CODE: StopReason.STOP_FILE, DATA_ENDED: StopReason.DATA_END}.get(reason)

    def _end_of_stage(self, cycle_done: bool) -> str | None:
        """The update just done ended its stage: kept checkpoint (left to `_end_of_cycle` when the
        update ended the cycle too and the plan goes on), next stage's length (and, inside a cycle
        the update did not end, the relay of the cycle's rest at that length)."""
        position = self.position
        finished = self.config.plan[position.stage]
        position.stage += 1
        position.stage_tokens = 0
        # The next length reads the targets the cycle has left, laid out anew (datalines.relay).
        relaid = position.stage < len(self.config.plan) and position.change_length(finished.seq_len, self._seq_len())
        if cycle_done and position.stage < len(self.config.plan):
            self._stage_ended = stage_end_kept(finished.name)  # `_end_of_cycle`, next, writes its checkpoint
        else:
            self._checkpoint(kept=stage_end_kept(finished.name), wait=True)
        self.log.write(f"stage {finished.name} done at update {position.update}")
        if relaid and not cycle_done:  # (a read to the cycle's end leaves an empty relay, not worth a line)
            self.log.write(self._relay_report())
        return StopReason.PLAN_END if position.stage >= len(self.config.plan) else None

    def _relay_report(self) -> str:
        """run.log's line on the rest of a cycle re-laid at a new length: what it trains, what it cannot."""
        position, seq_len, seed = self.position, self._seq_len(), self.config.seeds.data
        cycle = self._cycle(position.cycle)
        windows = cycle.num_samples(seq_len, seed, position.reads())
        unread = cycle.unread_targets(seq_len, seed, position.reads())
        return (f"cycle {position.cycle}: its untrained targets re-laid at seq_len {seq_len}, {windows} windows; "
                f"{unread} targets left out (a stream tail shorter than a window per source, share rounding)")
