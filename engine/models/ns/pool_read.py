"""The hippocampal pool read: attention biased by write tags and pool clocks.

    w_ts = softmax_s( q_t . k_s / sqrt(d) + log g_s - lambda_h (c_t - c_s) )   over s <= t

g_s in (0, 1) is the write tag of key s (how strongly token s entered the pool), c the head's
monotone pool clock and lambda_h > 0 its rate. The term -lambda_h c_t is the same for every key
of a query's row and cancels in the softmax, so the read is attention with a per-key bias
log g_s + lambda_h c_s.

Three paths compute it over a row: the explicit biased softmax (CPU, and the definition: it
evaluates the difference c_t - c_s itself); on CUDA the flash kernel kernels/pool_attention.py
with the per-key bias (its backward sums d_bias over queries inside the program that owns the
key, without atomics, so NS gradients repeat bit for bit and a resumed GPU line repeats an
uninterrupted one); and `torch.nn.attention.flex_attention` with the bias as a score_mod, kept as
an independent CUDA implementation that a test and bench/pool_attention.py hold the kernel
against (flex's backward adds the bias gradient with atomics: not bitwise repeatable, and 14.9
ms fwd+bwd on the H200 at B 8, H 20, T 4096, d 128 against SDPA flash's 4.9 ms without a bias;
it has no backward on CPU in torch 2.13). A decoder reads through `PoolCache`, the explicit path
over the tokens seen so far.
The bias is one fp32 tensor indexed by the key alone: a score_mod that reads tensors needing
gradients makes flex's backward accumulate their gradients with atomic adds, one per score, and
a tensor indexed by the head alone (the rate) or by the query (its clock) puts thousands of
those on one address -- measured on the H200 (B 8, H 20, T 4096, d 128): 2.4 s fwd+bwd with
the rate and both clocks read in the score_mod, against SDPA flash's 6.4 ms without a bias.
In fp32 the bias keeps the clocks' precision (lambda c_s of a few hundred leaves 1e-5 of a
logit), which a bias carried in bf16 q / k dimensions would not; the kernel keeps it in fp32.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.models.base import register_shared_cache
from kernels.pool_attention import pool_attention

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask


def read_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    log_tag: torch.Tensor,
    clock: torch.Tensor,
    rate: torch.Tensor,
    query_start: int = 0,
) -> torch.Tensor:
    """The read weights of the queries at positions query_start .. query_start + Tq - 1.

    q (Bt, Ha, Tq, d); k (Bt, Ha, T, d); log_tag, clock (Bt, Ha, T); rate (Ha,).
    Returns (Bt, Ha, Tq, T) float32 (float64 for float64 inputs), zero above the causal diagonal.
    """
    query_len, key_len, head_dim = q.shape[2], k.shape[2], q.shape[3]
    dtype = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q, k.transpose(-1, -2)).to(dtype) / math.sqrt(head_dim)  # (Bt, Ha, Tq, T)
    query_clock = clock[:, :, query_start : query_start + query_len].to(dtype)  # (Bt, Ha, Tq)
    elapsed = query_clock.unsqueeze(-1) - clock.to(dtype).unsqueeze(-2)  # (Bt, Ha, Tq, T): c_t - c_s
    scores = scores + log_tag.to(dtype).unsqueeze(-2) - rate.to(dtype).view(-1, 1, 1) * elapsed
    query_pos = torch.arange(query_start, query_start + query_len, device=q.device).unsqueeze(-1)
    future = torch.arange(key_len, device=q.device) > query_pos  # (Tq, T)
    return torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)


def pool_read_explicit(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_tag: torch.Tensor,
    clock: torch.Tensor,
    rate: torch.Tensor,
) -> torch.Tensor:
    """q, k, v (Bt, Ha, T, d); log_tag, clock (Bt, Ha, T); rate (Ha,) -> (Bt, Ha, T, d) in v's dtype."""
    weights = read_weights(q, k, log_tag, clock, rate)  # (Bt, Ha, T, T)
    return torch.matmul(weights.to(v.dtype), v)


class PoolCache:
    """A decoder's pool: the keys (after RoPE), values, log write tags and clocks of every token one
    hippocampal layer has seen, (Bt, Ha, n, d) and (Bt, Ha, n), so that new tokens read over them
    without recomputing them (a KV cache: a token's read costs O(n)).

    The per-key bias log g_s + lambda_h c_s is formed at each read relative to the reading query's
    clock, as `read_weights` forms it (log g_s - lambda_h (c_t - c_s)): the cache keeps the clocks,
    not biases that grow with them, so the read is the explicit path's arithmetic whatever the
    cache's length. The buffers double when full, so a decoded token writes its entries in place;
    each takes the dtype of its first entries (bf16 keys and values under autocast, fp32 clocks).
    """

    def __init__(self) -> None:
        self.length = 0
        self._buffers: tuple[torch.Tensor, ...] = ()

    def append(self, *pieces: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Add the new tokens' keys, values, log tags and clocks (positions along dim 2); returns every
        cached one, these included."""
        start, end = self.length, self.length + pieces[0].shape[2]
        if not self._buffers or end > self._buffers[0].shape[2]:
            capacity = max(end, 2 * start)
            grown = tuple(piece.new_empty(*piece.shape[:2], capacity, *piece.shape[3:]) for piece in pieces)
            for new, old in zip(grown, self._buffers):
                new[:, :, :start] = old[:, :, :start]
            self._buffers = grown
        for buffer, piece in zip(self._buffers, pieces):
            buffer[:, :, start:end] = piece
        self.length = end
        return tuple(buffer[:, :, :end] for buffer in self._buffers)

    def read(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        log_tag: torch.Tensor,
        clock: torch.Tensor,
        rate: torch.Tensor,
    ) -> torch.Tensor:
        """The read of T tokens that follow the cached ones, which join the cache: q, k, v (Bt, Ha, T, d),
        log_tag and clock (Bt, Ha, T) on the cached clocks' scale, rate (Ha,) -> (Bt, Ha, T, d) in v's
        dtype, as `pool_read_explicit` computes it over the whole sequence."""
        start = self.length
        keys, values, log_tags, clocks = self.append(k, v, log_tag, clock)
        weights = read_weights(q, keys, log_tags, clocks, rate, query_start=start)  # (Bt, Ha, T, n)
        return torch.matmul(weights.to(values.dtype), values)


@functools.cache  # never evicted: a captured graph reads its mask (emptied with the graphs)
def _causal_block_mask(length: int, device: torch.device) -> BlockMask:
    from torch.nn.attention.flex_attention import create_block_mask

    def causal(batch, head, q_idx, kv_idx):
        return kv_idx <= q_idx

    return create_block_mask(causal, B=None, H=None, Q_LEN=length, KV_LEN=length, device=device)


register_shared_cache(_causal_block_mask.cache_clear)


def _biased_flex_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_bias: torch.Tensor, block_mask: BlockMask
) -> torch.Tensor:
    """flex_attention with a per-key bias; compiled whole (see `_compiled_read`)."""
    from torch.nn.attention.flex_attention import flex_attention

    def score_mod(score, batch, head, q_idx, kv_idx):
        return score + key_bias[batch, head, kv_idx]

    return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)


@functools.cache
def _compiled_read() -> Callable[..., torch.Tensor]:
    # Compiled, flex_attention is a fused kernel (uncompiled it materialises the scores). The
    # score_mod is made inside the compiled function: a fresh closure handed to a compiled
    # flex_attention at every call would make it recompile at every call.
    return torch.compile(_biased_flex_attention, dynamic=False)


def pool_read_flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_tag: torch.Tensor,
    clock: torch.Tensor,
    rate: torch.Tensor,
) -> torch.Tensor:
    """The same read through flex_attention (CUDA); same shapes as `pool_read_explicit`."""
    block_mask = _causal_block_mask(q.shape[2], q.device)
    return _compiled_read()(q, k, v, per_key_bias(log_tag, clock, rate), block_mask)


def per_key_bias(log_tag: torch.Tensor, clock: torch.Tensor, rate: torch.Tensor) -> torch.Tensor:
    """log_tag, clock (Bt, Ha, T); rate (Ha,) -> (Bt, Ha, T) fp32: log g_s + lambda_h (c_s - c_last).

    -lambda_h c_t cancels in each query's softmax: what is left is a bias of the key alone. So
    does any clock shift per row: clocks taken from the row's last (detached) keep the recent
    keys' bias small and precise, and rate's gradient sum_s dbias_s (c_s - c_last) free of the
    cancellation that large absolute clocks would bring.
    """
    clock = clock.float()
    elapsed = clock - clock[..., -1:].detach()  # <= 0
    return (log_tag.float() + rate.float().view(1, -1, 1) * elapsed).contiguous()


def pool_read_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_tag: torch.Tensor,
    clock: torch.Tensor,
    rate: torch.Tensor,
) -> torch.Tensor:
    """The same read through the flash kernel with a per-key bias (CUDA; off CUDA only under
    TRITON_INTERPRET=1). Same shapes as `pool_read_explicit`; the result is laid out (Bt, T, Ha, d)
    underneath, so the layer's transpose to (Bt, T, Ha x d) is a view."""
    out, _ = pool_attention(q, k, v, per_key_bias(log_tag, clock, rate), use_triton=True)
    return out


def pool_read(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_tag: torch.Tensor,
    clock: torch.Tensor,
    rate: torch.Tensor,
) -> torch.Tensor:
    """The flash kernel on CUDA, the explicit biased softmax elsewhere."""
    read = pool_read_kernel if q.is_cuda else pool_read_explicit
    return read(q, k, v, log_tag, clock, rate)
