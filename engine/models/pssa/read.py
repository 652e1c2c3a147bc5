"""The memory read's top-k path on the CPU: choose the k nearest slots, then read only those.

`kernels.poincare.poincare_read_reference` (the definition) weighs every slot of the bank: a
(queries x slots) distance matrix under autograd and a dense (queries x slots) @ (slots x d)
product whose weights are zero but for k slots a row. Here the choice is made without autograd
on the same distance argument the reference ranks by (arccosh is increasing, so the order is
the distance's), and the distances, softmax and weighted sum are formed for the k chosen slots
only: (queries x k) work under autograd instead of (queries x slots). The ranking's
(queries x slots) arithmetic runs in place on one buffer (the reference's operations in its
order, so the same numbers), and the weighted sum of the chosen values is one `embedding_bag`,
which never gathers the (queries x k x d) values. Where the host's compiler builds it, the same
read runs as C loops instead (`native_memory`: one pass per query, forward and backward). Both
are the same function (tests hold them to the reference in float64); on CUDA the Triton kernel
runs instead.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

from engine.models.pssa import native_memory
from kernels._dispatch import compute_dtype
from kernels.poincare import ACOSH_MIN_ARG, BALL_MARGIN


def _acosh_argument(query_sq: torch.Tensor, key_sq: torch.Tensor, gap_sq: torch.Tensor) -> torch.Tensor:
    """`1 + 2 |q - k|^2 / ((1 - |q|^2)(1 - |k|^2))`, clamped as the reference clamps it;
    query_sq broadcasts against key_sq and gap_sq."""
    conformal = (1 - query_sq).clamp_min(BALL_MARGIN) * (1 - key_sq).clamp_min(BALL_MARGIN)
    return (1 + 2 * gap_sq.clamp_min(0) / conformal).clamp_min(ACOSH_MIN_ARG)


@torch.no_grad()
def _nearest(
    queries: torch.Tensor, query_sq: torch.Tensor, keys: torch.Tensor, occupied: torch.Tensor, top_k: int
) -> torch.Tensor:
    """(Nq, k) indices of the top_k occupied slots nearest each query (any slots when fewer are
    occupied): `_acosh_argument`'s arithmetic in place on one (Nq, S) buffer."""
    key_sq = (keys * keys).sum(-1)  # (S,)
    ranking = torch.add(query_sq[:, None], key_sq[None, :])  # |q|^2 + |k|^2
    ranking.sub_(torch.mm(queries, keys.T).mul_(2)).clamp_min_(0)  # |q - k|^2
    conformal = torch.mul((1 - query_sq).clamp_min(BALL_MARGIN)[:, None],
                          (1 - key_sq).clamp_min(BALL_MARGIN)[None, :])  # fmt: skip
    ranking.mul_(2).div_(conformal).add_(1).clamp_min_(ACOSH_MIN_ARG)
    ranking.masked_fill_(~occupied[None, :], float("inf"))
    return ranking.topk(top_k, dim=-1, largest=False).indices


def topk_read(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, occupied: torch.Tensor, tau: float, top_k: int
) -> torch.Tensor:
    """q (Nq, Dk) in the ball; keys (S, Dk); values (S, Dv); occupied (S,) bool; 0 < top_k < S
    -> (Nq, Dv) in q's dtype: softmax(-d_H / tau) over the top_k nearest occupied slots, zeros
    for a row with none. Gradient flows to q only (the bank is detached state). The native read
    where it is built, else `torch_topk_read`."""
    if native_memory.library() is not None:
        return _NativeRead.apply(q, keys, values, occupied, tau, top_k)
    return torch_topk_read(q, keys, values, occupied, tau, top_k)


class _NativeRead(torch.autograd.Function):
    """`topk_read` by `native_memory`'s C loops; saves the choice and weights, (Nq, k) each."""

    @staticmethod
    def forward(ctx: Any, q, keys, values, occupied, tau, top_k):  # noqa: ANN001, ANN205 (autograd's signature)
        wide = compute_dtype(q, keys, values)
        tensors = [t.detach().to(wide).contiguous() for t in (q, keys, values)]
        lib = native_memory.library()
        m, chosen, weights, key_sq = native_memory.read_forward(
            lib, *tensors, occupied.to(torch.bool).contiguous(), tau, top_k, BALL_MARGIN, ACOSH_MIN_ARG
        )
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(*tensors, chosen, weights, key_sq)
        ctx.tau, ctx.q_dtype = tau, q.dtype
        return m.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad_m: torch.Tensor):  # noqa: ANN205
        saved = ctx.saved_tensors
        grad = grad_m.to(saved[0].dtype).contiguous()
        grad_q = native_memory.read_backward(native_memory.library(), saved, grad, ctx.tau, BALL_MARGIN, ACOSH_MIN_ARG)
        return grad_q.to(ctx.q_dtype), None, None, None, None, None


def torch_topk_read(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, occupied: torch.Tensor, tau: float, top_k: int
) -> torch.Tensor:
    """`topk_read` in PyTorch operations (the module docstring)."""
    wide = compute_dtype(q, keys, values)
    queries = q.to(wide)
    keys_c, values_c = keys.detach().to(wide), values.detach().to(wide)
    occupied = occupied.to(torch.bool)
    query_sq = (queries * queries).sum(-1)  # (Nq,)
    chosen = _nearest(queries.detach(), query_sq.detach(), keys_c, occupied, top_k)  # (Nq, k)
    picked_keys = keys_c[chosen]  # (Nq, k, Dk)
    picked_sq = (picked_keys * picked_keys).sum(-1)  # (Nq, k)
    dots = torch.bmm(picked_keys, queries.unsqueeze(-1)).squeeze(-1)  # (Nq, k)
    distance = torch.acosh(_acosh_argument(query_sq[:, None], picked_sq, query_sq[:, None] + picked_sq - 2 * dots))
    valid = occupied[chosen]  # (Nq, k): fewer than k occupied slots leave some out
    logits = (-distance / tau).masked_fill(~valid, float("-inf"))
    # Rows with nothing valid (an empty bank) have max -inf: shift by 0 so they give weight 0.
    shift = logits.detach().amax(-1, keepdim=True)
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    unnormalised = torch.exp(logits - shift)  # (Nq, k)
    total = unnormalised.sum(-1, keepdim=True)
    weights = unnormalised / torch.where(total > 0, total, torch.ones_like(total))
    return F.embedding_bag(chosen, values_c, mode="sum", per_sample_weights=weights).to(q.dtype)  # (Nq, Dv)
