"""What the console reads once from a line's run.json: its preset, its learning-rate schedule, its guards."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.units import gib_bytes


@dataclass(frozen=True)
class LineFacts:
    """What the console reads once from a line's run.json (written atomically, so safe to read)."""

    preset: str | None = None
    """The model preset (`pssa-*` lines get the memory tab)."""
    schedule: Callable[[float], float] | None = None
    """The learning rate at a number of tokens trained (None: unknown, no lr check)."""
    share_reserve_gb: float | None = None
    """run.json's `guards.share_reserve_gb`, GiB (2**30 bytes) left to other processes on the GPU;
    None: sharing is off (the line waits for a free GPU)."""
    min_free_disk_gb: float | None = None
    """run.json's `guards.min_free_disk_gb`, the line's own disk guard in GiB (2**30 bytes)."""

    @property
    def is_pssa(self) -> bool:
        return bool(self.preset and self.preset.startswith("pssa"))

    @property
    def sharing(self) -> bool:
        return self.share_reserve_gb is not None

    @property
    def share_reserve_bytes(self) -> int | None:
        """The reserve in bytes, converted as GiB like the trainer's (`GuardsConfig.share_reserve_bytes`)."""
        return None if self.share_reserve_gb is None else gib_bytes(self.share_reserve_gb)

    @property
    def min_free_disk_bytes(self) -> int | None:
        """The disk guard in bytes, converted as GiB like the trainer's (`GuardsConfig.min_free_disk_bytes`)."""
        return None if self.min_free_disk_gb is None else gib_bytes(self.min_free_disk_gb)
