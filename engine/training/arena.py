"""The trainer's GPU memory arena: one `torch.cuda.MemPool` holding the GPU's memory in large blocks.

A caching allocator that takes blocks from the driver as they are asked for holds none larger
than the largest allocation so far, so a later, larger request (a long validation row) would
need a fresh cudaMalloc -- which fails once other processes or fragmentation have taken the
space. The arena instead reserves, at its start, everything but a slack (what a graph capture
creates outside the allocator) and a reserve (what other processes may still take) as one
segment of the pool; every allocation of an engine's warm-up and capture and of validation is
made inside `allocating()` on the arena's `stream` and is carved out of that segment, and captured
graphs use the same pool and stream (`pool_handle()`, `stream`). The stream matters: the caching
allocator reuses a freed block only for the stream it was allocated on, so a block cached for one
stream is dead weight to work on another (a warm-up on one stream and a capture on another would
hold their peak memory twice).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from engine.units import GIB

DEFAULT_SLACK_BYTES = 4 * GIB
"""Left outside the arena for what a capture (cuBLAS workspaces, graph objects) creates outside it."""


class Arena:
    """One memory pool on one CUDA device, pre-filled with a single large block."""

    def __init__(self, device: torch.device, slack_bytes: int = DEFAULT_SLACK_BYTES, reserve_bytes: int = 0):
        if device.type != "cuda":
            raise ValueError("Arena needs a CUDA device")
        # The pool API wants an explicit index: `cuda` means the current device.
        self.device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        device = self.device
        self.pool = torch.cuda.MemPool()
        self.stream = torch.cuda.Stream(device)
        self._hold_pool: torch.cuda.MemPool | None = None
        self.extra_held_bytes = 0
        """Held by `hold` beyond the pool's segment (sharing: what the others may not take)."""
        free_bytes, _total = torch.cuda.mem_get_info(device)
        self.held_bytes = max(free_bytes - slack_bytes - reserve_bytes, 0)
        if self.held_bytes:
            with torch.cuda.stream(self.stream), self.allocating():
                # Allocated and freed at once: the segment stays cached in this pool, and later
                # allocations made inside `allocating()` (and graph captures) are split from it.
                block = torch.empty(self.held_bytes, dtype=torch.uint8, device=device)
                del block
            self.stream.synchronize()

    def hold(self, nbytes: int) -> bool:
        """Hold `nbytes` more of the device in a pool of their own that nothing allocates from.

        Beside other processes the free memory should be what they may still take (the reserve
        less what they use): what they free past that is held again here, so they cannot grow
        past their reserve. Given back by `release_held` before a capture, which needs its room
        outside the pool, and by `close`. False (nothing held) when the memory went meanwhile.
        """
        if self._hold_pool is None:
            self._hold_pool = torch.cuda.MemPool()
        try:
            with torch.cuda.stream(self.stream), self.allocating(self._hold_pool):
                block = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                del block  # cached in the hold pool, which nothing else allocates from
        except torch.OutOfMemoryError:
            return False  # another process took it between the reading and now
        self.stream.synchronize()
        self.extra_held_bytes += nbytes
        return True

    def release_held(self) -> int:
        """Give back what `hold` took; the bytes the device got back."""
        if self._hold_pool is None:
            return 0
        return self._bytes_back_after(self._drop_hold)

    def _drop_hold(self) -> None:
        self._hold_pool = None
        self.extra_held_bytes = 0

    def _bytes_back_after(self, drop: Callable[[], None]) -> int:
        """Run `drop` (which lets go of pools) and empty the CUDA cache: the bytes the device got back."""
        torch.cuda.synchronize(self.device)
        free_before, _total = torch.cuda.mem_get_info(self.device)
        drop()
        torch.cuda.empty_cache()
        free_after, _total = torch.cuda.mem_get_info(self.device)
        return free_after - free_before

    @contextmanager
    def allocating(self, pool: torch.cuda.MemPool | None = None) -> Iterator[None]:
        """Serve the device's CUDA allocations, from every thread, from the arena's pool (or `pool`) meanwhile.

        Every thread, not only this one (`torch.cuda.use_mem_pool`): autograd runs a CUDA
        backward on its own worker thread, whose allocations would otherwise bypass the pool and
        find the memory the arena holds unavailable. This is the routing a graph capture uses,
        through the same private allocator entry points `use_mem_pool` calls.
        """
        index, pool_id = self.device.index, (pool or self.pool).id
        torch._C._cuda_beginAllocateToPool(index, pool_id)
        try:
            yield
        finally:
            torch._C._cuda_endAllocateToPool(index, pool_id)
            torch._C._cuda_releasePool(index, pool_id)

    def pool_handle(self) -> tuple[int, int]:
        """The pool id `torch.cuda.graph(..., pool=)` takes, so captures share the arena."""
        return self.pool.id

    def close(self) -> int:
        """Give the memory back to the driver (after every tensor and graph using it is gone); the
        bytes the device got back (less than `held_bytes` while anything still holds a block of
        the pool: a segment is returned only whole)."""

        def drop_pools() -> None:
            del self.pool
            self._drop_hold()

        return self._bytes_back_after(drop_pools)


def release_step_caches(model: torch.nn.Module) -> None:
    """Before an arena closes: drop what a step leaves cached that may live in its pool -- the
    model's tables and masks (`release_device_caches`) and cuBLAS's per-stream workspaces, made
    from the pool when the arena stream's first matrix product ran inside `allocating()`. Any of
    them would keep the whole pool (one segment) from going back to the driver."""
    release = getattr(model, "release_device_caches", None)
    if callable(release):
        release()
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # CUDA builds only
    if clear_workspaces is not None and torch.cuda.is_available():
        clear_workspaces()
