"""The trainer's step engines: one per sequence length, in the GPU mode's shapes, and the arena.

On CUDA (unless `--engine eager`) a length's engine is a `GraphEngine` captured inside the arena
(engine.training.arena), which is made with the first capture: beside other processes it leaves free what
they may still take. Before every capture the trainer's `before_capture(seq_len)` runs (one row
of each probe); a step that cannot be captured trains eagerly with `--engine auto` (run.log says
why), but an out-of-memory is never taken for that: it is raised to the trainer, which knows
whether other processes took the memory. On a CPU every engine is eager, and so is every engine
of a model sharded by FSDP2 (`parallel.shard: fsdp`): torch cannot capture its collectives and
hooks in a CUDA graph (the trainer says so in run.log).

The GPU mode says whose shapes the engines use: the lengths' own, or their `shared` ones beside
other processes (engine.gpu.sharing). A switch drops every engine and the arena; the next update
captures again in the new shapes.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch

from engine.config.run import RunConfig
from engine.errors import is_out_of_memory
from engine.gpu.sharing import GpuMode
from engine.models.base import LanguageModel
from engine.protocol.facts import Engine, Stage
from engine.training.distributed import FullyShardedModel, Ranks
from engine.training.optim import FlatAdamW
from engine.training.step import EagerEngine, GraphEngine
from engine.units import GIB

ARENA_RELEASE_FRACTION = 0.9
"""A switch of shapes needs at least this much of the closed arena's memory back from the driver."""
HOLD_AT_LEAST_BYTES = 256 << 20
"""Smaller excesses of free memory over the others' room are left alone (allocator noise)."""


class ArenaNotReleased(RuntimeError):
    """The closed arena's memory did not come back (something still holds a block of its pool)."""

    def __init__(self, held_bytes: int) -> None:
        super().__init__(f"the arena's {held_bytes / GIB:.1f} GiB did not come back")
        self.held_bytes = held_bytes


class StepEngines:
    """The step engines of a line's lengths and, on CUDA, the arena they share (see the module)."""

    def __init__(
        self,
        model: LanguageModel,
        optimizer: FlatAdamW,
        config: RunConfig,
        device: torch.device,
        engine_choice: str,
        room_for_others: Callable[[], int],
        before_capture: Callable[[int], None],
        log: Callable[[str], None],
        phase: Callable[..., AbstractContextManager[None]] = lambda stage, **details: nullcontext(),
        ranks: Ranks | None = None,
        sharded: FullyShardedModel | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.config = config
        self.device = device
        self.engine_choice = engine_choice
        self.room_for_others = room_for_others
        """Bytes a shared arena leaves free (the reserve less what the others hold)."""
        self.before_capture = before_capture
        self.log = log
        self.phase = phase
        """`phase(stage, **details)`: a context that beats the heartbeat through a long phase."""
        self.ranks = ranks or Ranks.alone()
        """The rank's group: each engine trains on its rows and sums the gradient across the ranks."""
        self.sharded = sharded
        """FSDP2's wrapper of the model (`parallel.shard: fsdp`): eager engines only."""
        self.gpu_mode = GpuMode.OWN
        """Whose shapes the engines use: the lengths' own, or their `shared` ones beside other processes."""
        self.arena: Any = None
        """The GPU memory arena (engine.training.arena.Arena), made with the first CUDA-graph engine."""
        self._engines: dict[int, EagerEngine | GraphEngine] = {}

    def shape(self, seq_len: int) -> tuple[int, str]:
        """(micro_batch_rows, recompute) of a length in the current GPU mode."""
        length = self.config.length(seq_len)
        if self.gpu_mode == GpuMode.SHARED and length.shared is not None:
            return length.shared.micro_batch_rows, length.shared.recompute
        return length.micro_batch_rows, length.recompute

    def slice_rows(self, seq_len: int) -> int:
        """The micro-batch an update of this length is dealt to a group's ranks in: the length's
        own, whatever the GPU mode, so every rank cuts the update alike."""
        return self.config.length(seq_len).micro_batch_rows

    def made(self, seq_len: int) -> bool:
        """Whether the length's engine exists (its first update may still be ahead)."""
        return seq_len in self._engines

    def for_length(self, seq_len: int) -> EagerEngine | GraphEngine:
        """The length's engine, made (and on CUDA captured) on first use."""
        if seq_len not in self._engines:
            rows, _recompute = self.shape(seq_len)
            engine: EagerEngine | GraphEngine | None = None
            capturable = self.device.type == "cuda" and self.sharded is None
            if capturable and self.engine_choice in (Engine.AUTO, Engine.GRAPH):
                try:
                    with self.phase(Stage.CAPTURING, seq_len=seq_len):
                        engine = self._captured(seq_len, rows)
                except RuntimeError as error:
                    if is_out_of_memory(error) or self.engine_choice == Engine.GRAPH:
                        raise
                    self.optimizer.zero_grad()
                    first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
                    self.log(f"CUDA graph capture failed at seq_len {seq_len} ({first_line}); eager engine")
            if engine is None:
                engine = EagerEngine(self.model, self.optimizer, rows, self.ranks, self.slice_rows(seq_len), self.sharded)
            self._engines[seq_len] = engine
        return self._engines[seq_len]

    def _captured(self, seq_len: int, rows: int) -> GraphEngine:
        from engine.training.arena import Arena

        if self.arena is None:
            # Beside other processes the arena leaves free what they may still take: the reserve
            # less what they hold (the free memory it reads already excludes that).
            room = self.room_for_others() if self.gpu_mode == GpuMode.SHARED else 0
            self.arena = Arena(self.device, reserve_bytes=room)
        else:
            self.arena.release_held()  # a capture needs its slack outside the pool
        self.before_capture(seq_len)
        return GraphEngine(self.model, self.optimizer, rows, seq_len, self.arena, self.ranks, self.slice_rows(seq_len))

    @contextmanager
    def from_the_arena(self) -> Iterator[None]:
        """Validation's allocations served from the arena (the spec): the arena holds all but a
        4 GiB slack of the GPU, so a long row's activations, larger than any of a training step's,
        fit only there. On the arena's stream, ordered after the updates and before the next; the
        blocks it frees go back to the pool, whose graph intermediates every replay rewrites."""
        if self.arena is None:
            yield
            return
        arena, current = self.arena, torch.cuda.current_stream(self.device)
        arena.stream.wait_stream(current)
        with torch.cuda.stream(arena.stream), arena.allocating():
            yield
        current.wait_stream(arena.stream)

    def free_bytes(self) -> int:
        """The device's free memory now (0 off CUDA)."""
        return torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else 0

    def hold_past(self, room: int, free: int) -> int:
        """Sharing: hold in the arena what is free past `room` (what the others may still take,
        `free` read just before); the bytes newly held (0 without an arena or a real excess)."""
        excess = free - room
        if self.arena is None or excess < HOLD_AT_LEAST_BYTES:
            return 0
        return excess if self.arena.hold(excess) else 0

    def drop(self) -> None:
        """Close every engine and the arena; ArenaNotReleased when the arena's memory stays held."""
        for engine in self._engines.values():
            engine.close()
        self._engines.clear()
        gc.collect()  # nothing may keep a tensor of the arena's pool alive: it would pin the pool
        if self.arena is None:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            return
        from engine.training.arena import release_step_caches

        release_step_caches(self.model)
        held = self.arena.held_bytes
        released = self.arena.close()  # after the engines' graphs are gone; empties the CUDA cache
        self.arena = None
        if held > GIB and released < ARENA_RELEASE_FRACTION * held:
            raise ArenaNotReleased(held)

    def switch(self, mode: str) -> None:
        """Drop the engines and the arena and take `mode`'s shapes from the next update on;
        ArenaNotReleased (the mode unchanged) when the old arena's memory does not come back."""
        self.drop()
        self.gpu_mode = mode
