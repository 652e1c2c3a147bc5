"""The supervisor's state: the record it keeps in supervisor.json.

Rewritten atomically at each change (`Supervisor._save`); read by `status`, the console, and the
next supervisor of the line (its crash count, its queued forks, its `--engine` and `--stop-at`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.protocol.facts import Engine, LineState


@dataclass
class SupervisorState:
    """supervisor.json: what the supervisor is doing and what has happened (rewritten atomically)."""

    pid: int
    """The supervisor's pid."""
    started: float
    """When it started (Unix time)."""
    boot_start: float | None = None
    """When it started, in seconds since boot: with `pid`, this process, whatever the wall clock did
    since (engine.process_start)."""
    state: str = LineState.STARTING
    """What it is doing: a `LineState`."""
    trainer_pid: int | None = None
    """The running trainer's pid."""
    launches: int = 0
    """Trainer launches by this supervisor."""
    trainer_launched: float | None = None
    """When the running trainer was launched (Unix time; None while none runs): the console judges
    its throughput only past its first updates (compilation, warm-up)."""
    crashes: int = 0
    """Trainer exits nobody asked for (`Verdict.crashed`), and supervisors that died with the line
    running, over every life of this line's supervisor (carried over from the supervisor.json before)."""
    failures_in_a_row: int = 0
    """Crashes since the last one that left a newer checkpoint."""
    crashes_beside_others: int = 0
    """Crashes in a row without progress while other processes were on the GPU (not failures)."""
    gpu_index: int | None = None
    """The GPU of the line's lease, NVML's index: held by its trainer, or its last one between two
    launches (None: on the CPU, or waiting for a lease)."""
    gpu_uuid: str | None = None
    """That GPU's UUID: the trainer's CUDA_VISIBLE_DEVICES (`engine/gpu/placement.py`)."""
    trainer_children: list[int] = field(default_factory=list)
    """At parallel.degree above 1, the trainer's processes under `trainer_pid` (torchrun's ranks and
    what they start), so that a reader can sum the line's CPU, memory and GPU memory; empty at
    degree 1, where the trainer is one process."""
    gpu_indices: list[int] = field(default_factory=list)
    """Every GPU of the line's leases, rank 0's first (`gpu_index` alone at parallel.degree 1;
    empty with it None). Each is watched for other processes as the line's own."""
    gpu_candidates: list[int] | None = None
    """The GPUs run.json's `device` lets the line lease, in the order it tries them (None: the CPU)."""
    gpu_holders: list[dict[str, Any]] = field(default_factory=list)
    """While it waits for a lease: who holds each candidate's (`gpu`, `uuid`, `line`, `pid`)."""
    last_exit: dict[str, Any] | None = None
    """The trainer's last exit: code, signal, seconds it ran, newest checkpoint."""
    last_event: dict[str, Any] | None = None
    """The last event (as notified)."""
    requests: list[dict[str, Any]] = field(default_factory=list)
    """Mutations already applied, by request_id (a retry is answered from here)."""
    queued_forks: list[dict[str, Any]] = field(default_factory=list)
    """Branches waiting for the end of their trunk cycle (`engine.supervisor.forks.QueuedFork`)."""
    engine: str = Engine.AUTO
    """The step engine it launches trainers with (`run --engine`): a lost supervisor's line is
    resumed with it (`engine.supervisor.lost`)."""
    stop_at: int | None = None
    """The update its trainers stop at (`run --stop-at`; None: none): kept by a resume too."""
