"""Which physical GPU a line trains on: run.json's `device` against NVML and CUDA_VISIBLE_DEVICES.

`device` is `cpu`; `auto` (any GPU of the host, the first whose lease is free; the CPU on a host
without one); `cuda` (any GPU, as `auto`, but never the CPU); or `cuda:N` (the N-th GPU this
process sees). "Sees": without CUDA_VISIBLE_DEVICES that is every GPU in NVML's order (nvidia-smi's
index, the PCI bus order); under it, the N-th entry of that list, as in CUDA, each entry mapped to
the physical GPU behind it -- a UUID (or a unique prefix of one, as CUDA accepts) directly, an
integer as nvidia-smi's index. (CUDA itself counts integers in CUDA_DEVICE_ORDER, fastest first
by default; on a host whose GPUs are all one model that is the PCI order. nsconsole's own
processes never depend on it: see below.)

The supervisor leases the chosen GPU (`engine.gpu.devices.GpuLease`: the lock file is named for
its NVML index and holds its UUID), reads it through NVML by that index, and launches the trainer
with `CUDA_VISIBLE_DEVICES=<its UUID>` and `NSCONSOLE_GPUS=<its UUID>` (`child_environment`), so
the trainer sees exactly that GPU, as `cuda:0` (`placed_device`). A UUID, not an index: an index
means nothing certain to CUDA in the trainer -- CUDA counts in CUDA_DEVICE_ORDER (not NVML's PCI
order on a mixed host) and within whatever CUDA_VISIBLE_DEVICES the supervisor inherited -- while a
UUID names one physical GPU in every process, so the GPU leased, the GPU NVML watches and the GPU
trained on are one. The trainer's own NVML readings find its GPU by the UUID CUDA reports
(`engine.gpu.sharing.GpuWatch.for_line`).

Torch-free: the supervisor and `nsconsole check`/`new` resolve devices without a CUDA context.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from engine.config.checks import DEVICE_PATTERN
from engine.errors import LineError
from engine.gpu.devices import GpuSnapshot

VISIBLE_VARIABLE = "CUDA_VISIBLE_DEVICES"
PLACED_VARIABLE = "NSCONSOLE_GPUS"
"""Set by the supervisor for the processes it places on leased GPUs: their UUIDs, comma-separated
(also their CUDA_VISIBLE_DEVICES). A trainer that finds it trains on `cuda:0`."""


class PlacementError(LineError):
    """A device setting or CUDA_VISIBLE_DEVICES names no GPU of this host."""


@dataclass(frozen=True)
class PhysicalGpu:
    """One GPU of the host as NVML names it."""

    index: int
    """NVML's index (nvidia-smi's): the lease's lock file is `gpu<index>.lock`."""
    uuid: str
    """NVML's UUID (`GPU-...`): what the trainer's CUDA_VISIBLE_DEVICES holds."""
    name: str
    """The product name."""

    def label(self) -> str:
        return f"GPU {self.index} ({self.uuid})"


@dataclass(frozen=True)
class DeviceSetting:
    """A `device` value taken apart."""

    kind: str
    """`auto`, `cpu` or `cuda`."""
    ordinal: int | None
    """N of `cuda:N` (None: any GPU, or the CPU)."""


def parse_device(device: str) -> DeviceSetting | None:
    """`device` taken apart; None when it is not `auto`, `cpu`, `cuda` or `cuda:N`."""
    if not DEVICE_PATTERN.match(device):
        return None
    kind, _, ordinal = device.partition(":")
    return DeviceSetting(kind, int(ordinal) if ordinal else None)


def host_gpus(snapshot: GpuSnapshot) -> list[PhysicalGpu]:
    """Every GPU NVML lists, in its order."""
    return [PhysicalGpu(device.index, device.uuid, device.name) for device in snapshot.devices]


def visible_gpus(snapshot: GpuSnapshot, environ: Mapping[str, str] | None = None) -> list[PhysicalGpu]:
    """The GPUs this process sees, in the order CUDA numbers them (`cuda:0` first).

    A CUDA_VISIBLE_DEVICES entry that names no GPU of the host (or a MIG instance, or one GPU
    twice) is a `PlacementError`; a negative integer ends the list, as in CUDA.
    """
    environ = os.environ if environ is None else environ
    gpus = host_gpus(snapshot)
    listed = environ.get(VISIBLE_VARIABLE)
    if listed is None:
        return gpus
    if listed.strip() == "":
        return []  # CUDA_VISIBLE_DEVICES="" hides every GPU
    visible: list[PhysicalGpu] = []
    for entry in (part.strip() for part in listed.split(",")):
        gpu = _visible_entry(entry, gpus, listed)
        if gpu is None:
            break
        if gpu in visible:
            raise PlacementError(f"{VISIBLE_VARIABLE}={listed}: {gpu.label()} is listed twice")
        visible.append(gpu)
    return visible


def _visible_entry(entry: str, gpus: list[PhysicalGpu], listed: str) -> PhysicalGpu | None:
    where = f"{VISIBLE_VARIABLE}={listed}"
    if re.fullmatch(r"-?\d+", entry):
        index = int(entry)
        if index < 0:
            return None
        if index >= len(gpus):
            raise PlacementError(f"{where}: GPU {index} does not exist ({_count(gpus)})")
        return gpus[index]
    if entry.startswith("MIG-"):
        raise PlacementError(f"{where}: {entry} is a MIG instance; nsconsole leases whole GPUs")
    if entry.startswith("GPU-") and len(entry) > len("GPU-"):
        matches = [gpu for gpu in gpus if gpu.uuid.startswith(entry)]
        if len(matches) == 1:
            return matches[0]
        problem = "matches no GPU of this host" if not matches else f"matches {len(matches)} GPUs"
        raise PlacementError(f"{where}: {entry} {problem} ({_count(gpus)})")
    raise PlacementError(f"{where}: {entry!r} is neither a GPU index nor a GPU UUID")


def _count(gpus: Sequence[PhysicalGpu]) -> str:
    if not gpus:
        return "this host has no GPU"
    if len(gpus) == 1:
        return "this host has 1 GPU, 0"
    return f"this host has {len(gpus)} GPUs, 0..{len(gpus) - 1}"


def gpu_candidates(
    device: str, snapshot: GpuSnapshot, environ: Mapping[str, str] | None = None, degree: int = 1
) -> list[PhysicalGpu] | None:
    """The GPUs a line with this `device` and `degree` ranks may lease, in the order it tries them;
    None: the CPU. `auto` and `cuda` offer every visible GPU (the line takes the first `degree` free
    ones); `cuda:N` names exactly GPUs N .. N + degree - 1 of the visible ones (rank r on N + r).

    `PlacementError` (one line) when the setting names no GPU there is: `cuda:N` past the GPUs
    this process sees (or its ranks' GPUs past them), `cuda` on a host without one.
    """
    setting = parse_device(device)
    if setting is None:
        raise PlacementError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
    if setting.kind == "cpu":
        return None
    if not snapshot.available:
        if setting.kind == "auto":
            return None
        raise PlacementError(f"device {device}: {snapshot.reason}")
    visible = visible_gpus(snapshot, environ)
    under = _under_visible(environ)
    if setting.ordinal is None:
        if visible:
            return visible
        if setting.kind == "auto":
            return None
        raise PlacementError(f"device {device}: no GPU is visible{under}")
    seen = f"{len(visible)} visible{under}" if under else _count(visible)
    if setting.ordinal >= len(visible):
        raise PlacementError(f"device {device}: no such GPU ({seen})")
    last = setting.ordinal + degree - 1
    if last >= len(visible):
        raise PlacementError(
            f"device {device} at parallel.degree {degree}: its ranks need GPUs {setting.ordinal}..{last} ({seen})"
        )
    return visible[setting.ordinal : last + 1]


def gpus_label(indices: Sequence[int]) -> str:
    """`GPU 3` or `GPUs 2, 3`: the GPUs of a line, by NVML's index."""
    if len(indices) == 1:
        return f"GPU {indices[0]}"
    return "GPUs " + ", ".join(str(index) for index in indices)


def _under_visible(environ: Mapping[str, str] | None) -> str:
    listed = (os.environ if environ is None else environ).get(VISIBLE_VARIABLE)
    return "" if listed is None else f" under {VISIBLE_VARIABLE}={listed}"


def device_finding(
    device: str,
    snapshot: GpuSnapshot,
    source: str = "run.json",
    environ: Mapping[str, str] | None = None,
    degree: int = 1,
) -> tuple[bool, str]:
    """Whether `device` (with `degree` ranks) names devices of this host, and one line saying which
    or what is wrong (`nsconsole new` refuses, and `nsconsole check` reports, on it)."""
    try:
        gpus = gpu_candidates(device, snapshot, environ, degree)
    except PlacementError as error:
        return False, f"{source}: {error}"
    if gpus is None:
        return True, f"device {device}: the CPU"
    if len(gpus) < degree:
        return False, f"{source}: device {device}: parallel.degree {degree} needs {degree} GPUs, {len(gpus)} visible"
    if device.startswith("cuda:"):
        named = "; ".join(f"{gpu.label()}, {gpu.name}" for gpu in gpus)
        return True, f"device {device}: {named}"
    if len(gpus) == degree:
        # No choice to make: "the first of GPUs 1" read as if there were several to pick from.
        leases = "its lease is" if degree == 1 else "their leases are"
        return True, f"device {device}: {gpus_label([gpu.index for gpu in gpus])}, when {leases} free"
    indices = ", ".join(str(gpu.index) for gpu in gpus)
    first = "the first" if degree == 1 else f"the first {degree}"
    return True, f"device {device}: {first} of GPUs {indices} whose lease is free"


def child_environment(gpus: Sequence[PhysicalGpu], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a process placed on `gpus` (the trainer, a tune): it sees them, and
    only them, as cuda:0, cuda:1, ... by UUID (see the module docstring)."""
    child = dict(os.environ if environ is None else environ)
    uuids = ",".join(gpu.uuid for gpu in gpus)
    child[VISIBLE_VARIABLE] = uuids
    child[PLACED_VARIABLE] = uuids
    return child


def placed_device(setting: str, environ: Mapping[str, str] | None = None) -> str:
    """The device a trainer uses for run.json's `setting`: `cuda:0` once the supervisor placed it
    on a leased GPU (NSCONSOLE_GPUS set: the GPU it resolved `setting` to is the only one visible),
    else the setting itself (a trainer run without a supervisor, `cpu`)."""
    placed = (os.environ if environ is None else environ).get(PLACED_VARIABLE)
    if placed and setting != "cpu":
        return "cuda:0"
    return setting
