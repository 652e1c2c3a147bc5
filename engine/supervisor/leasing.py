"""Taking the GPU leases of a launch, and waiting for a GPU that other processes use.

A mixin of `engine.supervisor.supervisor.Supervisor`: the waits are the supervisor's loop (they
push rows and beats, run paused work and end on a stop meanwhile) and share its state: the GPUs
leased for the launch (`_placed`, which `placed_environment` hands to the trainer and a tune) and
the verdict's ask for a free GPU (`_need_free_gpu`, `_others_may_stay`). The leases themselves
are `engine/gpu/devices.py`'s.
"""

from __future__ import annotations

import time

from engine.gpu.devices import GpuLease, lease_holder, take_free_leases
from engine.gpu.placement import PhysicalGpu
from engine.protocol.facts import EventKind, LineState
from engine.supervisor.gpu_watch import memory_of_others_on_gpu, processes_on_gpu
from engine.supervisor.reads import pending_stop_now, reload_config


class GpuLeasing:
    """The supervisor's GPU leases (mixed into `Supervisor`, whose loop, state and log it uses)."""

    def _take_gpus(self, gpus: list[PhysicalGpu], count: int) -> list[GpuLease] | None:
        """The leases of the first `count` free GPUs of `gpus` (one per rank of `parallel.degree`),
        waited for as long as other lines hold too many of them (none is held meanwhile:
        `take_free_leases`); None if a stop comes first. The GPUs trained on before are tried first,
        and after a launch that left its GPU to other processes, the GPUs with none on them are (an
        `auto` line moves rather than waits); no line has priority over another."""
        waited_since = time.monotonic()
        told = False
        said: list[tuple[int, str]] | None = None
        while True:
            order = self._lease_order(gpus)
            taken = take_free_leases([GpuLease(gpu.index, self.layout.root, gpu.uuid) for gpu in order], count)
            if taken is not None:
                by_index = {gpu.index: gpu for gpu in gpus}
                self._placed = [by_index[lease.index] for lease in taken]
                self._set(gpu_index=taken[0].index, gpu_uuid=taken[0].uuid,
                          gpu_indices=[lease.index for lease in taken], gpu_holders=[])
                return taken
            # A lease freed since the try above is left out: the next try takes it.
            holders = [(gpu, holder) for gpu in gpus if (holder := lease_holder(gpu.index)) is not None]
            held_by = [(gpu.index, holder.line or f"pid {holder.pid}") for gpu, holder in holders]
            records = [{"gpu": gpu.index, "uuid": gpu.uuid, "line": holder.line, "pid": holder.pid}
                       for gpu, holder in holders]  # fmt: skip
            what = f"GPU {gpus[0].index}" if len(gpus) == 1 else "a GPU" if count == 1 else f"{count} GPUs"
            if self.state.state != LineState.WAITING_GPU or held_by != said:
                # The reason in run.log first: whoever sees the state (supervisor.json, `status`) finds it there.
                taken_by = ", ".join(f"GPU {index} by {line}" for index, line in held_by)
                self._say(f"waiting for {what}: leases held ({taken_by})")
                self._set(state=LineState.WAITING_GPU, gpu_index=None, gpu_uuid=None, gpu_indices=[],
                          gpu_holders=records)
                said = held_by
            if not told and time.monotonic() - waited_since > self._watchdog_seconds():
                self._event(EventKind.GPU_WAIT, f"waiting for {what} longer than the watchdog interval")
                told = True
            if self._stop_came_while_waiting():
                return None

    def _lease_order(self, gpus: list[PhysicalGpu]) -> list[PhysicalGpu]:
        """`gpus` in the order to try their leases (see `_take_gpus`)."""
        def rank(gpu: PhysicalGpu) -> tuple[bool, bool]:
            busy = self._need_free_gpu and bool(processes_on_gpu(gpu.index, exclude=()))
            return busy, gpu not in self._placed

        return sorted(gpus, key=rank) if len(gpus) > 1 else gpus

    def _wait_for_free_gpu(self, index: int) -> bool:
        """Wait (holding the lease) until no process is on the GPU -- or, where the trainer left
        beside others after training on (`_others_may_stay`), until they hold no more than
        guards.share_reserve_gb (it then starts beside them with the shared shapes); False if a stop
        comes first."""
        waited_since = time.monotonic()
        told = False
        while (others := processes_on_gpu(index, exclude=())) and not self._others_fit_the_reserve(index):
            if self.state.state != LineState.WAITING_GPU:
                self._say(f"waiting for GPU {index} to be free (other processes on it: {others})")
                self._set(state=LineState.WAITING_GPU)
            if not told and time.monotonic() - waited_since > self._watchdog_seconds():
                message = f"waiting for GPU {index} to be free longer than the watchdog interval"
                self._event(EventKind.GPU_WAIT, message)
                told = True
            if self._stop_came_while_waiting():
                return False
        return True

    def _others_fit_the_reserve(self, index: int) -> bool:
        if not self._others_may_stay:
            return False
        config = self._config or reload_config(self.layout, None)
        reserve = None if config is None else config.guards.share_reserve_bytes
        held = memory_of_others_on_gpu(index)
        return reserve is not None and held is not None and held <= reserve

    def _stop_came_while_waiting(self) -> bool:
        """One poll of a wait for a GPU: push news and run the paused work that needs no GPU; True
        when a stop has come, else False after a poll's sleep."""
        self._pump()
        self._do_paused_work(gpu_ready=False)
        if self._stopping or pending_stop_now(self.layout):
            return True
        time.sleep(self.settings.poll_seconds)
        return False


def release_all(leases: list[GpuLease]) -> None:
    """Let go of leases this process holds (one handed to a trainer already is the trainer's)."""
    for lease in leases:
        lease.release()
