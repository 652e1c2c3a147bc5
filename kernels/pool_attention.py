"""Causal attention with a per-key additive bias: the NS pool read as a flash kernel.

    s_ts = q_t . k_s / sqrt(d) + bias_s        p_ts = softmax_s(s_ts) over s <= t
    o_t  = sum_s p_ts v_s                       lse_t = log sum_{s<=t} exp(s_ts)

q, k, v (B, H, T, d) in bf16, fp16 or fp32 (fp64 for tests); bias (B, H, T) per key, kept in fp32
(fp64 for fp64 inputs) all the way: the NS bias log g_s + lambda_h (c_s - c_last) reaches
hundreds, and bf16 would round it by more than a logit. Scores, the online softmax and every
accumulator are fp32 (fp64 for fp64 inputs); the softmax runs in base 2 (exp2), the scale and
the bias folded into log2 e once.

Forward: one program a block of queries walks the keys up to its diagonal (flash attention's
online softmax), the blocks left of the diagonal unmasked, the diagonal ones masked, and saves
the row log-sum-exp. Backward, without atomics, so that the same inputs give the same bits on
every call (a resumed GPU line then repeats an uninterrupted one):
- a key-block program walks the query blocks from its diagonal to the end and owns dK, dV and
  d_bias_s = sum_t dS_ts (a sum over queries: no other program touches its keys);
- a query-block program walks the key blocks up to its diagonal and owns dQ, recomputing the
  scores and dP that the key-block programs also formed (7 block matmuls a block pair against
  flash attention's 5 with an atomic dQ: the price of determinism by construction).
Each sum runs in a fixed order set by the block sizes, which are a fixed table (`_blocks`), never
autotuned: a tuner picking by timing could choose other blocks in another process, and other
blocks sum in another order. The heaviest programs launch first (the last query blocks, the
first key blocks), so the causal triangle's long rows do not finish alone at the end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._dispatch import compute_dtype, new_buffer, wants_triton

_LOG2_E = 1.4426950408889634
_LN_2 = 0.6931471805599453
_FP_FUSION = True
"""Scores as one FMA (q.k x scale + bias). Named at every launch: Triton 3.10 flips the default,
which would change the kernels' bits under a new Triton."""


@dataclass(frozen=True)
class Blocks:
    """Tile shapes and launch settings of the three kernels (see `_blocks`)."""

    forward: tuple[int, int, int, int]
    """(BLOCK_M queries, BLOCK_N keys, num_warps, num_stages) of the forward."""
    key_side: tuple[int, int, int, int]
    """(BLOCK_M queries, BLOCK_N keys, num_warps, num_stages) of the dK / dV / d_bias program
    (a program owns BLOCK_N keys; BLOCK_N must be a multiple of BLOCK_M)."""
    query_side: tuple[int, int, int, int]
    """(BLOCK_M queries, BLOCK_N keys, num_warps, num_stages) of the dQ program (BLOCK_M a
    multiple of BLOCK_N, as in the forward)."""


def _blocks(head_dim_pad: int, element_size: int) -> Blocks:
    """The tiles for a padded head width and an input element size. Fixed, never timed at run
    time (module docstring). 2-byte inputs take flash attention's usual forward (128 queries x 64
    keys) and the largest backward tiles that compile for sm_90 without spilling registers
    (Triton 3.9's ptxas, `bench/sass_report.py`'s compile: the key side at 64 x 128 keys spills,
    at 32 x 128 it holds dK and dV of 128 keys in 232 registers; the query side 216);
    `python bench/pool_attention.py --sweep` times the alternatives on the H200 (2026-12-02: the key
    side with 3 stages gave 8.01 against 8.91 ms forward + backward with 2, the best of 15). 4-byte inputs
    (fp32 checks and runs, matmuls in IEEE fp32, off the tensor cores) take small tiles so that
    the staged tiles fit the shared memory."""
    if element_size >= 4 or head_dim_pad > 128:
        return Blocks((64, 32, 4, 2), (32, 64, 4, 2), (64, 32, 4, 2))
    if head_dim_pad == 128:
        return Blocks((128, 64, 8, 3), (32, 128, 8, 3), (128, 64, 8, 3))
    return Blocks((128, 64, 4, 3), (32, 128, 8, 2), (128, 64, 8, 3))


def pool_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The explicit masked softmax in plain PyTorch autograd (the definition the kernel is tested
    against). q, k, v (B, H, T, d); bias (B, H, T). Returns o (B, H, T, d) in v's dtype and lse
    (B, H, T) in fp32 (fp64 for fp64 inputs)."""
    _check_shapes(q, k, v, bias)
    dtype = compute_dtype(q, k, v, bias)
    length, head_dim = q.shape[2], q.shape[3]
    scores = torch.matmul(q.to(dtype), k.to(dtype).transpose(-1, -2)) / math.sqrt(head_dim)  # (B, H, T, T)
    scores = scores + bias.to(dtype).unsqueeze(-2)
    future = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)  # key after query
    scores = scores.masked_fill(future, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, H, T)
    weights = torch.exp(scores - lse.unsqueeze(-1))
    return torch.matmul(weights, v.to(dtype)).to(v.dtype), lse


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> None:
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            f"pool_attention: q, k, v must share one (B, H, T, d) shape, got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if bias.shape != q.shape[:3]:
        raise ValueError(f"pool_attention: bias must be (B, H, T) = {tuple(q.shape[:3])}, got {tuple(bias.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"pool_attention: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


@triton.jit
def _forward_inner(
    acc, l_i, m_i, q, k_base, v_base, bias_base, sk_t, sv_t, rows, start, stop, seq_len, qk_scale,
    offs_n, offs_d, d_ok,
    MASKED: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    """Keys start .. stop - 1 into the online softmax of one query block. MASKED: the diagonal
    blocks (causal mask, and keys past T on a ragged row); unmasked blocks lie left of the
    diagonal, every key real and before every query."""
    for start_n in range(start, stop, BLOCK_N):
        cols = start_n + offs_n
        if MASKED:
            key_ok = cols < seq_len
            tile_ok = key_ok[:, None] & d_ok[None, :]
            k = tl.load(k_base + cols[:, None] * sk_t + offs_d[None, :], mask=tile_ok, other=0.0)
            v = tl.load(v_base + cols[:, None] * sv_t + offs_d[None, :], mask=tile_ok, other=0.0)
            bias = tl.load(bias_base + cols, mask=key_ok, other=0.0)
        elif EVEN_D:
            k = tl.load(k_base + cols[:, None] * sk_t + offs_d[None, :])
            v = tl.load(v_base + cols[:, None] * sv_t + offs_d[None, :])
            bias = tl.load(bias_base + cols)
        else:
            k = tl.load(k_base + cols[:, None] * sk_t + offs_d[None, :], mask=d_ok[None, :], other=0.0)
            v = tl.load(v_base + cols[:, None] * sv_t + offs_d[None, :], mask=d_ok[None, :], other=0.0)
            bias = tl.load(bias_base + cols)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale + bias[None, :] * 1.4426950408889634
        if MASKED:
            s = tl.where(rows[:, None] >= cols[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _forward_kernel(
    q_ptr, k_ptr, v_ptr, bias_ptr, o_ptr, lse_ptr,
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, so_b, so_h, so_t,
    heads, seq_len, head_dim, qk_scale,
    D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_T: tl.constexpr,
    EVEN_D: tl.constexpr, PRECISION: tl.constexpr,
):
    """One block of BLOCK_M queries of one (batch, head); lse is stored in base 2 (log2 sum 2^s2)."""
    bh = tl.program_id(0)
    start_m = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M  # the longest rows first
    batch, head = bh // heads, bh % heads
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < head_dim
    row_ok = rows < seq_len
    q_base = q_ptr + batch.to(tl.int64) * sq_b + head.to(tl.int64) * sq_h
    k_base = k_ptr + batch.to(tl.int64) * sk_b + head.to(tl.int64) * sk_h
    v_base = v_ptr + batch.to(tl.int64) * sv_b + head.to(tl.int64) * sv_h
    o_base = o_ptr + batch.to(tl.int64) * so_b + head.to(tl.int64) * so_h
    bias_base = bias_ptr + bh.to(tl.int64) * seq_len
    q_offsets = rows[:, None] * sq_t + offs_d[None, :]
    if EVEN_T and EVEN_D:
        q = tl.load(q_base + q_offsets)
    else:
        q = tl.load(q_base + q_offsets, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=bias_ptr.dtype.element_ty)
    l_i = tl.zeros([BLOCK_M], dtype=bias_ptr.dtype.element_ty)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=bias_ptr.dtype.element_ty)
    acc, l_i, m_i = _forward_inner(
        acc, l_i, m_i, q, k_base, v_base, bias_base, sk_t, sv_t, rows, 0, start_m, seq_len, qk_scale,
        offs_n, offs_d, d_ok, False, EVEN_D, BLOCK_N, PRECISION)
    acc, l_i, m_i = _forward_inner(
        acc, l_i, m_i, q, k_base, v_base, bias_base, sk_t, sv_t, rows, start_m, start_m + BLOCK_M, seq_len,
        qk_scale, offs_n, offs_d, d_ok, True, EVEN_D, BLOCK_N, PRECISION)
    out = acc / l_i[:, None]
    o_offsets = rows[:, None] * so_t + offs_d[None, :]
    lse_base = lse_ptr + bh.to(tl.int64) * seq_len
    if EVEN_T and EVEN_D:
        tl.store(o_base + o_offsets, out.to(o_ptr.dtype.element_ty))
        tl.store(lse_base + rows, m_i + tl.math.log2(l_i))
    else:
        tl.store(o_base + o_offsets, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        tl.store(lse_base + rows, m_i + tl.math.log2(l_i), mask=row_ok)


@triton.jit
def _delta_kernel(
    o_ptr, do_ptr, dlse_ptr, delta_ptr, so_b, so_h, so_t, sdo_b, sdo_h, sdo_t,
    heads, seq_len, head_dim,
    HAS_DLSE: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr,
):
    """delta_t = sum_d o_td do_td - dlse_t: what each row's dS subtracts (dS = P (dP - delta))."""
    bh = tl.program_id(0)
    batch, head = bh // heads, bh % heads
    rows = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, D_PAD)
    row_ok = rows < seq_len
    mask = row_ok[:, None] & (offs_d < head_dim)[None, :]
    o = tl.load(o_ptr + batch.to(tl.int64) * so_b + head.to(tl.int64) * so_h + rows[:, None] * so_t + offs_d[None, :],
                mask=mask, other=0.0)
    do = tl.load(do_ptr + batch.to(tl.int64) * sdo_b + head.to(tl.int64) * sdo_h + rows[:, None] * sdo_t
                 + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(delta_ptr.dtype.element_ty) * do.to(delta_ptr.dtype.element_ty), 1)
    if HAS_DLSE:
        delta -= tl.load(dlse_ptr + bh.to(tl.int64) * seq_len + rows, mask=row_ok, other=0.0)
    tl.store(delta_ptr + bh.to(tl.int64) * seq_len + rows, delta, mask=row_ok)


@triton.jit
def _key_side_inner(
    dk, dv, dbias, k, v, bias2, cols, q_base, do_base, lse_base, delta_base, sq_t, sdo_t,
    start, stop, seq_len, qk_scale, offs_m, offs_d, d_ok,
    MASKED: tl.constexpr, EVEN_T: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Query blocks start .. stop - 1 into one key block's dK, dV and d_bias (transposed tiles:
    keys along the rows). MASKED: the diagonal blocks."""
    for start_m in range(start, stop, BLOCK_M):
        rows = start_m + offs_m
        if EVEN_T and EVEN_D:
            q = tl.load(q_base + rows[:, None] * sq_t + offs_d[None, :])
            do = tl.load(do_base + rows[:, None] * sdo_t + offs_d[None, :])
        else:
            tile_ok = (rows < seq_len)[:, None] & d_ok[None, :]
            q = tl.load(q_base + rows[:, None] * sq_t + offs_d[None, :], mask=tile_ok, other=0.0)
            do = tl.load(do_base + rows[:, None] * sdo_t + offs_d[None, :], mask=tile_ok, other=0.0)
        if EVEN_T:
            lse = tl.load(lse_base + rows)
            delta = tl.load(delta_base + rows)
        else:  # a row past T has lse +inf: its probabilities are 0
            lse = tl.load(lse_base + rows, mask=rows < seq_len, other=float("inf"))
            delta = tl.load(delta_base + rows, mask=rows < seq_len, other=0.0)
        s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale + bias2[:, None]  # (BLOCK_N, BLOCK_M)
        if MASKED:
            s_t = tl.where(rows[None, :] >= cols[:, None], s_t, float("-inf"))
        p_t = tl.math.exp2(s_t - lse[None, :])
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dbias += tl.sum(ds_t, 1)
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=PRECISION)
    return dk, dv, dbias


@triton.jit
def _key_side_kernel(
    q_ptr, k_ptr, v_ptr, bias_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, dbias_ptr,
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sdo_b, sdo_h, sdo_t,
    heads, seq_len, head_dim, qk_scale, sm_scale,
    D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_T: tl.constexpr,
    EVEN_D: tl.constexpr, PRECISION: tl.constexpr,
):
    """dK, dV (B, H, T, d contiguous) and d_bias (B, H, T) of one block of BLOCK_N keys: the
    diagonal query blocks masked, then every later one (a sum over queries in a fixed order)."""
    bh = tl.program_id(0)
    start_n = tl.program_id(1) * BLOCK_N  # the first key blocks have the most queries: launched first
    batch, head = bh // heads, bh % heads
    cols = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < head_dim
    key_ok = cols < seq_len
    tile_ok = key_ok[:, None] & d_ok[None, :]
    k_base = k_ptr + batch.to(tl.int64) * sk_b + head.to(tl.int64) * sk_h
    v_base = v_ptr + batch.to(tl.int64) * sv_b + head.to(tl.int64) * sv_h
    q_base = q_ptr + batch.to(tl.int64) * sq_b + head.to(tl.int64) * sq_h
    do_base = do_ptr + batch.to(tl.int64) * sdo_b + head.to(tl.int64) * sdo_h
    row_base = bh.to(tl.int64) * seq_len
    k = tl.load(k_base + cols[:, None] * sk_t + offs_d[None, :], mask=tile_ok, other=0.0)
    v = tl.load(v_base + cols[:, None] * sv_t + offs_d[None, :], mask=tile_ok, other=0.0)
    bias2 = tl.load(bias_ptr + row_base + cols, mask=key_ok, other=0.0) * 1.4426950408889634
    dk = tl.zeros([BLOCK_N, D_PAD], dtype=bias_ptr.dtype.element_ty)
    dv = tl.zeros([BLOCK_N, D_PAD], dtype=bias_ptr.dtype.element_ty)
    dbias = tl.zeros([BLOCK_N], dtype=bias_ptr.dtype.element_ty)
    lse_base, delta_base = lse_ptr + row_base, delta_ptr + row_base
    dk, dv, dbias = _key_side_inner(
        dk, dv, dbias, k, v, bias2, cols, q_base, do_base, lse_base, delta_base, sq_t, sdo_t,
        start_n, start_n + BLOCK_N, seq_len, qk_scale, offs_m, offs_d, d_ok, True, EVEN_T, EVEN_D, BLOCK_M,
        PRECISION)
    dk, dv, dbias = _key_side_inner(
        dk, dv, dbias, k, v, bias2, cols, q_base, do_base, lse_base, delta_base, sq_t, sdo_t,
        start_n + BLOCK_N, seq_len, seq_len, qk_scale, offs_m, offs_d, d_ok, False, EVEN_T, EVEN_D, BLOCK_M,
        PRECISION)
    out_offsets = row_base * head_dim + cols[:, None] * head_dim + offs_d[None, :]
    tl.store(dk_ptr + out_offsets, (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=tile_ok)
    tl.store(dv_ptr + out_offsets, dv.to(dv_ptr.dtype.element_ty), mask=tile_ok)
    tl.store(dbias_ptr + row_base + cols, dbias, mask=key_ok)


@triton.jit
def _query_side_inner(
    dq, q, do, lse, delta, rows, k_base, v_base, bias_base, sk_t, sv_t, start, stop, seq_len, qk_scale,
    offs_n, offs_d, d_ok,
    MASKED: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    """Key blocks start .. stop - 1 into one query block's dQ. MASKED: the diagonal blocks."""
    for start_n in range(start, stop, BLOCK_N):
        cols = start_n + offs_n
        if MASKED:
            key_ok = cols < seq_len
            tile_ok = key_ok[:, None] & d_ok[None, :]
            k = tl.load(k_base + cols[:, None] * sk_t + offs_d[None, :], mask=tile_ok, other=0.0)
            v = tl.load(v_base + cols[:, None] * sv_t + offs_d[None, :], mask=tile_ok, other=0.0)
            bias = tl.load(bias_base + cols, mask=key_ok, other=0.0)
        elif EVEN_D:
            k = tl.load(k_base + cols[:, None] * sk_t + offs_d[None, :])
            v = tl.load(v_base + cols[:, None] * sv_t + offs_d[None, :])
            bias = tl.load(bias_base + cols)
        else:
            k = tl.load(k_base + cols[:, None] * sk_t + offs_d[None, :], mask=d_ok[None, :], other=0.0)
            v = tl.load(v_base + cols[:, None] * sv_t + offs_d[None, :], mask=d_ok[None, :], other=0.0)
            bias = tl.load(bias_base + cols)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale + bias[None, :] * 1.4426950408889634
        if MASKED:
            s = tl.where(rows[:, None] >= cols[None, :], s, float("-inf"))
        p = tl.math.exp2(s - lse[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    return dq


@triton.jit
def _query_side_kernel(
    q_ptr, k_ptr, v_ptr, bias_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sdo_b, sdo_h, sdo_t,
    heads, seq_len, head_dim, qk_scale, sm_scale,
    D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_T: tl.constexpr,
    EVEN_D: tl.constexpr, PRECISION: tl.constexpr,
):
    """dQ (B, H, T, d contiguous) of one block of BLOCK_M queries: the key blocks left of the
    diagonal unmasked, then the diagonal ones (a sum over keys in a fixed order)."""
    bh = tl.program_id(0)
    start_m = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M  # the longest rows first
    batch, head = bh // heads, bh % heads
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < head_dim
    row_ok = rows < seq_len
    tile_ok = row_ok[:, None] & d_ok[None, :]
    row_base = bh.to(tl.int64) * seq_len
    q_base = q_ptr + batch.to(tl.int64) * sq_b + head.to(tl.int64) * sq_h
    do_base = do_ptr + batch.to(tl.int64) * sdo_b + head.to(tl.int64) * sdo_h
    if EVEN_T and EVEN_D:
        q = tl.load(q_base + rows[:, None] * sq_t + offs_d[None, :])
        do = tl.load(do_base + rows[:, None] * sdo_t + offs_d[None, :])
    else:
        q = tl.load(q_base + rows[:, None] * sq_t + offs_d[None, :], mask=tile_ok, other=0.0)
        do = tl.load(do_base + rows[:, None] * sdo_t + offs_d[None, :], mask=tile_ok, other=0.0)
    lse = tl.load(lse_ptr + row_base + rows, mask=row_ok, other=float("inf"))
    delta = tl.load(delta_ptr + row_base + rows, mask=row_ok, other=0.0)
    k_base = k_ptr + batch.to(tl.int64) * sk_b + head.to(tl.int64) * sk_h
    v_base = v_ptr + batch.to(tl.int64) * sv_b + head.to(tl.int64) * sv_h
    bias_base = bias_ptr + row_base
    dq = tl.zeros([BLOCK_M, D_PAD], dtype=bias_ptr.dtype.element_ty)
    dq = _query_side_inner(
        dq, q, do, lse, delta, rows, k_base, v_base, bias_base, sk_t, sv_t, 0, start_m, seq_len, qk_scale,
        offs_n, offs_d, d_ok, False, EVEN_D, BLOCK_N, PRECISION)
    dq = _query_side_inner(
        dq, q, do, lse, delta, rows, k_base, v_base, bias_base, sk_t, sv_t, start_m, start_m + BLOCK_M, seq_len,
        qk_scale, offs_n, offs_d, d_ok, True, EVEN_D, BLOCK_N, PRECISION)
    tl.store(dq_ptr + row_base * head_dim + rows[:, None] * head_dim + offs_d[None, :],
             (dq * sm_scale).to(dq_ptr.dtype.element_ty), mask=tile_ok)


def _last_dim_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """The kernels take any batch, head and time strides (q, k, v are views of one qkv projection)
    but need the head dimension contiguous."""
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def _bht_strides(tensor: torch.Tensor) -> tuple[int, int, int]:
    return tensor.stride(0), tensor.stride(1), tensor.stride(2)


def _launch_settings(q: torch.Tensor) -> tuple[int, Blocks, str]:
    """The padded head width (a power of two, at least 16: tl.dot's smallest), the tiles, and the
    matmul precision: IEEE for fp32 inputs (no TF32 rounding of the scores)."""
    head_dim_pad = max(16, triton.next_power_of_2(q.shape[3]))
    precision = "tf32" if q.dtype in (torch.bfloat16, torch.float16) else "ieee"
    return head_dim_pad, _blocks(head_dim_pad, q.element_size()), precision


def _even(seq_len: int, *sizes: int) -> bool:
    return all(seq_len % size == 0 for size in sizes)


class _PoolAttention(torch.autograd.Function):
    """The Triton forward and the two-kernel backward (module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, bias):
        q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
        batch, heads, seq_len, head_dim = q.shape
        accumulate = compute_dtype(q)  # fp32, fp64 for fp64 inputs
        ctx.bias_dtype = bias.dtype
        bias = bias.to(accumulate).contiguous()
        head_dim_pad, blocks, precision = _launch_settings(q)
        block_m, block_n, warps, stages = blocks.forward
        # The output is laid out (B, T, H, d): the layer reads it back as (B, T, H x d) without a copy.
        out = new_buffer((batch, seq_len, heads, head_dim), v.dtype, v.device).transpose(1, 2)
        lse2 = new_buffer((batch, heads, seq_len), accumulate, q.device)
        _forward_kernel[(batch * heads, triton.cdiv(seq_len, block_m))](
            q, k, v, bias, out, lse2,
            *_bht_strides(q), *_bht_strides(k), *_bht_strides(v), *_bht_strides(out),
            heads, seq_len, head_dim, _LOG2_E / math.sqrt(head_dim),
            D_PAD=head_dim_pad, BLOCK_M=block_m, BLOCK_N=block_n, EVEN_T=_even(seq_len, block_m),
            EVEN_D=head_dim_pad == head_dim, PRECISION=precision, num_warps=warps, num_stages=stages,
            enable_fp_fusion=_FP_FUSION,
        )
        ctx.save_for_backward(q, k, v, bias, out, lse2)
        ctx.set_materialize_grads(False)
        return out, lse2 * _LN_2

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, bias, out, lse2 = ctx.saved_tensors
        batch, heads, seq_len, head_dim = q.shape
        head_dim_pad, blocks, precision = _launch_settings(q)
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        grad_out = _last_dim_contiguous(grad_out)
        delta = new_buffer((batch, heads, seq_len), lse2.dtype, q.device)
        delta_rows = 64
        _delta_kernel[(batch * heads, triton.cdiv(seq_len, delta_rows))](
            out, grad_out, grad_lse.to(lse2.dtype).contiguous() if grad_lse is not None else delta, delta,
            *_bht_strides(out), *_bht_strides(grad_out), heads, seq_len, head_dim,
            HAS_DLSE=grad_lse is not None, D_PAD=head_dim_pad, BLOCK=delta_rows, enable_fp_fusion=_FP_FUSION,
        )
        qk_scale, sm_scale = _LOG2_E / math.sqrt(head_dim), 1.0 / math.sqrt(head_dim)
        common = (*_bht_strides(q), *_bht_strides(k), *_bht_strides(v), *_bht_strides(grad_out),
                  heads, seq_len, head_dim, qk_scale, sm_scale)
        grad_k = new_buffer(k.shape, k.dtype, k.device)
        grad_v = new_buffer(v.shape, v.dtype, v.device)
        grad_bias = new_buffer(bias.shape, bias.dtype, bias.device)
        block_m, block_n, warps, stages = blocks.key_side
        _key_side_kernel[(batch * heads, triton.cdiv(seq_len, block_n))](
            q, k, v, bias, grad_out, lse2, delta, grad_k, grad_v, grad_bias, *common,
            D_PAD=head_dim_pad, BLOCK_M=block_m, BLOCK_N=block_n, EVEN_T=_even(seq_len, block_m, block_n),
            EVEN_D=head_dim_pad == head_dim, PRECISION=precision, num_warps=warps, num_stages=stages,
            enable_fp_fusion=_FP_FUSION,
        )
        if not ctx.needs_input_grad[0]:
            return None, grad_k, grad_v, grad_bias.to(ctx.bias_dtype)
        grad_q = new_buffer(q.shape, q.dtype, q.device)
        block_m, block_n, warps, stages = blocks.query_side
        _query_side_kernel[(batch * heads, triton.cdiv(seq_len, block_m))](
            q, k, v, bias, grad_out, lse2, delta, grad_q, *common,
            D_PAD=head_dim_pad, BLOCK_M=block_m, BLOCK_N=block_n, EVEN_T=_even(seq_len, block_m),
            EVEN_D=head_dim_pad == head_dim, PRECISION=precision, num_warps=warps, num_stages=stages,
            enable_fp_fusion=_FP_FUSION,
        )
        return grad_q, grad_k, grad_v, grad_bias.to(ctx.bias_dtype)


def pool_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, *, use_triton: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention with a per-key bias (module docstring): o (B, H, T, d) in v's dtype and
    lse (B, H, T) in fp32 (fp64 for fp64 inputs), both differentiable.

    use_triton: None picks the Triton kernels on CUDA; True forces them (off CUDA only under
    TRITON_INTERPRET=1); False forces the reference. fp64 runs the kernels only in the
    interpreter (tests); on CUDA it takes the reference.
    """
    _check_shapes(q, k, v, bias)
    if q.shape[2] == 0 or not wants_triton(q, use_triton) or (q.dtype == torch.float64 and q.is_cuda):
        return pool_attention_reference(q, k, v, bias)
    return _PoolAttention.apply(q, k, v, bias)
