"""The NS dendritic chunked scan (the SSD form) as two fused Triton kernels: forward and backward.

Per head h (scalar decay A_h < 0, step dt_t >= 0) and group g(h) = h // (H // G) of B and C:

    V_t = exp(A_h dt_t) V_{t-1} + dt_t B_t u_t^T        (N x P)
    y_t = C_t^T V_t                                     (P,)

the recurrence of `engine.models.ns.scan.chunked_scan` (its docstring derives the chunked form;
that function is the reference this one is tested against, with the same signature and results:
y (Bt, T, H, P) and the last state (Bt, H, N, P) in fp32, fp64 for fp64 inputs). With x_s = dt_s
u_s, a_s = A_h dt_s, cs_t = a_1 + ... + a_t within a chunk of L tokens and tot = cs_L, a chunk
entered with state S gives

    y_t = sum_{s <= t} exp(cs_t - cs_s) (C_t . B_s) x_s + exp(cs_t) C_t^T S
    S'  = exp(tot) S + sum_s exp(tot - cs_s) B_s x_s^T

One program a (batch row, head) walks the chunks in order and carries S (fp32, or fp64 for fp64
inputs) in registers: each chunk is four (L x 64 x 64) matrix products (C B^T; that masked by
the decay matrix, times x; C S; B^T times the decay-weighted x) and L^2 exponentials, and no
(L x L) tensor ever reaches memory. The forward writes y, the last state and, when a gradient
is wanted, the state entering each chunk (Bt, H, chunks, N, P) for the backward. The backward
walks the chunks in reverse carrying dS' (the gradient of the state leaving the chunk):

    dx_s  = sum_{t >= s} M_ts dy_t + exp(tot - cs_s) dS'^T B_s      M_ts = exp(cs_t - cs_s) C_t . B_s
    dC_t  = sum_s G_ts B_s + exp(cs_t) S dy_t                       G_ts = exp(cs_t - cs_s) dy_t . x_s
    dB_s  = sum_t G_ts C_t + exp(tot - cs_s) dS' x_s
    dS    = exp(tot) dS' + sum_t exp(cs_t) C_t dy_t^T

and the log-decays' gradient through cs (the row sums minus the column sums of M * dY X^T, the
entering state's read, the chunk's weights to its end and exp(tot) <S, dS'>), summed from the
end of the chunk (a reverse cumsum) into each a_t, then into dt (A da + u . dx) and A (dt da).
dB and dC come out per head (Bt, T, H, N) and are summed over a group's heads afterwards, and
dA per (row, head) summed over rows: sums in a fixed order, no atomics, the same bits on every
call (a resumed GPU line repeats an uninterrupted one).

Matrix products take the autocast dtype when autocast is on (bf16 on tensor cores, fp32
accumulators, as the reference's einsums under autocast), IEEE fp32 otherwise (fp64 for fp64
inputs, which only the interpreter runs). The carried state, dS', every accumulator and every
exponent are fp32 or wider.

Exponents: the reference sums exactly the steps each decay spans, never differences of long
running sums. Here the chunk's running sum cs is taken in fp64 (L additions a chunk, a vector,
cheap) and split into an fp32 value and its fp32 remainder, and a decay exponent is
(hi_t - hi_s) + (lo_t - lo_s): the rounding of the running sum cancels to about 2^-48 |cs|, so
the exponent's error is relative to the exponent itself (the fp32 subtraction's), whatever
steps came before in the chunk (a boundary flush with a huge a_s followed by small steps keeps
its later decays exact). Decays between chunks are products of each chunk's own exp(tot).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._dispatch import compute_dtype, new_buffer, wants_triton

_WARPS = 8
"""Warps a program. sm_90, Triton 3.9 (`bench/sass_report.py`'s compile, bf16, L = N = P = 64): the
forward holds its tiles in 230 registers with 8 warps and spills 48 bytes with 4; the backward
spills with 4 or 8 (8: 248 bytes a thread in the inputs' half, 80 in the maps' half; 16 warps cap
a thread at 128 registers and spill more)."""
_BACKWARD_STAGES = 1
"""Loads of later chunks in flight in the backward: 1 spills least (3, Triton's default, adds 72
bytes a thread and 108 KiB of shared memory)."""
_FP_FUSION = True
"""Multiply-adds fused, named at every launch: a new Triton's default must not change the bits."""

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32,
              torch.float64: tl.float64}  # fmt: skip


@triton.jit
def _chunk_inputs(
    u_base, dt_base, B_base, C_base, A, chunk, seq_len,
    su_t, sdt_t, sb_t, sc_t, head_dim, state_size,
    ACC: tl.constexpr, L: tl.constexpr, N_PAD: tl.constexpr, P_PAD: tl.constexpr,
):
    """One chunk's inputs, rows past T zero (dt 0: neither decay nor drive), and its
    running log-decay as hi + lo (module docstring) with the chunk's total."""
    rows = chunk * L + tl.arange(0, L)
    row_ok = rows < seq_len
    offs_n = tl.arange(0, N_PAD)
    offs_p = tl.arange(0, P_PAD)
    bc_ok = row_ok[:, None] & (offs_n < state_size)[None, :]
    up_ok = row_ok[:, None] & (offs_p < head_dim)[None, :]
    dt = tl.load(dt_base + rows * sdt_t, mask=row_ok, other=0.0).to(ACC)
    # u, B and C stay in their own dtype (bf16 tiles hold half the registers); they widen where used.
    u = tl.load(u_base + rows[:, None] * su_t + offs_p[None, :], mask=up_ok, other=0.0)
    B = tl.load(B_base + rows[:, None] * sb_t + offs_n[None, :], mask=bc_ok, other=0.0)
    C = tl.load(C_base + rows[:, None] * sc_t + offs_n[None, :], mask=bc_ok, other=0.0)
    cs = tl.cumsum((dt * A).to(tl.float64), 0)
    tot = tl.sum(tl.where(tl.arange(0, L) == L - 1, cs, 0.0), 0)  # cs's last element, exactly
    cs_hi = cs.to(ACC)
    cs_lo = (cs - cs_hi.to(tl.float64)).to(ACC)
    to_end = tl.exp((tot - cs).to(ACC))  # exp(a_{s+1} + ... + a_L): how x_s reaches the chunk's end
    return rows, row_ok, dt, u, B, C, cs_hi, cs_lo, tot.to(ACC), to_end


@triton.jit
def _decay_matrix(cs_hi, cs_lo, L: tl.constexpr):
    """exp(cs_t - cs_s) for s <= t, 0 above the diagonal (an (L x L) tile in registers)."""
    t = tl.arange(0, L)[:, None]
    s = tl.arange(0, L)[None, :]
    exponent = (cs_hi[:, None] - cs_hi[None, :]) + (cs_lo[:, None] - cs_lo[None, :])
    return tl.where(t >= s, tl.exp(tl.minimum(exponent, 0.0)), 0.0)


@triton.jit
def _ssd_forward_kernel(
    u_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, s0_ptr, y_ptr, s_last_ptr, s_saved_ptr,
    su_b, su_t, su_h, sdt_b, sdt_t, sdt_h, sb_b, sb_t, sb_g, sc_b, sc_t, sc_g,
    seq_len, chunks, heads, heads_per_group, head_dim, state_size,
    HAS_S0: tl.constexpr, SAVE: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
    L: tl.constexpr, N_PAD: tl.constexpr, P_PAD: tl.constexpr,
):
    """y (Bt, T, H, P), the last state (Bt, H, N, P) and with SAVE each chunk's entering state
    (Bt, H, chunks, N, P) of one (row, head), chunk after chunk."""
    head = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    group = head // heads_per_group
    ACC = y_ptr.dtype.element_ty
    A = tl.load(A_ptr + head).to(ACC)
    u_base = u_ptr + batch * su_b + head * su_h
    dt_base = dt_ptr + batch * sdt_b + head * sdt_h
    B_base = B_ptr + batch * sb_b + group * sb_g
    C_base = C_ptr + batch * sc_b + group * sc_g
    offs_n = tl.arange(0, N_PAD)
    offs_p = tl.arange(0, P_PAD)
    state_ok = (offs_n < state_size)[:, None] & (offs_p < head_dim)[None, :]
    state_offsets = offs_n[:, None] * head_dim + offs_p[None, :]
    bh = batch * heads + head
    if HAS_S0:
        S = tl.load(s0_ptr + bh * state_size * head_dim + state_offsets, mask=state_ok, other=0.0).to(ACC)
    else:
        S = tl.zeros([N_PAD, P_PAD], dtype=ACC)
    y_base = y_ptr + (batch * seq_len * heads + head) * head_dim
    for chunk in range(chunks):
        if SAVE:
            tl.store(s_saved_ptr + (bh * chunks + chunk) * state_size * head_dim + state_offsets, S, mask=state_ok)
        rows, row_ok, dt, u, B, C, cs_hi, cs_lo, tot, to_end = _chunk_inputs(
            u_base, dt_base, B_base, C_base, A, chunk, seq_len, su_t, sdt_t, sb_t, sc_t, head_dim, state_size,
            ACC, L, N_PAD, P_PAD)
        x = dt[:, None] * u  # (L, P): the drive dt_s u_s
        C_dot = C.to(DOT)
        x_dot = x.to(DOT)
        overlap = tl.dot(C_dot, tl.trans(B.to(DOT)), input_precision=PRECISION, out_dtype=ACC)  # (L, L)
        mixing = overlap * _decay_matrix(cs_hi, cs_lo, L)
        y = tl.dot(mixing.to(DOT), x_dot, input_precision=PRECISION, out_dtype=ACC)  # (L, P)
        read = tl.dot(C_dot, S.to(DOT), input_precision=PRECISION, out_dtype=ACC)  # C_t^T S
        y += tl.exp(cs_hi)[:, None] * read
        tl.store(y_base + rows[:, None] * heads * head_dim + offs_p[None, :], y,
                 mask=row_ok[:, None] & (offs_p < head_dim)[None, :])
        weighted = (x * to_end[:, None]).to(DOT)
        S = tl.exp(tot) * S + tl.dot(tl.trans(B.to(DOT)), weighted, input_precision=PRECISION, out_dtype=ACC)
    tl.store(s_last_ptr + bh * state_size * head_dim + state_offsets, S, mask=state_ok)


@triton.jit
def _ssd_backward_kernel(
    u_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, s_saved_ptr, dy_ptr, ds_last_ptr,
    du_ptr, ddt_ptr, dA_ptr, dB_ptr, dC_ptr, ds0_ptr,
    su_b, su_t, su_h, sdt_b, sdt_t, sdt_h, sb_b, sb_t, sb_g, sc_b, sc_t, sc_g, sdy_b, sdy_t, sdy_h,
    seq_len, chunks, heads, heads_per_group, head_dim, state_size,
    MAPS: tl.constexpr, HAS_DS_LAST: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
    L: tl.constexpr, N_PAD: tl.constexpr, P_PAD: tl.constexpr,
):
    """The gradients of one (row, head), chunk after chunk from the last (module docstring), in
    two launches that each carry dS' back through the chunks (one product a chunk, recomputed
    rather than stored): MAPS False gives du (Bt, T, H, P) and ddt (Bt, T, H) in u's and dt's
    dtypes, dA per row and head (Bt, H) and the entering state's gradient (Bt, H, N, P); MAPS
    True gives dB and dC per head (Bt, T, H, N). One launch holding both halves' tiles spills
    registers (sm_90: a warpgroup holds a 64 x 64 fp32 product in 32 registers a thread)."""
    head = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    group = head // heads_per_group
    ACC = ds0_ptr.dtype.element_ty
    A = tl.load(A_ptr + head).to(ACC)
    u_base = u_ptr + batch * su_b + head * su_h
    dt_base = dt_ptr + batch * sdt_b + head * sdt_h
    B_base = B_ptr + batch * sb_b + group * sb_g
    C_base = C_ptr + batch * sc_b + group * sc_g
    dy_base = dy_ptr + batch * sdy_b + head * sdy_h
    offs_l = tl.arange(0, L)
    offs_n = tl.arange(0, N_PAD)
    offs_p = tl.arange(0, P_PAD)
    p_ok = offs_p < head_dim
    state_ok = (offs_n < state_size)[:, None] & p_ok[None, :]
    state_offsets = offs_n[:, None] * head_dim + offs_p[None, :]
    bh = batch * heads + head
    if HAS_DS_LAST:
        dS = tl.load(ds_last_ptr + bh * state_size * head_dim + state_offsets, mask=state_ok, other=0.0).to(ACC)
    else:
        dS = tl.zeros([N_PAD, P_PAD], dtype=ACC)
    dA = tl.zeros([L], dtype=ACC)
    row_base = batch * seq_len * heads + head  # (row, t = 0, head) in (Bt, T, H, .) buffers
    for back in range(chunks):
        chunk = chunks - 1 - back
        rows, row_ok, dt, u, B, C, cs_hi, cs_lo, tot, to_end = _chunk_inputs(
            u_base, dt_base, B_base, C_base, A, chunk, seq_len, su_t, sdt_t, sb_t, sc_t, head_dim, state_size,
            ACC, L, N_PAD, P_PAD)
        up_ok = row_ok[:, None] & p_ok[None, :]
        dy = tl.load(dy_base + rows[:, None] * sdy_t + offs_p[None, :], mask=up_ok, other=0.0).to(ACC)
        S = tl.load(s_saved_ptr + (bh * chunks + chunk) * state_size * head_dim + state_offsets, mask=state_ok,
                    other=0.0)
        x = dt[:, None] * u
        B_dot, C_dot, x_dot, dy_dot, dS_dot = B.to(DOT), C.to(DOT), x.to(DOT), dy.to(DOT), dS.to(DOT)
        from_start = tl.exp(cs_hi)  # exp(a_1 + ... + a_t)
        decay = _decay_matrix(cs_hi, cs_lo, L)
        dyx = tl.dot(dy_dot, tl.trans(x_dot), input_precision=PRECISION, out_dtype=ACC)  # dy_t . x_s
        if MAPS:
            weights = (dyx * decay).to(DOT)  # G
            bc_offsets = (row_base + rows[:, None] * heads) * state_size + offs_n[None, :]
            bc_ok = row_ok[:, None] & (offs_n < state_size)[None, :]
            dC = tl.dot(weights, B_dot, input_precision=PRECISION, out_dtype=ACC)
            dC += from_start[:, None] * tl.dot(dy_dot, tl.trans(S.to(DOT)), input_precision=PRECISION,
                                               out_dtype=ACC)
            tl.store(dC_ptr + bc_offsets, dC, mask=bc_ok)
            dB = tl.dot(tl.trans(weights), C_dot, input_precision=PRECISION, out_dtype=ACC)
            dB += to_end[:, None] * tl.dot(x_dot, tl.trans(dS_dot), input_precision=PRECISION, out_dtype=ACC)
            tl.store(dB_ptr + bc_offsets, dB, mask=bc_ok)
        else:
            mixing = tl.dot(C_dot, tl.trans(B_dot), input_precision=PRECISION, out_dtype=ACC) * decay  # M
            products = mixing * dyx  # the gradient of each exponent cs_t - cs_s
            d_cs = tl.sum(products, 1) - tl.sum(products, 0)
            dx = tl.dot(tl.trans(mixing.to(DOT)), dy_dot, input_precision=PRECISION, out_dtype=ACC)
            read = tl.dot(C_dot, S.to(DOT), input_precision=PRECISION, out_dtype=ACC)  # C_t^T S
            d_cs += from_start * tl.sum(read * dy, 1)
            B_dS = tl.dot(B_dot, dS_dot, input_precision=PRECISION, out_dtype=ACC)  # (L, P): dS'^T B_s
            dx += to_end[:, None] * B_dS
            leaving = to_end * tl.sum(B_dS * x, 1)
            d_tot = tl.exp(tot) * tl.sum(tl.sum(S * dS, 1), 0) + tl.sum(leaving, 0)
            # The gradient of each running sum cs_t, then of each step a_t (a sum from t to the end).
            d_cs += tl.where(offs_l == L - 1, d_tot, 0.0) - leaving
            d_step = tl.cumsum(d_cs, 0, reverse=True)
            ddt = A * d_step + tl.sum(u * dx, 1)
            dA += dt * d_step
            tl.store(du_ptr + (row_base + rows[:, None] * heads) * head_dim + offs_p[None, :],
                     (dt[:, None] * dx).to(du_ptr.dtype.element_ty), mask=up_ok)
            tl.store(ddt_ptr + row_base + rows * heads, ddt.to(ddt_ptr.dtype.element_ty), mask=row_ok)
        dS = tl.exp(tot) * dS + tl.dot(tl.trans((C * from_start[:, None]).to(DOT)), dy_dot,
                                       input_precision=PRECISION, out_dtype=ACC)
    if not MAPS:
        tl.store(ds0_ptr + bh * state_size * head_dim + state_offsets, dS, mask=state_ok)
        tl.store(dA_ptr + bh, tl.sum(dA, 0))


def _check(u: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, chunk_len: int,
           state0: torch.Tensor | None) -> None:
    if u.dim() != 4:
        raise ValueError(f"ssd_scan: u must be (Bt, T, H, P), got {tuple(u.shape)}")
    batch, length, heads, head_dim = u.shape
    if dt.shape != (batch, length, heads):
        raise ValueError(f"ssd_scan: dt must be (Bt, T, H) = {(batch, length, heads)}, got {tuple(dt.shape)}")
    if A.shape != (heads,):
        raise ValueError(f"ssd_scan: A must be (H,) = ({heads},), got {tuple(A.shape)}")
    if B.dim() != 4 or B.shape[:2] != (batch, length) or C.shape != B.shape:
        raise ValueError(f"ssd_scan: B and C must share one (Bt, T, G, N) shape, got {tuple(B.shape)}, {tuple(C.shape)}")
    if heads % B.shape[2]:
        raise ValueError(f"ssd_scan: H={heads} is not a multiple of G={B.shape[2]}")
    if state0 is not None and state0.shape != (batch, heads, B.shape[3], head_dim):
        raise ValueError(f"ssd_scan: state0 must be (Bt, H, N, P) = {(batch, heads, B.shape[3], head_dim)}, "
                         f"got {tuple(state0.shape)}")
    if chunk_len < 16 or chunk_len & (chunk_len - 1):
        raise ValueError(f"ssd_scan: chunk_len must be a power of two >= 16 (a tl.dot tile), got {chunk_len}")


def _last_dim_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """The kernels take any other strides (u, B, C are views of one in_proj output)."""
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def _pads(head_dim: int, state_size: int) -> tuple[int, int]:
    """N and P padded to powers of two, at least 16 (tl.dot's smallest)."""
    return max(16, triton.next_power_of_2(state_size)), max(16, triton.next_power_of_2(head_dim))


def _dot_dtype(device_type: str, accumulate: torch.dtype) -> torch.dtype:
    """The matrix products' operand dtype: autocast's where it is on (as the reference's einsums),
    the accumulation dtype otherwise."""
    if accumulate == torch.float32 and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return accumulate


class _SSDScan(torch.autograd.Function):
    """The forward and backward kernels (module docstring)."""

    @staticmethod
    def forward(ctx, u, dt, A, B, C, state0, chunk_len, dot_dtype):
        u, B, C = (_last_dim_contiguous(t) for t in (u, B, C))
        batch, length, heads, head_dim = u.shape
        groups, state_size = B.shape[2], B.shape[3]
        accumulate = compute_dtype(u, dt, A, B, C, state0)
        A = A.contiguous()
        chunks = triton.cdiv(length, chunk_len)
        save = any(ctx.needs_input_grad[:6])
        y = new_buffer((batch, length, heads, head_dim), accumulate, u.device)
        last = new_buffer((batch, heads, state_size, head_dim), accumulate, u.device)
        saved = new_buffer((batch, heads, chunks, state_size, head_dim) if save else (1,), accumulate, u.device)
        s0 = state0.contiguous() if state0 is not None else last
        n_pad, p_pad = _pads(head_dim, state_size)
        _ssd_forward_kernel[(heads, batch)](
            u, dt, A, B, C, s0, y, last, saved,
            u.stride(0), u.stride(1), u.stride(2), dt.stride(0), dt.stride(1), dt.stride(2),
            B.stride(0), B.stride(1), B.stride(2), C.stride(0), C.stride(1), C.stride(2),
            length, chunks, heads, heads // groups, head_dim, state_size,
            HAS_S0=state0 is not None, SAVE=save, DOT=_TL_DTYPES[dot_dtype],
            PRECISION="ieee" if dot_dtype == accumulate else "tf32", L=chunk_len, N_PAD=n_pad, P_PAD=p_pad,
            num_warps=_WARPS, enable_fp_fusion=_FP_FUSION,
        )
        ctx.save_for_backward(u, dt, A, B, C, saved)
        ctx.chunk_len, ctx.dot_dtype = chunk_len, dot_dtype
        ctx.state0_dtype = state0.dtype if state0 is not None else None
        ctx.set_materialize_grads(False)
        return y, last

    @staticmethod
    def backward(ctx, grad_y, grad_last):
        u, dt, A, B, C, saved = ctx.saved_tensors
        batch, length, heads, head_dim = u.shape
        groups, state_size = B.shape[2], B.shape[3]
        accumulate = saved.dtype
        chunk_len, dot_dtype = ctx.chunk_len, ctx.dot_dtype
        if grad_y is None:
            grad_y = torch.zeros(u.shape, dtype=accumulate, device=u.device)
        grad_y = _last_dim_contiguous(grad_y)
        grad_u = new_buffer(u.shape, u.dtype, u.device)
        grad_dt = new_buffer(dt.shape, dt.dtype, u.device)
        grad_A_rows = new_buffer((batch, heads), accumulate, u.device)
        grad_B_heads = new_buffer((batch, length, heads, state_size), accumulate, u.device)
        grad_C_heads = new_buffer((batch, length, heads, state_size), accumulate, u.device)
        grad_state0 = new_buffer((batch, heads, state_size, head_dim), accumulate, u.device)
        ds_last = grad_last.contiguous() if grad_last is not None else grad_state0
        n_pad, p_pad = _pads(head_dim, state_size)
        for maps in (False, True):
            _ssd_backward_kernel[(heads, batch)](
                u, dt, A, B, C, saved, grad_y, ds_last,
                grad_u, grad_dt, grad_A_rows, grad_B_heads, grad_C_heads, grad_state0,
                u.stride(0), u.stride(1), u.stride(2), dt.stride(0), dt.stride(1), dt.stride(2),
                B.stride(0), B.stride(1), B.stride(2), C.stride(0), C.stride(1), C.stride(2),
                grad_y.stride(0), grad_y.stride(1), grad_y.stride(2),
                length, triton.cdiv(length, chunk_len), heads, heads // groups, head_dim, state_size,
                MAPS=maps, HAS_DS_LAST=grad_last is not None, DOT=_TL_DTYPES[dot_dtype],
                PRECISION="ieee" if dot_dtype == accumulate else "tf32", L=chunk_len, N_PAD=n_pad, P_PAD=p_pad,
                num_warps=_WARPS, num_stages=_BACKWARD_STAGES, enable_fp_fusion=_FP_FUSION,
            )
        # A group's heads share its B and C: their per-head gradients summed in one fixed order.
        per_group = (batch, length, groups, heads // groups, state_size)
        grad_B = grad_B_heads.view(per_group).sum(3).to(B.dtype)
        grad_C = grad_C_heads.view(per_group).sum(3).to(C.dtype)
        grad_state0 = grad_state0.to(ctx.state0_dtype) if ctx.state0_dtype is not None else None
        return (grad_u, grad_dt, grad_A_rows.sum(0).to(A.dtype), grad_B, grad_C,
                grad_state0, None, None)


def ssd_scan(
    u: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_len: int,
    state0: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`engine.models.ns.scan.chunked_scan` through the Triton kernels (module docstring), the same
    arguments and results, differentiable in every tensor. Runs on CUDA tensors, or on CPU under
    TRITON_INTERPRET=1; the reference lives in the engine (kernels import nothing above them), so
    the caller picks it where these cannot run. fp64 runs only in the interpreter (tests).
    chunk_len: a power of two >= 16."""
    _check(u, dt, A, B, C, chunk_len, state0)
    wants_triton(u, True)  # a clear error on CPU without the interpreter
    if u.is_cuda and compute_dtype(u, dt, A, B, C, state0) == torch.float64:
        raise ValueError("ssd_scan: float64 runs only under TRITON_INTERPRET=1; use chunked_scan on CUDA")
    accumulate = compute_dtype(u, dt, A, B, C, state0)
    dot_dtype = _dot_dtype(u.device.type, accumulate)
    with torch.autocast(device_type=u.device.type, enabled=False):
        return _SSDScan.apply(u, dt, A, B, C, state0, chunk_len, dot_dtype)
