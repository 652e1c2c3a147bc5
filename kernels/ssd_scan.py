"""The NS dendritic chunked scan (the SSD form) as chunk-parallel Triton kernels, forward and backward.

Per head h (scalar decay A_h < 0, step dt_t >= 0) and group g(h) = h // (H // G) of B and C:

    V_t = exp(A_h dt_t) V_{t-1} + dt_t B_t u_t^T        (N x P)
    y_t = C_t^T V_t                                     (P,)

the recurrence of `engine.models.ns.scan.chunked_scan` (its docstring derives the chunked form;
that function is the reference this one is tested against, with the same signature and results:
y (Bt, T, H, P) and the last state (Bt, H, N, P) in fp32, fp64 for fp64 inputs). With x_s = dt_s
u_s, a_s = A_h dt_s, cs_t = a_1 + ... + a_t within a chunk of L tokens and tot = cs_L, a chunk
entered with state S gives

    y_t = sum_{s <= t} exp(cs_t - cs_s) (C_t . B_s) x_s + exp(cs_t) C_t^T S
    S'  = exp(tot) S + S_loc        S_loc = sum_s exp(tot - cs_s) B_s x_s^T

Everything but the recurrence S' = exp(tot) S + S_loc is independent per chunk, so the forward is
three launches (Mamba-2's SSD structure): one program a (row, head, chunk) writes S_loc and tot;
one program a (row, head, tile of N x P) walks the chunks in order, replacing each S_loc in place
by the state entering its chunk and writing the last state (elementwise: an FMA a chunk and
element, the only sequential work); one program a (row, head, chunk) writes y from its chunk's
inputs and entering state: three (L x 64 x 64) matrix products (C B^T; that masked by the decay
matrix, times x; C S) and L^2 exponentials, no (L x L) tensor in memory. The entering states
(Bt, H, chunks, N, P) stay for the backward. The backward mirrors it: one program a chunk writes
dS_loc = sum_t exp(cs_t) C_t dy_t^T, the pass walks the chunks in reverse,

    dS = exp(tot) dS' + dS_loc                          (dS' the gradient of the state leaving a chunk)

replacing each dS_loc by the dS' of its chunk and writing the entering state's gradient, and two
launches of one program a chunk take every other gradient from the chunk's inputs, S and dS':

    dx_s  = sum_{t >= s} M_ts dy_t + exp(tot - cs_s) dS'^T B_s      M_ts = exp(cs_t - cs_s) C_t . B_s
    dC_t  = sum_s G_ts B_s + exp(cs_t) S dy_t                       G_ts = exp(cs_t - cs_s) dy_t . x_s
    dB_s  = sum_t G_ts C_t + exp(tot - cs_s) dS' x_s

and the log-decays' gradient through cs (the row sums minus the column sums of M * dY X^T, the
entering state's read, the chunk's weights to its end and exp(tot) <S, dS'>), summed from the
end of the chunk (a reverse cumsum) into each a_t, then into dt (A da + u . dx) and A (dt da).
dB and dC come out per head (Bt, T, H, N) and are summed over a group's heads afterwards, and
dA per (row, head, chunk) summed over rows and chunks: every sum in a fixed order, no atomics,
the same bits on every call (a resumed GPU line repeats an uninterrupted one).

Matrix products take the autocast dtype when autocast is on (bf16 on tensor cores, fp32
accumulators, as the reference's einsums under autocast), IEEE fp32 otherwise (fp64 for fp64
inputs, which only the interpreter runs). The passed states and their gradients, every
accumulator and every exponent are fp32 or wider.

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

_WARPS = 4
"""Warps a program of one chunk. sm_90, Triton 3.9, bf16, L = N = P = 64 (bench/sass_report.py's
compile; no spills anywhere): a chunk's contribution to the passed state 59-62 registers a thread,
its output 138, dB and dC 152 (196 with 8 warps: Hopper's wgmma gives a warpgroup whole 64-row
tiles, so 8 warps do not halve them); three of those programs fit an SM's registers."""
_INPUT_GRAD_WARPS = 8
"""du, ddt and dA hold the most (L x L) tiles at once (M, dY X^T, their products and the decay
matrix besides dx and the states' products): 212 registers with 8 warps, 255 and 72 bytes of
spills a thread with 4."""
_PASS_BLOCK = 512
"""State elements a program of the pass between chunks: 8 tiles of a 64 x 64 state, 2,560 programs
at ns-2b's shape (8 rows x 40 heads)."""
_PASS_WARPS = 1
"""Warps a program of the pass: 16 elements a thread."""
_PASS_PREFETCH = True
"""Whether the pass loads the next chunk's contribution before it waits on the current one
(`_state_pass_kernel`). H200, ns-2b's shape, `python bench/ssd_scan.py --pass-sweep` (session 13):
0.179 ms with it (0.90 of a copy of the same bytes), 0.46-0.74 ms without it at any tile and warps
(0.70 ms with the previous 1,024-element tiles of 4 warps)."""
_FP_FUSION = True
"""Multiply-adds fused, named at every launch: a new Triton's default must not change the bits."""

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32,
              torch.float64: tl.float64}  # fmt: skip


@triton.jit
def _program_chunk(heads, heads_per_group):
    """(row, head, group, chunk) of a program of one chunk. The heads of a chunk are neighbours in
    the launch order, so the B and C tiles they share come from L2."""
    program = tl.program_id(0)
    head = program % heads
    return tl.program_id(1).to(tl.int64), head, head // heads_per_group, program // heads


@triton.jit
def _chunk_decays(dt_base, A, chunk, seq_len, sdt_t, ACC: tl.constexpr, L: tl.constexpr):
    """A chunk's rows (those past T have dt 0: neither decay nor drive), its dt, its running
    log-decay as hi + lo (module docstring), its total and each step's decay to the chunk's end."""
    rows = chunk * L + tl.arange(0, L)
    row_ok = rows < seq_len
    dt = tl.load(dt_base + rows * sdt_t, mask=row_ok, other=0.0).to(ACC)
    cs = tl.cumsum((dt * A).to(tl.float64), 0)
    tot = tl.sum(tl.where(tl.arange(0, L) == L - 1, cs, 0.0), 0)  # cs's last element, exactly
    cs_hi = cs.to(ACC)
    cs_lo = (cs - cs_hi.to(tl.float64)).to(ACC)
    to_end = tl.exp((tot - cs).to(ACC))  # exp(a_{s+1} + ... + a_L): how x_s reaches the chunk's end
    return rows, row_ok, dt, cs_hi, cs_lo, tot.to(ACC), to_end


@triton.jit
def _row_tile(rows, row_ok, stride_t, width, PAD: tl.constexpr):
    """Offsets and mask of a chunk's (L, PAD) tile of a (., T, ., width) tensor, the row's base apart."""
    columns = tl.arange(0, PAD)
    return rows[:, None] * stride_t + columns[None, :], row_ok[:, None] & (columns < width)[None, :]


@triton.jit
def _state_tile(slot, state_size, head_dim, N_PAD: tl.constexpr, P_PAD: tl.constexpr):
    """Offsets and mask of the (N, P) state at `slot` of a contiguous (..., N, P) buffer."""
    offs_n = tl.arange(0, N_PAD)
    offs_p = tl.arange(0, P_PAD)
    offsets = slot * state_size * head_dim + offs_n[:, None] * head_dim + offs_p[None, :]
    return offsets, (offs_n < state_size)[:, None] & (offs_p < head_dim)[None, :]


@triton.jit
def _decay_matrix(cs_hi, cs_lo, L: tl.constexpr):
    """exp(cs_t - cs_s) for s <= t, 0 above the diagonal (an (L x L) tile in registers)."""
    t = tl.arange(0, L)[:, None]
    s = tl.arange(0, L)[None, :]
    exponent = (cs_hi[:, None] - cs_hi[None, :]) + (cs_lo[:, None] - cs_lo[None, :])
    return tl.where(t >= s, tl.exp(tl.minimum(exponent, 0.0)), 0.0)


@triton.jit
def _chunk_contribution_kernel(
    dt_ptr, A_ptr, map_ptr, rows_ptr, out_ptr, totals_ptr,
    sdt_b, sdt_t, sdt_h, smap_b, smap_t, smap_g, srow_b, srow_t, srow_h,
    seq_len, chunks, heads, heads_per_group, head_dim, state_size,
    GRADIENT: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
    L: tl.constexpr, N_PAD: tl.constexpr, P_PAD: tl.constexpr,
):
    """What one chunk of one (row, head) adds on its own to what passes between chunks, into
    `out` (Bt, H, chunks, N, P). Forward (GRADIENT False; map B, rows u): S_loc = sum_s
    exp(tot - cs_s) B_s x_s^T, and the chunk's total log-decay into `totals` (Bt, H, chunks).
    Backward (map C, rows dy): dS_loc = sum_t exp(cs_t) C_t dy_t^T."""
    batch, head, group, chunk = _program_chunk(heads, heads_per_group)
    ACC = out_ptr.dtype.element_ty
    A = tl.load(A_ptr + head).to(ACC)
    rows, row_ok, dt, cs_hi, cs_lo, tot, to_end = _chunk_decays(
        dt_ptr + batch * sdt_b + head * sdt_h, A, chunk, seq_len, sdt_t, ACC, L)
    offsets, ok = _row_tile(rows, row_ok, smap_t, state_size, N_PAD)
    maps = tl.load(map_ptr + batch * smap_b + group * smap_g + offsets, mask=ok, other=0.0)
    offsets, ok = _row_tile(rows, row_ok, srow_t, head_dim, P_PAD)
    values = tl.load(rows_ptr + batch * srow_b + head * srow_h + offsets, mask=ok, other=0.0).to(ACC)
    if GRADIENT:
        weighted = values * tl.exp(cs_hi)[:, None]  # exp(a_1 + ... + a_t) dy_t
    else:
        weighted = (dt[:, None] * values) * to_end[:, None]  # exp(a_{s+1} + ... + a_L) x_s
    contribution = tl.dot(tl.trans(maps.to(DOT)), weighted.to(DOT), input_precision=PRECISION, out_dtype=ACC)
    slot = (batch * heads + head) * chunks + chunk
    offsets, ok = _state_tile(slot, state_size, head_dim, N_PAD, P_PAD)
    tl.store(out_ptr + offsets, contribution, mask=ok)
    if not GRADIENT:
        tl.store(totals_ptr + slot, tot)


@triton.jit
def _state_pass_kernel(
    states_ptr, totals_ptr, start_ptr, end_ptr, heads, chunks, size,
    HAS_START: tl.constexpr, REVERSE: tl.constexpr, PREFETCH: tl.constexpr, BLOCK: tl.constexpr,
):
    """The only sequential work: one tile of one (row, head)'s (N x P) state walks the chunks,
    in order (forward) or in reverse (backward, for dS'). Each chunk's slot of `states` (Bt, H,
    chunks, N, P) holds its own contribution and is replaced by what enters it on the walk (the
    state entering the chunk; the gradient of the state leaving it); then the running value
    becomes exp(tot) times itself plus that contribution. `start` (Bt, H, N, P; zeros without
    HAS_START) is the first running value, `end` receives the last.

    PREFETCH: each step issues the next chunk's loads before it waits on its own, so a warp has
    two loads in flight instead of one (the walk is latency bound otherwise: session 12 measured
    the plain walk at a quarter of the card's copy rate). The same arithmetic either way."""
    tile = tl.program_id(0)
    bh = tl.program_id(2).to(tl.int64) * heads + tl.program_id(1)
    offsets = tile * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < size
    ACC = states_ptr.dtype.element_ty
    if HAS_START:
        running = tl.load(start_ptr + bh * size + offsets, mask=ok, other=0.0).to(ACC)
    else:
        running = tl.zeros([BLOCK], dtype=ACC)
    first = bh * chunks + (chunks - 1 if REVERSE else 0)
    step_slots = -1 if REVERSE else 1
    if PREFETCH:
        own = tl.load(states_ptr + first * size + offsets, mask=ok, other=0.0)
        total = tl.load(totals_ptr + first)
    for step in range(chunks):
        slot = first + step * step_slots
        if PREFETCH:
            # The last step loads its own slot again (in bounds, unused) rather than branch.
            upcoming_slot = first + tl.minimum(step + 1, chunks - 1) * step_slots
            upcoming = tl.load(states_ptr + upcoming_slot * size + offsets, mask=ok, other=0.0)
            upcoming_total = tl.load(totals_ptr + upcoming_slot)
        else:
            own = tl.load(states_ptr + slot * size + offsets, mask=ok, other=0.0)
            total = tl.load(totals_ptr + slot)
        tl.store(states_ptr + slot * size + offsets, running, mask=ok)
        running = tl.exp(total) * running + own
        if PREFETCH:
            own = upcoming
            total = upcoming_total
    tl.store(end_ptr + bh * size + offsets, running, mask=ok)


@triton.jit
def _chunk_output_kernel(
    u_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, states_ptr, y_ptr,
    su_b, su_t, su_h, sdt_b, sdt_t, sdt_h, sb_b, sb_t, sb_g, sc_b, sc_t, sc_g,
    seq_len, chunks, heads, heads_per_group, head_dim, state_size,
    DOT: tl.constexpr, PRECISION: tl.constexpr, L: tl.constexpr, N_PAD: tl.constexpr, P_PAD: tl.constexpr,
):
    """y (Bt, T, H, P) of one chunk of one (row, head) from its inputs and the state entering it
    (`states`, after the forward pass)."""
    batch, head, group, chunk = _program_chunk(heads, heads_per_group)
    ACC = y_ptr.dtype.element_ty
    A = tl.load(A_ptr + head).to(ACC)
    rows, row_ok, dt, cs_hi, cs_lo, _, _ = _chunk_decays(
        dt_ptr + batch * sdt_b + head * sdt_h, A, chunk, seq_len, sdt_t, ACC, L)
    # u, B and C stay in their own dtype (bf16 tiles hold half the registers); they widen where used.
    offsets, ok = _row_tile(rows, row_ok, su_t, head_dim, P_PAD)
    u = tl.load(u_ptr + batch * su_b + head * su_h + offsets, mask=ok, other=0.0)
    offsets, ok = _row_tile(rows, row_ok, sb_t, state_size, N_PAD)
    B = tl.load(B_ptr + batch * sb_b + group * sb_g + offsets, mask=ok, other=0.0)
    offsets, ok = _row_tile(rows, row_ok, sc_t, state_size, N_PAD)
    C = tl.load(C_ptr + batch * sc_b + group * sc_g + offsets, mask=ok, other=0.0)
    C_dot = C.to(DOT)
    overlap = tl.dot(C_dot, tl.trans(B.to(DOT)), input_precision=PRECISION, out_dtype=ACC)  # (L, L)
    mixing = overlap * _decay_matrix(cs_hi, cs_lo, L)
    y = tl.dot(mixing.to(DOT), (dt[:, None] * u).to(DOT), input_precision=PRECISION, out_dtype=ACC)  # (L, P)
    offsets, ok = _state_tile((batch * heads + head) * chunks + chunk, state_size, head_dim, N_PAD, P_PAD)
    S = tl.load(states_ptr + offsets, mask=ok, other=0.0)
    read = tl.dot(C_dot, S.to(DOT), input_precision=PRECISION, out_dtype=ACC)  # C_t^T S
    y += tl.exp(cs_hi)[:, None] * read
    offsets, ok = _row_tile(rows, row_ok, heads * head_dim, head_dim, P_PAD)
    tl.store(y_ptr + (batch * seq_len * heads + head) * head_dim + offsets, y, mask=ok)


@triton.jit
def _chunk_input_grad_kernel(
    u_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, states_ptr, grad_states_ptr, dy_ptr, du_ptr, ddt_ptr, dA_ptr,
    su_b, su_t, su_h, sdt_b, sdt_t, sdt_h, sb_b, sb_t, sb_g, sc_b, sc_t, sc_g, sdy_b, sdy_t, sdy_h,
    seq_len, chunks, heads, heads_per_group, head_dim, state_size,
    DOT: tl.constexpr, PRECISION: tl.constexpr, L: tl.constexpr, N_PAD: tl.constexpr, P_PAD: tl.constexpr,
):
    """du (Bt, T, H, P) and ddt (Bt, T, H) in u's and dt's dtypes and this chunk's part of dA
    (Bt, H, chunks) of one chunk of one (row, head) (module docstring), from its inputs, the state
    entering it (`states`) and the gradient of the state leaving it (`grad_states`)."""
    batch, head, group, chunk = _program_chunk(heads, heads_per_group)
    ACC = dA_ptr.dtype.element_ty
    A = tl.load(A_ptr + head).to(ACC)
    rows, row_ok, dt, cs_hi, cs_lo, tot, to_end = _chunk_decays(
        dt_ptr + batch * sdt_b + head * sdt_h, A, chunk, seq_len, sdt_t, ACC, L)
    slot = (batch * heads + head) * chunks + chunk
    offsets, ok = _state_tile(slot, state_size, head_dim, N_PAD, P_PAD)
    S = tl.load(states_ptr + offsets, mask=ok, other=0.0)
    dS = tl.load(grad_states_ptr + offsets, mask=ok, other=0.0)
    state_flow = tl.exp(tot) * tl.sum(tl.sum(S * dS, 1), 0)  # exp(tot) <S, dS'>: the fp32 states die here
    S_dot, dS_dot = S.to(DOT), dS.to(DOT)
    # Each fp32 tile dies as soon as its sums are taken (only bf16 copies wait for the products).
    offsets, ok = _row_tile(rows, row_ok, sc_t, state_size, N_PAD)
    C_dot = tl.load(C_ptr + batch * sc_b + group * sc_g + offsets, mask=ok, other=0.0).to(DOT)
    offsets, ok = _row_tile(rows, row_ok, sdy_t, head_dim, P_PAD)
    dy = tl.load(dy_ptr + batch * sdy_b + head * sdy_h + offsets, mask=ok, other=0.0).to(ACC)
    read = tl.dot(C_dot, S_dot, input_precision=PRECISION, out_dtype=ACC)  # C_t^T S
    d_cs = tl.exp(cs_hi) * tl.sum(read * dy, 1)
    dy_dot = dy.to(DOT)
    offsets, ok = _row_tile(rows, row_ok, su_t, head_dim, P_PAD)
    u = tl.load(u_ptr + batch * su_b + head * su_h + offsets, mask=ok, other=0.0)
    offsets, ok = _row_tile(rows, row_ok, sb_t, state_size, N_PAD)
    B_dot = tl.load(B_ptr + batch * sb_b + group * sb_g + offsets, mask=ok, other=0.0).to(DOT)
    x = dt[:, None] * u
    B_dS = tl.dot(B_dot, dS_dot, input_precision=PRECISION, out_dtype=ACC)  # (L, P): dS'^T B_s
    leaving = to_end * tl.sum(B_dS * x, 1)
    dx = to_end[:, None] * B_dS
    x_dot = x.to(DOT)
    mixing = tl.dot(C_dot, tl.trans(B_dot), input_precision=PRECISION, out_dtype=ACC) * _decay_matrix(
        cs_hi, cs_lo, L)  # M
    products = mixing * tl.dot(dy_dot, tl.trans(x_dot), input_precision=PRECISION, out_dtype=ACC)
    d_cs += tl.sum(products, 1) - tl.sum(products, 0)  # the gradient of each exponent cs_t - cs_s
    dx += tl.dot(tl.trans(mixing.to(DOT)), dy_dot, input_precision=PRECISION, out_dtype=ACC)
    # The gradient of each running sum cs_t, then of each step a_t (a sum from t to the end).
    d_cs += tl.where(tl.arange(0, L) == L - 1, state_flow + tl.sum(leaving, 0), 0.0) - leaving
    d_step = tl.cumsum(d_cs, 0, reverse=True)
    tl.store(dA_ptr + slot, tl.sum(dt * d_step, 0))
    row_base = batch * seq_len * heads + head  # (row, t = 0, head) in (Bt, T, H, .) buffers
    ddt = A * d_step + tl.sum(u * dx, 1)
    tl.store(ddt_ptr + row_base + rows * heads, ddt.to(ddt_ptr.dtype.element_ty), mask=row_ok)
    offsets, ok = _row_tile(rows, row_ok, heads * head_dim, head_dim, P_PAD)
    tl.store(du_ptr + row_base * head_dim + offsets, (dt[:, None] * dx).to(du_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _chunk_map_grad_kernel(
    u_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, states_ptr, grad_states_ptr, dy_ptr, dB_ptr, dC_ptr,
    su_b, su_t, su_h, sdt_b, sdt_t, sdt_h, sb_b, sb_t, sb_g, sc_b, sc_t, sc_g, sdy_b, sdy_t, sdy_h,
    seq_len, chunks, heads, heads_per_group, head_dim, state_size,
    DOT: tl.constexpr, PRECISION: tl.constexpr, L: tl.constexpr, N_PAD: tl.constexpr, P_PAD: tl.constexpr,
):
    """dB and dC per head (Bt, T, H, N) of one chunk of one (row, head) (module docstring), from
    its inputs, the state entering it and the gradient of the state leaving it. Apart from the
    input gradients' kernel: one launch holding both halves' tiles spills registers."""
    batch, head, group, chunk = _program_chunk(heads, heads_per_group)
    ACC = dB_ptr.dtype.element_ty
    A = tl.load(A_ptr + head).to(ACC)
    rows, row_ok, dt, cs_hi, cs_lo, _, to_end = _chunk_decays(
        dt_ptr + batch * sdt_b + head * sdt_h, A, chunk, seq_len, sdt_t, ACC, L)
    offsets, ok = _row_tile(rows, row_ok, su_t, head_dim, P_PAD)
    u = tl.load(u_ptr + batch * su_b + head * su_h + offsets, mask=ok, other=0.0)
    x_dot = (dt[:, None] * u).to(DOT)
    offsets, ok = _row_tile(rows, row_ok, sdy_t, head_dim, P_PAD)
    dy_dot = tl.load(dy_ptr + batch * sdy_b + head * sdy_h + offsets, mask=ok, other=0.0).to(DOT)
    weights = tl.dot(dy_dot, tl.trans(x_dot), input_precision=PRECISION, out_dtype=ACC)  # dy_t . x_s
    weights = (weights * _decay_matrix(cs_hi, cs_lo, L)).to(DOT)  # G
    offsets, ok = _state_tile((batch * heads + head) * chunks + chunk, state_size, head_dim, N_PAD, P_PAD)
    S_dot = tl.load(states_ptr + offsets, mask=ok, other=0.0).to(DOT)
    dS_dot = tl.load(grad_states_ptr + offsets, mask=ok, other=0.0).to(DOT)
    n_offsets, n_ok = _row_tile(rows, row_ok, sb_t, state_size, N_PAD)
    B_dot = tl.load(B_ptr + batch * sb_b + group * sb_g + n_offsets, mask=n_ok, other=0.0).to(DOT)
    offsets, ok = _row_tile(rows, row_ok, sc_t, state_size, N_PAD)
    C_dot = tl.load(C_ptr + batch * sc_b + group * sc_g + offsets, mask=ok, other=0.0).to(DOT)
    out_offsets, out_ok = _row_tile(rows, row_ok, heads * state_size, state_size, N_PAD)
    out_base = (batch * seq_len * heads + head) * state_size
    dC = tl.dot(weights, B_dot, input_precision=PRECISION, out_dtype=ACC)
    dC += tl.exp(cs_hi)[:, None] * tl.dot(dy_dot, tl.trans(S_dot), input_precision=PRECISION, out_dtype=ACC)
    tl.store(dC_ptr + out_base + out_offsets, dC, mask=out_ok)
    dB = tl.dot(tl.trans(weights), C_dot, input_precision=PRECISION, out_dtype=ACC)
    dB += to_end[:, None] * tl.dot(x_dot, tl.trans(dS_dot), input_precision=PRECISION, out_dtype=ACC)
    tl.store(dB_ptr + out_base + out_offsets, dB, mask=out_ok)


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


def _tile_arguments(dot_dtype: torch.dtype, accumulate: torch.dtype, chunk_len: int, head_dim: int,
                    state_size: int) -> dict:
    """The compile-time arguments every per-chunk kernel takes: the products' operand dtype and
    precision, the tile sizes, and the multiply-adds' fusion."""
    n_pad, p_pad = _pads(head_dim, state_size)
    return {"DOT": _TL_DTYPES[dot_dtype], "PRECISION": "ieee" if dot_dtype == accumulate else "tf32",
            "L": chunk_len, "N_PAD": n_pad, "P_PAD": p_pad, "enable_fp_fusion": _FP_FUSION}


def _strides(*tensors: torch.Tensor) -> list[int]:
    """The (row, time, head or group) strides of each tensor, in the kernels' argument order."""
    return [stride for tensor in tensors for stride in tensor.stride()[:3]]


def _pass_states(states: torch.Tensor, totals: torch.Tensor, start: torch.Tensor | None, end: torch.Tensor,
                 reverse: bool, block: int = _PASS_BLOCK, warps: int = _PASS_WARPS,
                 prefetch: bool = _PASS_PREFETCH) -> None:
    """`_state_pass_kernel` over every (row, head) and tile of its state (the tile, warps and
    prefetch are arguments for bench/ssd_scan.py's sweep; the model takes the defaults)."""
    batch, heads, chunks, state_size, head_dim = states.shape
    size = state_size * head_dim
    block = min(block, triton.next_power_of_2(size))
    _state_pass_kernel[(triton.cdiv(size, block), heads, batch)](
        states, totals, start if start is not None else end, end, heads, chunks, size,
        HAS_START=start is not None, REVERSE=reverse, PREFETCH=prefetch, BLOCK=block, num_warps=warps,
        enable_fp_fusion=_FP_FUSION,
    )


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
        y = new_buffer((batch, length, heads, head_dim), accumulate, u.device)
        last = new_buffer((batch, heads, state_size, head_dim), accumulate, u.device)
        states = new_buffer((batch, heads, chunks, state_size, head_dim), accumulate, u.device)
        totals = new_buffer((batch, heads, chunks), accumulate, u.device)
        shape = (length, chunks, heads, heads // groups, head_dim, state_size)
        tiles = _tile_arguments(dot_dtype, accumulate, chunk_len, head_dim, state_size)
        grid = (chunks * heads, batch)
        _chunk_contribution_kernel[grid](
            dt, A, B, u, states, totals, *_strides(dt, B, u), *shape, GRADIENT=False, num_warps=_WARPS, **tiles)
        _pass_states(states, totals, state0.contiguous() if state0 is not None else None, last, reverse=False)
        _chunk_output_kernel[grid](
            u, dt, A, B, C, states, y, *_strides(u, dt, B, C), *shape, num_warps=_WARPS, **tiles)
        ctx.save_for_backward(u, dt, A, B, C, states, totals)
        ctx.chunk_len, ctx.dot_dtype = chunk_len, dot_dtype
        ctx.state0_dtype = state0.dtype if state0 is not None else None
        ctx.set_materialize_grads(False)
        return y, last

    @staticmethod
    def backward(ctx, grad_y, grad_last):
        u, dt, A, B, C, states, totals = ctx.saved_tensors
        batch, length, heads, head_dim = u.shape
        groups, state_size = B.shape[2], B.shape[3]
        chunks = states.shape[2]
        accumulate = states.dtype
        chunk_len, dot_dtype = ctx.chunk_len, ctx.dot_dtype
        if grad_y is None:
            grad_y = torch.zeros(u.shape, dtype=accumulate, device=u.device)
        grad_y = _last_dim_contiguous(grad_y)
        grad_u = new_buffer(u.shape, u.dtype, u.device)
        grad_dt = new_buffer(dt.shape, dt.dtype, u.device)
        grad_A_parts = new_buffer((batch, heads, chunks), accumulate, u.device)
        grad_B_heads = new_buffer((batch, length, heads, state_size), accumulate, u.device)
        grad_C_heads = new_buffer((batch, length, heads, state_size), accumulate, u.device)
        grad_state0 = new_buffer((batch, heads, state_size, head_dim), accumulate, u.device)
        grad_states = new_buffer(states.shape, accumulate, u.device)
        shape = (length, chunks, heads, heads // groups, head_dim, state_size)
        tiles = _tile_arguments(dot_dtype, accumulate, chunk_len, head_dim, state_size)
        grid = (chunks * heads, batch)
        _chunk_contribution_kernel[grid](
            dt, A, C, grad_y, grad_states, totals, *_strides(dt, C, grad_y), *shape, GRADIENT=True,
            num_warps=_WARPS, **tiles)
        _pass_states(grad_states, totals, grad_last.contiguous() if grad_last is not None else None, grad_state0,
                     reverse=True)
        inputs = (u, dt, A, B, C, states, grad_states, grad_y)
        strides = _strides(u, dt, B, C, grad_y)
        _chunk_input_grad_kernel[grid](
            *inputs, grad_u, grad_dt, grad_A_parts, *strides, *shape, num_warps=_INPUT_GRAD_WARPS, **tiles)
        _chunk_map_grad_kernel[grid](
            *inputs, grad_B_heads, grad_C_heads, *strides, *shape, num_warps=_WARPS, **tiles)
        # A group's heads share its B and C: their per-head gradients summed in one fixed order.
        per_group = (batch, length, groups, heads // groups, state_size)
        grad_B = grad_B_heads.view(per_group).sum(3).to(B.dtype)
        grad_C = grad_C_heads.view(per_group).sum(3).to(C.dtype)
        grad_state0 = grad_state0.to(ctx.state0_dtype) if ctx.state0_dtype is not None else None
        return (grad_u, grad_dt, grad_A_parts.sum((0, 2)).to(A.dtype), grad_B, grad_C,
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
