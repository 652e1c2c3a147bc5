"""Selective scan (Mamba-style diagonal SSM) over a sequence, with a carried state.

    h_t[d, n] = exp(delta_t[d] A[d, n]) h_{t-1}[d, n] + delta_t[d] B_t[g(d), n] x_t[d]
    y_t[d]    = sum_n C_t[g(d), n] h_t[d, n] + D[d] x_t[d]

where channel d reads group g(d) = d // (Dm // G) of B and C. The state is kept in fp32
whatever the input dtype; y comes back in x's dtype, h_last in fp32 so that TBPTT chunks chain
(the scan of T equals the scan of T1 followed by the scan of T2 from the first's h_last).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._dispatch import compute_dtype, new_buffer, wants_triton

_CHUNK_T = 16
"""Time steps per chunk: the scan inside a chunk is a parallel (associative) scan; chunk-start
states are saved by the forward so the backward recomputes each chunk's states."""
_FORWARD_BLOCK_D = 16
"""Channels per forward program (all of one group, so B and C load once per time step)."""
_FORWARD_WARPS = 4
_BACKWARD_BLOCK_D = 16
"""Channels per backward program; dB and dC are summed over these blocks afterwards."""
_BACKWARD_WARPS = 4



def selective_scan_reference(
    x: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    h0: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan step by step in plain PyTorch autograd (the definition the kernel is tested against).

    x, delta (Bt, T, Dm); A (Dm, N); B, C (Bt, T, G, N); D (Dm,) or None; h0 (Bt, Dm, N) or None.
    Returns y (Bt, T, Dm) in x's dtype and h_last (Bt, Dm, N) in fp32 (fp64 for fp64 inputs).
    """
    batch, seq_len, channels = x.shape
    groups, state_size = B.shape[2], B.shape[3]
    if channels % groups:
        raise ValueError(f"selective_scan: Dm={channels} is not a multiple of G={groups}")
    dtype = compute_dtype(x, delta, A, B, C, D, h0)
    channels_per_group = channels // groups
    xf, deltaf, Af = x.to(dtype), delta.to(dtype), A.to(dtype)
    # Each channel reads its group's B and C: (Bt, T, G, N) -> (Bt, T, Dm, N); one group
    # broadcasts as it is.
    B_per_channel, C_per_channel = B.to(dtype), C.to(dtype)
    if groups > 1:
        B_per_channel = B_per_channel.repeat_interleave(channels_per_group, dim=2)
        C_per_channel = C_per_channel.repeat_interleave(channels_per_group, dim=2)
    h = h0.to(dtype) if h0 is not None else x.new_zeros(batch, channels, state_size, dtype=dtype)
    # Everything but the recurrence itself is computed for all steps at once, and the steps are
    # taken with unbind: indexing [:, t] in the loop makes autograd's backward scatter into a
    # full-size zero tensor at every step, which dominated training time on CPU.
    decays = torch.exp(deltaf[..., None] * Af).unbind(1)  # T x (Bt, Dm, N)
    drives = ((deltaf * xf)[..., None] * B_per_channel).unbind(1)  # T x (Bt, Dm, N)
    readouts = C_per_channel.unbind(1)  # T x (Bt, Dm or 1, N)
    outputs = []
    for decay, drive, readout in zip(decays, drives, readouts):
        h = decay * h + drive
        outputs.append((h * readout).sum(-1))  # (Bt, Dm)
    y = torch.stack(outputs, dim=1) if outputs else xf.new_zeros(batch, 0, channels)  # (Bt, T, Dm)
    if D is not None:
        y = y + D.to(dtype) * xf
    return y.to(x.dtype), h


@triton.jit
def _affine_combine(decay_left, drive_left, decay_right, drive_right):
    """Compose h -> decay h + drive maps: apply the left map first, then the right one."""
    return decay_left * decay_right, decay_right * drive_left + drive_right


@triton.jit
def _chunk_states(
    x_ptr, delta_ptr, B_ptr, A_tile, h_start, batch, group, channel, channel_ok, n, n_ok, t0,
    seq_len, channels, groups, state_size, CHUNK_T: tl.constexpr,
):
    """Loads a chunk's inputs and runs its scan from h_start.

    Returns times (CHUNK_T,), the mask of rows inside the sequence, x and delta (CHUNK_T, BLOCK_D)
    in fp32, B (CHUNK_T, N_PAD), and the per-step decay, drive and states (CHUNK_T, BLOCK_D, N_PAD).
    """
    times = t0 + tl.arange(0, CHUNK_T)
    time_ok = times < seq_len
    row = (batch.to(tl.int64) * seq_len + times.to(tl.int64))  # (CHUNK_T,)
    mask = time_ok[:, None] & channel_ok[None, :]
    offsets = row[:, None] * channels + channel[None, :]  # (CHUNK_T, BLOCK_D)
    xs = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    deltas = tl.load(delta_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    bc_offsets = (row[:, None] * groups + group) * state_size + n[None, :]  # (CHUNK_T, N_PAD)
    bc_mask = time_ok[:, None] & n_ok[None, :]
    Bs = tl.load(B_ptr + bc_offsets, mask=bc_mask, other=0.0).to(tl.float32)
    # Rows past the end decay by 1 and add 0, so the state after them is the last real state.
    decay = tl.exp(deltas[:, :, None] * A_tile[None, :, :])  # (CHUNK_T, BLOCK_D, N_PAD)
    decay = tl.where(time_ok[:, None, None], decay, 1.0)
    drive = (deltas * xs)[:, :, None] * Bs[:, None, :]
    decay_to, drive_to = tl.associative_scan((decay, drive), 0, _affine_combine)
    states = decay_to * h_start[None, :, :] + drive_to
    return times, time_ok, offsets, bc_offsets, bc_mask, xs, deltas, Bs, decay, drive, states


@triton.jit
def _selective_scan_forward_kernel(
    x_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, h0_ptr, y_ptr, h_last_ptr, chunk_start_ptr,
    seq_len, channels, groups, per_group, state_size, chunks,
    HAS_D: tl.constexpr, HAS_H0: tl.constexpr,
    BLOCK_D: tl.constexpr, N_PAD: tl.constexpr, CHUNK_T: tl.constexpr,
):
    batch = tl.program_id(0)
    group = tl.program_id(1)
    within = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    channel = group * per_group + within  # (BLOCK_D,)
    channel_ok = within < per_group
    n = tl.arange(0, N_PAD)
    n_ok = n < state_size
    state_mask = channel_ok[:, None] & n_ok[None, :]
    state_offsets = channel[:, None] * state_size + n[None, :]  # (BLOCK_D, N_PAD)
    A_tile = tl.load(A_ptr + state_offsets, mask=state_mask, other=0.0).to(tl.float32)
    batch_state = batch.to(tl.int64) * channels * state_size
    if HAS_H0:
        h = tl.load(h0_ptr + batch_state + state_offsets, mask=state_mask, other=0.0)
    else:
        h = tl.zeros([BLOCK_D, N_PAD], dtype=tl.float32)
    if HAS_D:
        D_vec = tl.load(D_ptr + channel, mask=channel_ok, other=0.0).to(tl.float32)
    rows = tl.arange(0, CHUNK_T)
    for chunk in range(0, chunks):
        chunk_state = (batch.to(tl.int64) * chunks + chunk) * channels * state_size
        tl.store(chunk_start_ptr + chunk_state + state_offsets, h, mask=state_mask)
        times, time_ok, offsets, bc_offsets, bc_mask, xs, deltas, Bs, decay, drive, states = _chunk_states(
            x_ptr, delta_ptr, B_ptr, A_tile, h, batch, group, channel, channel_ok, n, n_ok,
            chunk * CHUNK_T, seq_len, channels, groups, state_size, CHUNK_T,
        )
        Cs = tl.load(C_ptr + bc_offsets, mask=bc_mask, other=0.0).to(tl.float32)  # (CHUNK_T, N_PAD)
        ys = tl.sum(states * Cs[:, None, :], axis=2)  # (CHUNK_T, BLOCK_D)
        if HAS_D:
            ys += D_vec[None, :] * xs
        mask = time_ok[:, None] & channel_ok[None, :]
        tl.store(y_ptr + offsets, ys.to(y_ptr.dtype.element_ty), mask=mask)
        h = tl.sum(tl.where(rows[:, None, None] == CHUNK_T - 1, states, 0.0), axis=0)
    tl.store(h_last_ptr + batch_state + state_offsets, h, mask=state_mask)


@triton.jit
def _selective_scan_backward_kernel(
    x_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, chunk_start_ptr, grad_y_ptr, grad_h_last_ptr,
    grad_x_ptr, grad_delta_ptr, grad_A_ptr, grad_B_ptr, grad_C_ptr, grad_D_ptr, grad_h0_ptr,
    batches, seq_len, channels, groups, per_group, state_size, chunks,
    HAS_D: tl.constexpr, HAS_GRAD_H_LAST: tl.constexpr,
    BLOCK_D: tl.constexpr, N_PAD: tl.constexpr, CHUNK_T: tl.constexpr,
):
    batch = tl.program_id(0)
    group = tl.program_id(1)
    block = tl.program_id(2)
    within = block * BLOCK_D + tl.arange(0, BLOCK_D)
    channel = group * per_group + within  # (BLOCK_D,)
    channel_ok = within < per_group
    n = tl.arange(0, N_PAD)
    n_ok = n < state_size
    state_mask = channel_ok[:, None] & n_ok[None, :]
    state_offsets = channel[:, None] * state_size + n[None, :]  # (BLOCK_D, N_PAD)
    A_tile = tl.load(A_ptr + state_offsets, mask=state_mask, other=0.0).to(tl.float32)
    batch_state = batch.to(tl.int64) * channels * state_size
    # carry: dL/dh at the last row of the chunk from everything after it.
    if HAS_GRAD_H_LAST:
        carry = tl.load(grad_h_last_ptr + batch_state + state_offsets, mask=state_mask, other=0.0)
    else:
        carry = tl.zeros([BLOCK_D, N_PAD], dtype=tl.float32)
    if HAS_D:
        D_vec = tl.load(D_ptr + channel, mask=channel_ok, other=0.0).to(tl.float32)
    grad_A = tl.zeros([BLOCK_D, N_PAD], dtype=tl.float32)
    grad_D = tl.zeros([BLOCK_D], dtype=tl.float32)
    rows = tl.arange(0, CHUNK_T)
    for chunk_back in range(0, chunks):
        chunk = chunks - 1 - chunk_back
        t0 = chunk * CHUNK_T
        chunk_state = (batch.to(tl.int64) * chunks + chunk) * channels * state_size
        h_start = tl.load(chunk_start_ptr + chunk_state + state_offsets, mask=state_mask, other=0.0)
        times, time_ok, offsets, bc_offsets, bc_mask, xs, deltas, Bs, decay, drive, states = _chunk_states(
            x_ptr, delta_ptr, B_ptr, A_tile, h_start, batch, group, channel, channel_ok, n, n_ok,
            t0, seq_len, channels, groups, state_size, CHUNK_T,
        )
        mask = time_ok[:, None] & channel_ok[None, :]
        Cs = tl.load(C_ptr + bc_offsets, mask=bc_mask, other=0.0).to(tl.float32)  # (CHUNK_T, N_PAD)
        grad_ys = tl.load(grad_y_ptr + offsets, mask=mask, other=0.0).to(tl.float32)  # (CHUNK_T, BLOCK_D)
        # The adjoint g_t = dL/dh_t runs backwards: g_t = C_t gy_t + decay_{t+1} g_{t+1}. Row t of
        # the reverse scan pairs decay_{t+1} (1 past the chunk or the sequence) with C_t gy_t;
        # the carry from the next chunk enters at the last row.
        next_ok = (rows < CHUNK_T - 1) & (times + 1 < seq_len)
        next_mask = next_ok[:, None] & channel_ok[None, :]
        deltas_next = tl.load(delta_ptr + offsets + channels, mask=next_mask, other=0.0).to(tl.float32)
        decay_next = tl.exp(deltas_next[:, :, None] * A_tile[None, :, :])
        decay_next = tl.where(next_ok[:, None, None], decay_next, 1.0)
        local = grad_ys[:, :, None] * Cs[:, None, :]  # (CHUNK_T, BLOCK_D, N_PAD)
        local += tl.where(rows[:, None, None] == CHUNK_T - 1, carry[None, :, :], 0.0)
        _, adjoint = tl.associative_scan((decay_next, local), 0, _affine_combine, reverse=True)
        adjoint = tl.where(time_ok[:, None, None], adjoint, 0.0)
        # decay_t h_{t-1} = h_t - drive_t: the state before each step without a shifted scan.
        carried = states - drive
        through_decay = A_tile[None, :, :] * carried
        through_drive = xs[:, :, None] * Bs[:, None, :]
        grad_deltas = tl.sum(adjoint * (through_decay + through_drive), axis=2)
        grad_xs = tl.sum(adjoint * Bs[:, None, :], axis=2) * deltas
        if HAS_D:
            grad_xs += D_vec[None, :] * grad_ys
            grad_D += tl.sum(grad_ys * xs, axis=0)
        tl.store(grad_x_ptr + offsets, grad_xs.to(grad_x_ptr.dtype.element_ty), mask=mask)
        tl.store(grad_delta_ptr + offsets, grad_deltas.to(grad_delta_ptr.dtype.element_ty), mask=mask)
        grad_A += tl.sum(adjoint * deltas[:, :, None] * carried, axis=0)
        # This block's share of dB and dC (summed over blocks on the host side, in a fixed order).
        partial_offsets = block.to(tl.int64) * batches * seq_len * groups * state_size + bc_offsets
        grad_Bs = tl.sum(adjoint * (deltas * xs)[:, :, None], axis=1)  # (CHUNK_T, N_PAD)
        grad_Cs = tl.sum(grad_ys[:, :, None] * states, axis=1)
        tl.store(grad_B_ptr + partial_offsets, grad_Bs, mask=bc_mask)
        tl.store(grad_C_ptr + partial_offsets, grad_Cs, mask=bc_mask)
        carry = tl.sum(tl.where(rows[:, None, None] == 0, decay * adjoint, 0.0), axis=0)
    tl.store(grad_h0_ptr + batch_state + state_offsets, carry, mask=state_mask)
    tl.store(grad_A_ptr + batch_state + state_offsets, grad_A, mask=state_mask)
    if HAS_D:
        tl.store(grad_D_ptr + batch.to(tl.int64) * channels + channel, grad_D, mask=channel_ok)


def _launch_grid(batch: int, groups: int, per_group: int, block_d: int) -> tuple[int, int, int]:
    return (batch, groups, triton.cdiv(per_group, block_d))


class _SelectiveScan(torch.autograd.Function):
    """The Triton forward (saving chunk-start states) and backward (recomputing chunk states)."""

    @staticmethod
    def forward(ctx, x, delta, A, B, C, D, h0):
        batch, seq_len, channels = x.shape
        groups, state_size = B.shape[2], B.shape[3]
        per_group = channels // groups
        chunks = triton.cdiv(seq_len, _CHUNK_T)
        x, delta, A, B, C = (t.contiguous() for t in (x, delta, A, B, C))
        D = D.contiguous() if D is not None else None
        h0 = h0.contiguous().float() if h0 is not None else None
        y = new_buffer(x.shape, x.dtype, x.device)
        h_last = new_buffer((batch, channels, state_size), torch.float32, x.device)
        chunk_start = new_buffer((batch, chunks, channels, state_size), torch.float32, x.device)
        if seq_len == 0:
            h_last.copy_(h0 if h0 is not None else torch.zeros_like(h_last))
        else:
            _selective_scan_forward_kernel[_launch_grid(batch, groups, per_group, _FORWARD_BLOCK_D)](
                x, delta, A, B, C, D if D is not None else x, h0 if h0 is not None else h_last,
                y, h_last, chunk_start,
                seq_len, channels, groups, per_group, state_size, chunks,
                HAS_D=D is not None, HAS_H0=h0 is not None,
                BLOCK_D=_FORWARD_BLOCK_D, N_PAD=triton.next_power_of_2(state_size), CHUNK_T=_CHUNK_T,
                num_warps=_FORWARD_WARPS,
            )
        ctx.save_for_backward(x, delta, A, B, C, D, chunk_start)
        ctx.has_h0 = h0 is not None
        ctx.set_materialize_grads(False)
        return y, h_last

    @staticmethod
    def backward(ctx, grad_y, grad_h_last):
        x, delta, A, B, C, D, chunk_start = ctx.saved_tensors
        batch, seq_len, channels = x.shape
        groups, state_size = B.shape[2], B.shape[3]
        per_group = channels // groups
        chunks = chunk_start.shape[1]
        blocks = triton.cdiv(per_group, _BACKWARD_BLOCK_D)
        grad_y = grad_y.contiguous() if grad_y is not None else torch.zeros_like(x)
        grad_x = new_buffer(x.shape, x.dtype, x.device)
        grad_delta = new_buffer(delta.shape, delta.dtype, delta.device)
        grad_A = new_buffer((batch, channels, state_size), torch.float32, x.device)
        grad_B = new_buffer((blocks, *B.shape), torch.float32, x.device)
        grad_C = new_buffer((blocks, *C.shape), torch.float32, x.device)
        grad_D = new_buffer((batch, channels), torch.float32, x.device)
        grad_h0 = new_buffer((batch, channels, state_size), torch.float32, x.device)
        if seq_len == 0:
            grad_h0.copy_(grad_h_last if grad_h_last is not None else torch.zeros_like(grad_h0))
            for partial in (grad_A, grad_B, grad_C, grad_D):
                partial.zero_()
        else:
            _selective_scan_backward_kernel[_launch_grid(batch, groups, per_group, _BACKWARD_BLOCK_D)](
                x, delta, A, B, C, D if D is not None else x, chunk_start, grad_y,
                grad_h_last.contiguous() if grad_h_last is not None else x,
                grad_x, grad_delta, grad_A, grad_B, grad_C, grad_D, grad_h0,
                batch, seq_len, channels, groups, per_group, state_size, chunks,
                HAS_D=D is not None, HAS_GRAD_H_LAST=grad_h_last is not None,
                BLOCK_D=_BACKWARD_BLOCK_D, N_PAD=triton.next_power_of_2(state_size), CHUNK_T=_CHUNK_T,
                num_warps=_BACKWARD_WARPS,
            )
        # Partials over batch rows and channel blocks are summed here in a fixed order (no atomics).
        return (
            grad_x,
            grad_delta,
            grad_A.sum(0).to(A.dtype),
            grad_B.sum(0).to(B.dtype),
            grad_C.sum(0).to(C.dtype),
            grad_D.sum(0).to(D.dtype) if D is not None else None,
            grad_h0 if ctx.has_h0 else None,
        )


def selective_scan(
    x: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    h0: torch.Tensor | None = None,
    *,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan (see the module docstring): Triton on CUDA, the reference elsewhere.

    use_triton: None picks Triton on CUDA; True forces it (off CUDA only under
    TRITON_INTERPRET=1); False forces the reference.
    """
    if wants_triton(x, use_triton):
        if x.shape[2] % B.shape[2]:
            raise ValueError(f"selective_scan: Dm={x.shape[2]} is not a multiple of G={B.shape[2]}")
        return _SelectiveScan.apply(x, delta, A, B, C, D, h0)
    return selective_scan_reference(x, delta, A, B, C, D, h0)
