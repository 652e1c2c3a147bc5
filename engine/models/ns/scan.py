"""The dendritic compartments' recurrence as a chunked scan of matrix products (the SSD form).

Per head h (scalar decay A_h < 0, step dt_t >= 0), per group g(h) of the input / output maps:

    V_t = exp(A_h dt_t) V_{t-1} + dt_t B_t u_t^T        (N x P)
    y_t = C_t^T V_t                                     (P,)

Cut the row into chunks of L tokens. With a_t = A_h dt_t and the decay from s to t
exp(a_{s+1} + ... + a_t), a chunk's outputs are

    y_t = sum_{s <= t in the chunk} exp(a_{s+1..t}) (C_t . B_s) dt_s u_s  +  exp(a_{first..t}) C_t^T S

where S is the state entering the chunk: a lower-triangular (L x L) decay matrix times the
(L x L) matrix C B^T, applied to the chunk's inputs, plus the entering state read through C.
The chunks' own contributions to the state are matrix products too, and the states pass
between chunks through a (chunks + 1) x (chunks + 1) lower-triangular decay matrix. Nothing
is sequential, so the work runs as batched matrix products (tensor cores under autocast).
The decay exponents are sums over exactly the steps they span (never differences of long
running sums), so a fast head's large exponents cannot swamp a slow head's small ones.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional as F

from engine.models.base import compile_static


def segment_sums(x: torch.Tensor) -> torch.Tensor:
    """(..., T) -> (..., T, T): out[..., i, j] = x_{j+1} + ... + x_i for i >= j, -inf above the diagonal."""
    length = x.shape[-1]
    strictly_lower = torch.ones(length, length, dtype=torch.bool, device=x.device).tril(-1)
    # Column j keeps x_i for rows i > j; the running sum down the column is the segment sum.
    spread = x.unsqueeze(-1).expand(*x.shape, length).masked_fill(~strictly_lower, 0.0)  # (..., T, T)
    sums = spread.cumsum(dim=-2)
    lower = strictly_lower | torch.eye(length, dtype=torch.bool, device=x.device)
    return sums.masked_fill(~lower, float("-inf"))


def chunked_scan(
    u: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_len: int,
    state0: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence above for every head at once.

    u (Bt, T, H, P); dt (Bt, T, H) >= 0; A (H,) < 0; B, C (Bt, T, G, N) with head h reading
    group h // (H // G); state0 (Bt, H, N, P) or None (zeros).
    Returns y (Bt, T, H, P) and the last state (Bt, H, N, P), both float32 (float64 for
    float64 inputs): the scan of a row equals the scan of its first part followed by the scan
    of the rest from the first part's last state.
    """
    batch, length, heads, head_dim = u.shape
    groups, state_size = B.shape[2], B.shape[3]
    heads_per_group = heads // groups
    dtype = torch.promote_types(u.dtype, torch.float32)
    pad = (-length) % chunk_len
    if pad:
        # Padding with dt = 0 and u = 0 neither decays nor drives the state: the last state is exact.
        u, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (u, B, C))
        dt = F.pad(dt, (0, 0, 0, pad))
    chunks = (length + pad) // chunk_len
    L = chunk_len
    u = u.to(dtype).view(batch, chunks, L, groups, heads_per_group, head_dim)
    B = B.to(dtype).view(batch, chunks, L, groups, state_size)
    C = C.to(dtype).view(batch, chunks, L, groups, state_size)
    dt = dt.to(dtype).view(batch, chunks, L, groups, heads_per_group)
    log_decay = (dt * A.to(dtype).view(groups, heads_per_group)).permute(0, 3, 4, 1, 2)  # (Bt, G, R, c, L)
    drive = u * dt.unsqueeze(-1)  # (Bt, c, L, G, R, P): dt_s u_s

    # Within a chunk: y_t = sum_s [exp(a_{s+1..t}) (C_t . B_s)] drive_s.
    decay_within = torch.exp(segment_sums(log_decay))  # (Bt, G, R, c, L, L)
    overlap = torch.einsum("bclgn,bcsgn->bgcls", C, B)  # (Bt, G, c, L, L)
    mixing = decay_within * overlap.unsqueeze(2)  # (Bt, G, R, c, L, L)
    y = torch.einsum("bgrcls,bcsgrp->bclgrp", mixing, drive)  # (Bt, c, L, G, R, P)

    # Each chunk's own contribution to the state at its end: sum_s exp(a_{s+1..end}) B_s drive_s^T.
    decay_to_end = decay_within[..., -1, :]  # (Bt, G, R, c, L): the last row of the decay matrix
    weighted = drive * decay_to_end.permute(0, 3, 4, 1, 2).unsqueeze(-1)  # (Bt, c, L, G, R, P)
    chunk_states = torch.einsum("bcsgn,bcsgrp->bcgrnp", B, weighted)  # (Bt, c, G, R, N, P)

    # Between chunks: the state entering chunk j sums every earlier chunk's contribution (and
    # the carried state, as chunk -1) decayed by the chunks in between.
    # This product is small ((c + 1)^2 N P per head) and it is the carried state: keep it out
    # of autocast, in float32, so the state does not round to bf16 at every window.
    if state0 is None:
        state0 = u.new_zeros(batch, heads, state_size, head_dim)
    with torch.autocast(device_type=u.device.type, enabled=False):
        initial = state0.to(dtype).view(batch, 1, groups, heads_per_group, state_size, head_dim)
        contributions = torch.cat([initial, chunk_states.to(dtype)], dim=1)  # (Bt, c + 1, G, R, N, P)
        chunk_totals = F.pad(log_decay.sum(dim=-1), (1, 0))  # (Bt, G, R, c + 1)
        decay_between = torch.exp(segment_sums(chunk_totals))  # (Bt, G, R, c + 1, c + 1)
        states = torch.einsum("bgrzi,bigrnp->bzgrnp", decay_between, contributions)  # (Bt, c+1, G, R, N, P)

    # The entering state read through C_t, decayed from the chunk's start to t.
    decay_from_start = torch.cumsum(log_decay, dim=-1)  # (Bt, G, R, c, L): a_{first..t}
    entering = states[:, :-1]  # (Bt, c, G, R, N, P)
    read = torch.einsum("bclgn,bcgrnp->bclgrp", C, entering)  # (Bt, c, L, G, R, P)
    y = y + read * torch.exp(decay_from_start).permute(0, 3, 4, 1, 2).unsqueeze(-1)

    y = y.reshape(batch, chunks * L, heads, head_dim)[:, :length]
    last_state = states[:, -1].reshape(batch, heads, state_size, head_dim)
    return y, last_state


def recurrent_step(
    u: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_len: int,
    state0: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunked_scan` of one token (T = 1), as the recurrence itself: a decoder's step costs the
    state's size (H x N x P), where the chunked scan would pad the token to a whole chunk of
    (L x L) matrices. Same arguments and results as `chunked_scan` (chunk_len unused); the state
    is kept out of autocast, in float32, as the scan keeps it between chunks."""
    batch, length, heads, head_dim = u.shape
    if length != 1:
        raise ValueError(f"recurrent_step takes one token, got {length}")
    groups, state_size = B.shape[2], B.shape[3]
    heads_per_group = heads // groups
    dtype = torch.promote_types(u.dtype, torch.float32)
    if state0 is None:
        state0 = u.new_zeros(batch, heads, state_size, head_dim, dtype=dtype)
    with torch.autocast(device_type=u.device.type, enabled=False):
        u = u.to(dtype).view(batch, groups, heads_per_group, head_dim)
        dt = dt.to(dtype).view(batch, groups, heads_per_group)
        B = B.to(dtype).view(batch, groups, state_size)
        C = C.to(dtype).view(batch, groups, state_size)
        decay = torch.exp(dt * A.to(dtype).view(groups, heads_per_group))  # (Bt, G, R)
        state = state0.to(dtype).view(batch, groups, heads_per_group, state_size, head_dim)
        drive = u * dt.unsqueeze(-1)  # (Bt, G, R, P): dt u
        state = decay[..., None, None] * state + torch.einsum("bgn,bgrp->bgrnp", B, drive)
        y = torch.einsum("bgn,bgrnp->bgrp", C, state)  # (Bt, G, R, P)
    return y.reshape(batch, 1, heads, head_dim), state.reshape(batch, heads, state_size, head_dim)


def compiled_chunked_scan() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """`chunked_scan` through torch.compile, for CUDA tensors. Eagerly, every einsum, exp and mask
    above is its own kernel with its own (Bt, G, R, c, L, L) intermediate in device memory; compiled,
    the elementwise work fuses into the matrix products' neighbours: 19.6 against 7.1 ms forward +
    backward on the H200 at B 8, T 4096, 40 heads of 64, N 64 (`python bench/ns_layers.py --only
    scan`), and ns-1p3b's update 1.42x faster (bench/RESULTS.md, session 8). Shapes are static: one
    compilation per training or validation shape, at the engine's warm-up, before any CUDA graph
    capture (past `engine.models.base.RECOMPILE_LIMIT` shapes, a new shape runs eagerly), in inductor's
    deterministic mode (`engine.models.base.compile_static`)."""
    return compile_static(chunked_scan)
