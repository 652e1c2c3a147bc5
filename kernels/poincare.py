"""Poincare-ball memory read: attention over a bank of slots by hyperbolic distance.

    d_H(q, k) = arccosh(1 + 2 |q - k|^2 / ((1 - |q|^2)(1 - |k|^2)))
    w         = softmax(-d_H / tau) over the top_k nearest occupied slots (0 = every slot)
    m         = sum_s w_s v_s                      (zeros when no slot is occupied)

The distance is clamped so it stays finite: each (1 - |x|^2) factor is held at BALL_MARGIN or
more (a point on the boundary is infinitely far) and the arccosh argument at ACOSH_MIN_ARG or
more (arccosh' is infinite at 1, where q equals a key). Gradient flows to q only: keys, values
and occupancy are the bank's detached state.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._dispatch import compute_dtype, new_buffer, wants_triton

BALL_MARGIN = 1e-5
"""Smallest value of 1 - |x|^2 used in the distance (keeps points on the boundary finite)."""
ACOSH_MIN_ARG = 1.0 + 1e-6
"""Smallest arccosh argument (keeps the gradient finite where q coincides with a key)."""



def hyperbolic_distance(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """d_H between every query (Nq, Dk) and every key (S, Dk) -> (Nq, S), clamped as documented."""
    query_sq = (queries * queries).sum(-1)  # (Nq,)
    key_sq = (keys * keys).sum(-1)  # (S,)
    # |q - k|^2 = |q|^2 + |k|^2 - 2 q.k without the (Nq, S, Dk) difference tensor; rounding can
    # take it a hair below 0 when q is a key.
    gap_sq = (query_sq[:, None] + key_sq[None, :] - 2 * queries @ keys.T).clamp_min(0)  # (Nq, S)
    conformal = (1 - query_sq).clamp_min(BALL_MARGIN)[:, None] * (1 - key_sq).clamp_min(BALL_MARGIN)[None]
    return torch.acosh((1 + 2 * gap_sq / conformal).clamp_min(ACOSH_MIN_ARG))


def poincare_read_reference(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    occupied: torch.Tensor,
    tau: float,
    top_k: int,
) -> torch.Tensor:
    """The read in plain PyTorch autograd (the definition the kernel is tested against).

    q (Nq, Dk); keys (S, Dk); values (S, Dv); occupied (S,) bool -> m (Nq, Dv) in q's dtype.
    """
    dtype = compute_dtype(q, keys, values)
    queries = q.to(dtype)
    keys_c, values_c = keys.detach().to(dtype), values.detach().to(dtype)
    slots = keys.shape[0]
    distance = hyperbolic_distance(queries, keys_c)  # (Nq, S)
    occupied_rows = occupied.to(torch.bool)[None, :].expand_as(distance)  # (Nq, S)
    if 0 < top_k < slots:
        # Nearest occupied slots first: free slots are pushed to +inf before choosing.
        ranking = distance.detach().masked_fill(~occupied_rows, float("inf"))
        chosen = ranking.topk(top_k, dim=-1, largest=False).indices  # (Nq, k)
        selected = torch.zeros_like(occupied_rows).scatter_(1, chosen, True) & occupied_rows
    else:
        selected = occupied_rows
    logits = (-distance / tau).masked_fill(~selected, float("-inf"))  # (Nq, S)
    # Rows with nothing selected (an empty bank) have max -inf: shift by 0 so they give weight 0.
    shift = logits.detach().amax(-1, keepdim=True)
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    unnormalised = torch.exp(logits - shift)  # (Nq, S); exactly 0 off the selection
    total = unnormalised.sum(-1, keepdim=True)
    weights = unnormalised / torch.where(total > 0, total, torch.ones_like(total))
    return (weights @ values_c).to(q.dtype)


_DIST_BLOCK_Q = 32
"""Queries per program of the distance kernel."""
_DIST_BLOCK_S = 64
"""Slots per program of the distance kernel."""
_READ_BLOCK_K = 64
"""Slots per step of the read's online softmax (a query reads its top_k slots, or all of them)."""
_NO_LOGIT = tl.constexpr(-1.0e30)
"""Start of the running maximum: finite, so a block of only free slots leaves no NaN behind."""
_INF = tl.constexpr(float("inf"))


@triton.jit
def _distance_kernel(
    q_ptr, keys_ptr, occupied_ptr, distance_ptr, queries, slots, key_dim, ball_margin, acosh_min,
    BLOCK_Q: tl.constexpr, BLOCK_S: tl.constexpr, DK_PAD: tl.constexpr,
):
    """(Nq, S) distances for ranking, +inf at free slots; the same expansion as the reference."""
    query = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    slot = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    dim = tl.arange(0, DK_PAD)
    query_ok = query < queries
    slot_ok = slot < slots
    dim_ok = dim < key_dim
    q_tile = tl.load(
        q_ptr + query[:, None] * key_dim + dim[None, :], mask=query_ok[:, None] & dim_ok[None, :], other=0.0
    ).to(tl.float32)  # (BLOCK_Q, DK_PAD)
    k_tile = tl.load(
        keys_ptr + slot[:, None] * key_dim + dim[None, :], mask=slot_ok[:, None] & dim_ok[None, :], other=0.0
    ).to(tl.float32)  # (BLOCK_S, DK_PAD)
    dots = tl.dot(q_tile, tl.trans(k_tile), input_precision="ieee")  # (BLOCK_Q, BLOCK_S)
    q_sq = tl.sum(q_tile * q_tile, axis=1)
    k_sq = tl.sum(k_tile * k_tile, axis=1)
    gap = tl.maximum(q_sq[:, None] + k_sq[None, :] - 2.0 * dots, 0.0)
    conformal = tl.maximum(1.0 - q_sq, ball_margin)[:, None] * tl.maximum(1.0 - k_sq, ball_margin)[None, :]
    argument = tl.maximum(1.0 + 2.0 * gap / conformal, acosh_min)
    distance = tl.log(argument + tl.sqrt(argument * argument - 1.0))
    occupied = tl.load(occupied_ptr + slot, mask=slot_ok, other=0) != 0
    distance = tl.where(occupied[None, :], distance, _INF)
    tl.store(
        distance_ptr + query[:, None].to(tl.int64) * slots + slot[None, :], distance,
        mask=query_ok[:, None] & slot_ok[None, :],
    )


@triton.jit
def _slot_terms(
    q, q_sq, keys_ptr, values_ptr, occupied_ptr, chosen_ptr, query, position, position_ok,
    top_k, key_dim, value_dim, inv_tau, ball_margin, acosh_min,
    DK_PAD: tl.constexpr, DV_PAD: tl.constexpr,
):
    """For one query and a block of its chosen slots: keys, values, logits (-inf where not read)
    and what the backward needs of the distance."""
    slot = tl.load(chosen_ptr + query.to(tl.int64) * top_k + position, mask=position_ok, other=0)
    dim = tl.arange(0, DK_PAD)
    value_index = tl.arange(0, DV_PAD)
    keys = tl.load(
        keys_ptr + slot[:, None] * key_dim + dim[None, :],
        mask=position_ok[:, None] & (dim[None, :] < key_dim), other=0.0,
    ).to(tl.float32)  # (BLOCK_K, DK_PAD)
    values = tl.load(
        values_ptr + slot[:, None] * value_dim + value_index[None, :],
        mask=position_ok[:, None] & (value_index[None, :] < value_dim), other=0.0,
    ).to(tl.float32)  # (BLOCK_K, DV_PAD)
    readable = position_ok & (tl.load(occupied_ptr + slot, mask=position_ok, other=0) != 0)
    k_sq = tl.sum(keys * keys, axis=1)
    gap_raw = q_sq + k_sq - 2.0 * tl.sum(keys * q[None, :], axis=1)
    gap = tl.maximum(gap_raw, 0.0)
    q_room = tl.maximum(1.0 - q_sq, ball_margin)
    k_room = tl.maximum(1.0 - k_sq, ball_margin)
    argument_raw = 1.0 + 2.0 * gap / (q_room * k_room)
    argument = tl.maximum(argument_raw, acosh_min)
    distance = tl.log(argument + tl.sqrt(argument * argument - 1.0))
    logits = tl.where(readable, -distance * inv_tau, -_INF)
    return keys, values, logits, readable, gap, gap_raw, q_room, k_room, argument, argument_raw


@triton.jit
def _read_forward_kernel(
    q_ptr, keys_ptr, values_ptr, occupied_ptr, chosen_ptr, m_ptr, log_total_ptr,
    top_k, key_dim, value_dim, inv_tau, ball_margin, acosh_min,
    BLOCK_K: tl.constexpr, DK_PAD: tl.constexpr, DV_PAD: tl.constexpr,
):
    query = tl.program_id(0)
    dim = tl.arange(0, DK_PAD)
    q = tl.load(q_ptr + query.to(tl.int64) * key_dim + dim, mask=dim < key_dim, other=0.0).to(tl.float32)
    q_sq = tl.sum(q * q, axis=0)
    running_max = tl.full([], _NO_LOGIT, tl.float32)
    total = tl.zeros([], dtype=tl.float32)
    read = tl.zeros([DV_PAD], dtype=tl.float32)
    for start in range(0, top_k, BLOCK_K):
        position = start + tl.arange(0, BLOCK_K)
        position_ok = position < top_k
        _, values, logits, _, _, _, _, _, _, _ = _slot_terms(
            q, q_sq, keys_ptr, values_ptr, occupied_ptr, chosen_ptr, query, position, position_ok,
            top_k, key_dim, value_dim, inv_tau, ball_margin, acosh_min, DK_PAD, DV_PAD,
        )
        new_max = tl.maximum(running_max, tl.max(logits, axis=0))
        rescale = tl.exp(running_max - new_max)
        weights = tl.exp(logits - new_max)  # (BLOCK_K,), 0 where not read
        total = total * rescale + tl.sum(weights, axis=0)
        read = read * rescale + tl.sum(weights[:, None] * values, axis=0)
        running_max = new_max
    # No readable slot (an empty bank): total is 0 and the read is 0.
    read = tl.where(total > 0, read / tl.where(total > 0, total, 1.0), 0.0)
    value_index = tl.arange(0, DV_PAD)
    tl.store(m_ptr + query.to(tl.int64) * value_dim + value_index, read, mask=value_index < value_dim)
    tl.store(log_total_ptr + query, running_max + tl.log(tl.where(total > 0, total, 1.0)))


@triton.jit
def _read_backward_kernel(
    q_ptr, keys_ptr, values_ptr, occupied_ptr, chosen_ptr, m_ptr, log_total_ptr, grad_m_ptr, grad_q_ptr,
    top_k, key_dim, value_dim, inv_tau, ball_margin, acosh_min,
    BLOCK_K: tl.constexpr, DK_PAD: tl.constexpr, DV_PAD: tl.constexpr,
):
    query = tl.program_id(0)
    dim = tl.arange(0, DK_PAD)
    value_index = tl.arange(0, DV_PAD)
    q = tl.load(q_ptr + query.to(tl.int64) * key_dim + dim, mask=dim < key_dim, other=0.0).to(tl.float32)
    q_sq = tl.sum(q * q, axis=0)
    value_offsets = query.to(tl.int64) * value_dim + value_index
    grad_m = tl.load(grad_m_ptr + value_offsets, mask=value_index < value_dim, other=0.0).to(tl.float32)
    read = tl.load(m_ptr + value_offsets, mask=value_index < value_dim, other=0.0).to(tl.float32)
    log_total = tl.load(log_total_ptr + query)
    # sum_j w_j (grad_m . v_j) = grad_m . m: the softmax's centring term without a second pass.
    centre = tl.sum(grad_m * read, axis=0)
    grad_q = tl.zeros([DK_PAD], dtype=tl.float32)
    for start in range(0, top_k, BLOCK_K):
        position = start + tl.arange(0, BLOCK_K)
        position_ok = position < top_k
        keys, values, logits, readable, gap, gap_raw, q_room, k_room, argument, argument_raw = _slot_terms(
            q, q_sq, keys_ptr, values_ptr, occupied_ptr, chosen_ptr, query, position, position_ok,
            top_k, key_dim, value_dim, inv_tau, ball_margin, acosh_min, DK_PAD, DV_PAD,
        )
        weights = tl.where(readable, tl.exp(logits - log_total), 0.0)  # (BLOCK_K,)
        grad_logits = weights * (tl.sum(values * grad_m[None, :], axis=1) - centre)
        grad_distance = -grad_logits * inv_tau
        # d arccosh(z)/dz, zero where the argument was clamped (as clamp's own gradient is).
        root = tl.sqrt(tl.where(argument_raw > acosh_min, argument * argument - 1.0, 1.0))
        grad_argument = tl.where(argument_raw > acosh_min, grad_distance / root, 0.0)
        # z = 1 + 2 gap / (q_room k_room): gap' = 2 (q - k) unless clamped at 0, q_room' = -2 q
        # unless held at the margin.
        grad_gap = tl.where(gap_raw > 0, grad_argument * 2.0 / (q_room * k_room), 0.0)
        q_room_free = 1.0 - q_sq > ball_margin
        grad_q_room = tl.sum(-grad_argument * 2.0 * gap / (q_room * q_room * k_room), axis=0)
        grad_q += 2.0 * tl.sum(grad_gap[:, None] * (q[None, :] - keys), axis=0)
        grad_q += tl.where(q_room_free, -2.0 * q * grad_q_room, 0.0)
    tl.store(grad_q_ptr + query.to(tl.int64) * key_dim + dim, grad_q, mask=dim < key_dim)


def _read_layout(key_dim: int, value_dim: int, top_k: int) -> dict[str, int]:
    return {
        "BLOCK_K": min(_READ_BLOCK_K, triton.next_power_of_2(top_k)),
        "DK_PAD": triton.next_power_of_2(key_dim),
        "DV_PAD": triton.next_power_of_2(value_dim),
    }


def _masked_distances(q: torch.Tensor, keys: torch.Tensor, occupied: torch.Tensor) -> torch.Tensor:
    """(Nq, S) fp32 distances from the Triton kernel, +inf at free slots (occupied as int8)."""
    queries, key_dim = q.shape
    slots = keys.shape[0]
    distance = new_buffer((queries, slots), torch.float32, q.device)
    if queries == 0 or slots == 0:
        return distance
    grid = (triton.cdiv(queries, _DIST_BLOCK_Q), triton.cdiv(slots, _DIST_BLOCK_S))
    _distance_kernel[grid](
        q, keys, occupied, distance, queries, slots, key_dim, BALL_MARGIN, ACOSH_MIN_ARG,
        BLOCK_Q=_DIST_BLOCK_Q, BLOCK_S=_DIST_BLOCK_S, DK_PAD=max(16, triton.next_power_of_2(key_dim)),
    )
    return distance


class _PoincareDenseRead(torch.autograd.Function):
    """The whole-bank read: Triton distances, then a softmax and weights @ values as matrix
    products (a per-query gather of every slot's value would re-read the bank Nq times)."""

    @staticmethod
    def forward(ctx, q, keys, values, occupied, tau):
        q32 = q.float().contiguous()
        keys = keys.detach().float().contiguous()
        values = values.detach().float().contiguous()
        logits = -_masked_distances(q32, keys, occupied.to(torch.int8).contiguous()) / tau  # (Nq, S)
        # An empty bank leaves every logit -inf: shift by 0 there so its weights are 0, not NaN.
        shift = logits.amax(-1, keepdim=True)
        shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
        unnormalised = torch.exp(logits - shift)
        total = unnormalised.sum(-1, keepdim=True)
        weights = unnormalised / torch.where(total > 0, total, torch.ones_like(total))  # (Nq, S)
        m = weights @ values  # (Nq, Dv)
        ctx.save_for_backward(q32, keys, values, weights, m)
        ctx.tau = tau
        return m.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_m):
        q, keys, values, weights, m = ctx.saved_tensors
        grad_m = grad_m.float()
        # Softmax backward: sum_j w_j (grad_m . v_j) is grad_m . m.
        grad_logits = weights * (grad_m @ values.T - (grad_m * m).sum(-1, keepdim=True))  # (Nq, S)
        grad_distance = -grad_logits / ctx.tau
        # The distance's derivative, with the clamps of `hyperbolic_distance` (see the kernel).
        q_sq = (q * q).sum(-1)  # (Nq,)
        k_sq = (keys * keys).sum(-1)  # (S,)
        gap_raw = q_sq[:, None] + k_sq[None, :] - 2 * q @ keys.T  # (Nq, S)
        gap = gap_raw.clamp_min(0)
        q_room = (1 - q_sq).clamp_min(BALL_MARGIN)
        k_room = (1 - k_sq).clamp_min(BALL_MARGIN)
        conformal = q_room[:, None] * k_room[None, :]
        argument_raw = 1 + 2 * gap / conformal
        argument = argument_raw.clamp_min(ACOSH_MIN_ARG)
        unclamped = argument_raw > ACOSH_MIN_ARG
        grad_argument = torch.where(unclamped, grad_distance / torch.sqrt(argument * argument - 1), 0.0)
        grad_gap = torch.where(gap_raw > 0, grad_argument * 2 / conformal, 0.0)
        grad_q_room = (-grad_argument * 2 * gap / (q_room[:, None] * conformal)).sum(-1)  # (Nq,)
        grad_q = 2 * (q * grad_gap.sum(-1, keepdim=True) - grad_gap @ keys)
        grad_q = grad_q + torch.where((1 - q_sq > BALL_MARGIN)[:, None], -2 * q * grad_q_room[:, None], 0.0)
        return grad_q, None, None, None, None


class _PoincareTopKRead(torch.autograd.Function):
    """The top-k read: Triton distances, torch.topk, then per query a Triton online-softmax read
    of the k chosen slots and its backward to q."""

    @staticmethod
    def forward(ctx, q, keys, values, occupied, tau, top_k):
        queries, key_dim = q.shape
        value_dim = values.shape[1]
        q = q.float().contiguous()
        keys = keys.detach().float().contiguous()
        values = values.detach().float().contiguous()
        occupied = occupied.to(torch.int8).contiguous()
        constants = (1.0 / tau, BALL_MARGIN, ACOSH_MIN_ARG)
        distance = _masked_distances(q, keys, occupied)  # (Nq, S)
        chosen = distance.topk(top_k, dim=-1, largest=False).indices.contiguous()  # (Nq, k)
        m = new_buffer((queries, value_dim), torch.float32, q.device)
        log_total = new_buffer((queries,), torch.float32, q.device)
        if queries > 0:
            _read_forward_kernel[(queries,)](
                q, keys, values, occupied, chosen, m, log_total,
                top_k, key_dim, value_dim, *constants, **_read_layout(key_dim, value_dim, top_k),
            )
        ctx.save_for_backward(q, keys, values, occupied, chosen, m, log_total)
        ctx.constants = constants
        ctx.top_k = top_k
        return m

    @staticmethod
    def backward(ctx, grad_m):
        q, keys, values, occupied, chosen, m, log_total = ctx.saved_tensors
        queries, key_dim = q.shape
        value_dim = values.shape[1]
        grad_q = new_buffer((queries, key_dim), torch.float32, q.device)
        if queries > 0:
            _read_backward_kernel[(queries,)](
                q, keys, values, occupied, chosen, m, log_total, grad_m.float().contiguous(), grad_q,
                ctx.top_k, key_dim, value_dim, *ctx.constants, **_read_layout(key_dim, value_dim, ctx.top_k),
            )
        return grad_q, None, None, None, None, None


def poincare_read(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    occupied: torch.Tensor,
    tau: float,
    top_k: int,
    *,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """The memory read (see the module docstring): Triton on CUDA, the reference elsewhere.

    use_triton: None picks Triton on CUDA; True forces it (off CUDA only under
    TRITON_INTERPRET=1); False forces the reference.
    """
    if wants_triton(q, use_triton):
        if 0 < top_k < keys.shape[0]:
            return _PoincareTopKRead.apply(q, keys, values, occupied, tau, top_k).to(q.dtype)
        return _PoincareDenseRead.apply(q, keys, values, occupied, tau)
    return poincare_read_reference(q, keys, values, occupied, tau, top_k)
