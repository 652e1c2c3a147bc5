"""The trainer beside other processes on its GPU: share, take the GPU back, or checkpoint and leave.

A mixin of `engine.training.trainer.Trainer`, sharing its state: it uses the GPU watch
(engine.gpu.sharing: when to check, what a reading means), the step engines (their shapes' mode,
the arena), the run's config (`guards.share_reserve_gb`), the layout, the position, the ranks, the
heartbeat and the log, and the checkpoint of the update it leaves at (`Checkpointing`: `_checkpoint`,
the writer, `_last_checkpoint_update`). It sets nothing of the trainer's own: a switch of shapes is
the engines'. Leaving raises `GpuBusy`, after that checkpoint: the supervisor relaunches the line
once the GPU is free or the others fit.
"""

from __future__ import annotations

import contextlib

from engine.errors import is_out_of_memory
from engine.gpu.sharing import Action, GpuBusy, GpuMode, GpuReading
from engine.protocol.facts import Stage, StopReason
from engine.training.engines import ArenaNotReleased
from engine.units import GIB


class GpuGuard:
    """The trainer's watch of its GPU (mixed into `Trainer`, whose engines, position and log it uses)."""

    def _watch_gpu(self) -> None:
        """At a check (engine.gpu.sharing): share, take the GPU back, or checkpoint and leave."""
        update = self.position.update
        if not self.gpu_watch.due(update):
            return
        action, reading = self.gpu_watch.check(update)
        others = f"{reading.others} other process(es) holding {reading.others_bytes / GIB:.2f} GiB"
        # A group leaves together: one rank's GPU taken past the reserve checkpoints the whole line.
        (leave,) = self.ranks.agree_max([int(action == Action.LEAVE)])
        if leave and action != Action.LEAVE:
            self._leave_gpu("another rank's GPU is taken by other processes")
        if action == Action.SHARE:
            self._switch_shapes(GpuMode.SHARED, f"{others} on the GPU")
        elif action == Action.OWN:
            self._switch_shapes(GpuMode.OWN, "the other processes have left the GPU")
        elif action == Action.LEAVE:
            reserve_gb = self.config.guards.share_reserve_gb
            limit = ("guards.share_reserve_gb is not set" if reserve_gb is None
                     else f"more than guards.share_reserve_gb = {reserve_gb:g}")  # fmt: skip
            self._leave_gpu(f"{others} on the GPU, {limit}")
        elif self.engines.gpu_mode == GpuMode.SHARED:
            self._hold_past_the_reserve(reading)

    def _hold_past_the_reserve(self, reading: GpuReading) -> None:
        """Sharing, at a check: the memory free past what the others may still take (the reserve
        less what they use) is held again, so that they cannot grow past their reserve. The free
        memory is read between two readings of theirs; if they differ, they were allocating or
        freeing, and the next check decides."""
        if self.engines.arena is None:
            return  # nothing captured yet (or eager): the next capture's arena is sized then
        free = self.engines.free_bytes()
        if self.gpu_watch.reader() != reading:
            return
        room = self.gpu_watch.room_for_others()
        held = self.engines.hold_past(room, free)
        if held:
            self.log.write(f"gpu: held {held / GIB:.2f} GiB more, leaving {room / GIB:.2f} GiB free: the reserve "
                           f"less the {reading.others_bytes / GIB:.2f} GiB the other processes hold")  # fmt: skip

    def _switch_shapes(self, mode: str, why: str) -> None:
        """Drop the step engines (and the arena) and train on with the lengths' `mode` shapes.

        Where the arena's memory does not come back (something of this process still holds a
        block of its pool), the new shapes could not get theirs, and others could not take theirs:
        the trainer checkpoints and leaves instead, and the supervisor relaunches it beside them.
        """
        try:
            self.engines.switch(mode)
        except ArenaNotReleased as error:
            self._leave_gpu(f"{error} for the switch to the {mode} shapes ({why})")
        shapes = "shared" if mode == GpuMode.SHARED else "own"
        self.log.write(f"gpu: {why}; training with the lengths' {shapes} shapes from update {self.position.update}")

    def _out_of_memory(self, doing: str, error: BaseException) -> None:
        """If `error` is the GPU running out of memory before an update (a capture, its probe rows)
        or inside one (a forward or backward: the weights, the moments and the position are as they
        were): beside other processes -- seen now, or at the last check -- checkpoint and leave
        (`GpuBusy`; the supervisor relaunches once they fit or the GPU is free). Otherwise, or
        alone, it returns and the caller raises: alone, the shapes do not fit this GPU, and that is
        the line's error."""
        if not is_out_of_memory(error):
            return
        reading = self.gpu_watch.reader() if self.gpu_watch.enabled else self.gpu_watch.last_reading
        others = max(reading.others, self.gpu_watch.last_reading.others)
        if others == 0 and self.engines.gpu_mode == GpuMode.OWN:
            return
        first_line = (str(error).splitlines() or [type(error).__name__])[0][:160]
        self._leave_gpu(f"out of memory {doing} beside {reading.others} other process(es) "
                        f"holding {reading.others_bytes / GIB:.2f} GiB ({first_line})")  # fmt: skip

    def _leave_gpu(self, why: str) -> None:
        """Checkpoint and stop: the supervisor relaunches the line once the GPU is free (or they fit).

        The engines and the arena go as soon as the snapshot is on the host, before the write ends:
        the others get that memory now, not after tens of seconds of a large line's write."""
        if self._last_checkpoint_update != self.position.update:
            self._checkpoint()
        with contextlib.suppress(ArenaNotReleased):
            self.engines.drop()
        self.writer.wait()
        message = (
            f"{self.layout.run_json}: {why}; checkpointed update "
            f"{self.position.update} and stopped until the GPU is free"
        )
        self.heartbeat.beat(self.position.update, Stage.STOPPED, reason=StopReason.GPU_BUSY)
        self.log.write(message)
        raise GpuBusy(message)
