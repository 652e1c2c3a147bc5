"""The trainer's side of GPU sharing: when other processes appear on its GPU, share or leave.

Every `guards.gpu_check_every` updates (CUDA lines only) the trainer reads its GPU (`GpuWatch`)
and `decide()` turns the reading, with what the earlier readings left in `SharingState`, into an
action:

- others appear and `guards.share_reserve_gb` is None -> LEAVE: checkpoint and exit (`GpuBusy`,
  which the supervised trainer maps to `TrainerExitCode.GPU_BUSY`; the supervisor relaunches once it is free);
- others appear and use no more than the reserve -> SHARE: the same process switches to each
  length's `shared` shape (another micro-batch split of the same update);
- others use more than the reserve -> LEAVE;
- sharing, and the others gone for `OWN_AFTER_ABSENT_CHECKS` checks in a row -> OWN: back to the
  lengths' own shapes.

While sharing, every check also holds again what is free past the others' room (the reserve less
what they use), so they cannot grow past their reserve (`Trainer._hold_past_the_reserve`,
`Arena.hold`); a capture gives that back first, as it needs its slack outside the arena's pool.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config.run import RunConfig
from engine.errors import ConfigError, LineError
from engine.gpu.devices import GpuSnapshot, gpu_snapshot

OWN_AFTER_ABSENT_CHECKS = 3
"""Checks in a row without other processes before a sharing line takes its own shapes back."""


class GpuMode:
    """Which shapes the line trains with (the row's `gpu_mode`)."""

    OWN = "own"
    SHARED = "shared"


class Action:
    """What a check asks the trainer to do."""

    STAY = "stay"
    SHARE = "share"
    LEAVE = "leave"
    OWN = "own"


class GpuBusy(LineError):
    """Other processes on the line's GPU leave it too little memory (or it has no reserve): the
    trainer checkpointed and stopped; a relaunch once the GPU is free resumes it."""


@dataclass(frozen=True)
class GpuReading:
    """What a check sees of the other processes on the trainer's GPU."""

    others: int
    """Compute processes on the device other than the trainer."""
    others_bytes: int
    """Device memory they hold together, in bytes."""


@dataclass(frozen=True)
class SharingState:
    """What the readings so far leave behind: the mode, and how long the others have been gone."""

    mode: str = GpuMode.OWN
    """GpuMode.OWN or GpuMode.SHARED."""
    absent_checks: int = 0
    """Checks in a row, while sharing, that saw no other process."""


def decide(state: SharingState, reading: GpuReading, reserve_bytes: int | None) -> tuple[str, SharingState]:
    """The action for one reading, and the state the next reading starts from (a pure function)."""
    if reading.others > 0:
        if reserve_bytes is None or reading.others_bytes > reserve_bytes:
            return Action.LEAVE, state
        action = Action.SHARE if state.mode == GpuMode.OWN else Action.STAY
        return action, SharingState(GpuMode.SHARED, absent_checks=0)
    if state.mode == GpuMode.OWN:
        return Action.STAY, state
    absent = state.absent_checks + 1
    if absent >= OWN_AFTER_ABSENT_CHECKS:
        return Action.OWN, SharingState(GpuMode.OWN, absent_checks=0)
    return Action.STAY, SharingState(GpuMode.SHARED, absent_checks=absent)


def reading_from_snapshot(snapshot: GpuSnapshot, uuid: str, own_pid: int) -> GpuReading:
    """The other processes of the device with this UUID in an NVML snapshot (none where there is no GPU).

    Where the driver does not say what a process holds (e.g. MIG), the others are taken to hold
    everything in use on the device but what the trainer holds -- never less than they might.
    """
    device = next((d for d in snapshot.devices if d.uuid == uuid), None)
    if not snapshot.available or device is None:
        return GpuReading(others=0, others_bytes=0)
    others = [p for p in device.processes if p.pid != own_pid]
    if any(p.used_memory is None for p in others):
        own = sum(p.used_memory or 0 for p in device.processes if p.pid == own_pid)
        return GpuReading(others=len(others), others_bytes=max(device.memory_used - own, 0))
    return GpuReading(others=len(others), others_bytes=sum(p.used_memory or 0 for p in others))


GpuReader = Callable[[], GpuReading]


class GpuWatch:
    """Reads the trainer's GPU every `every` updates and decides (see the module docstring)."""

    def __init__(self, every: int, reserve_bytes: int | None, reader: GpuReader, enabled: bool):
        self.every = max(1, every)
        self.reserve_bytes = reserve_bytes
        self.reader = reader
        self.enabled = enabled
        self.state = SharingState()
        self.last_reading = GpuReading(others=0, others_bytes=0)
        """The latest check's reading (what the others held then)."""
        self._last_checked: int | None = None

    def room_for_others(self) -> int:
        """Bytes a shared arena leaves free: the reserve less what the others already hold."""
        if self.reserve_bytes is None:
            return 0
        return max(self.reserve_bytes - self.last_reading.others_bytes, 0)

    @classmethod
    def for_line(
        cls,
        config: RunConfig,
        device: torch.device,
        *,
        reader: GpuReader | None = None,
        enabled: bool | None = None,
    ) -> GpuWatch:
        """The watch of a line on `device`: enabled on CUDA only, reading NVML for that device,
        found by the UUID CUDA reports for it (CUDA's index is not NVML's under
        CUDA_VISIBLE_DEVICES: the supervisor's trainer sees its leased GPU as cuda:0).

        `reader` and `enabled` replace the NVML reading and the device-kind condition (tests drive a
        CPU line through the sharing paths with them).
        """
        reserve_bytes = config.guards.share_reserve_bytes
        if reader is None:
            uuid = cuda_uuid(device) if device.type == "cuda" else ""
            pid = os.getpid()

            def reader() -> GpuReading:
                return reading_from_snapshot(gpu_snapshot(), uuid, pid)

        if enabled is None:
            enabled = device.type == "cuda"
        return cls(config.guards.gpu_check_every, reserve_bytes, reader, enabled)

    def due(self, update: int) -> bool:
        """At the line's first update boundary, then every `every` updates."""
        if not self.enabled:
            return False
        return self._last_checked is None or update - self._last_checked >= self.every

    def check(self, update: int) -> tuple[str, GpuReading]:
        """Read the GPU now; the action and the reading it came from."""
        reading = self.reader()
        action, self.state = decide(self.state, reading, self.reserve_bytes)
        self.last_reading = reading
        self._last_checked = update
        return action, reading


def cuda_uuid(device: torch.device) -> str:
    """NVML's UUID (`GPU-...`) of a CUDA device of this process."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = str(torch.cuda.get_device_properties(index).uuid)  # CUDA's form has no `GPU-` prefix
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


def unshareable_lengths_problem(config: RunConfig, source: str = "run.json", line: str | None = None) -> str | None:
    """What is wrong when a reserve is set but a plan length has no `shared` shape (the line could not
    share); None when it can. The one statement of that check: the trainer refuses to start on it
    (`refuse_unshareable_lengths`), `nsconsole check` reports it (`engine.ops.check`).

    `line`: the line's directory, named in the tune command the message gives; by default the
    directory of `source` when that is a run.json path (the trainer passes the line's)."""
    if config.guards.share_reserve_gb is None:
        return None
    plan_lengths = {stage.seq_len for stage in config.plan}
    unmeasured = sorted(seq_len for seq_len in plan_lengths if config.length(seq_len).shared is None)
    if not unmeasured:
        return None
    lengths = ", ".join(str(seq_len) for seq_len in unmeasured)
    which = f"lengths {lengths} have" if len(unmeasured) > 1 else f"length {lengths} has"
    # A command the user can paste: the literal word LINE left them to work out which line it meant.
    return (
        f"{source}: guards.share_reserve_gb is set but {which} no shared shape "
        f"(run `nsconsole tune {line if line is not None else _line_of(source)} --shared`)"
    )


def _line_of(source: str) -> str:
    """The line directory of a run.json path (`LINE` where `source` is a bare file name)."""
    path = Path(source)
    return str(path.parent) if path.name == "run.json" and path.parent != Path() else "LINE"


def refuse_unshareable_lengths(config: RunConfig, source: str = "run.json") -> None:
    """A reserve with a plan length that has no `shared` shape cannot share: refuse to start."""
    problem = unshareable_lengths_problem(config, source)
    if problem is not None:
        raise ConfigError(problem)
