"""Selective scan (Mamba-style diagonal SSM) over a sequence, with a carried state.

    h_t[d, n] = exp(delta_t[d] A[d, n]) h_{t-1}[d, n] + delta_t[d] B_t[g(d), n] x_t[d]
    y_t[d]    = sum_n C_t[g(d), n] h_t[d, n] + D[d] x_t[d]

where channel d reads group g(d) = d // (Dm // G) of B and C. The state is kept in fp32
whatever the input dtype; y comes back in x's dtype, h_last in fp32 so that TBPTT chunks chain
(the scan of T equals the scan of T1 followed by the scan of T2 from the first's h_last).

The kernels walk time in chunks of _CHUNK_T steps. A program owns a block of channels of one
batch row; its tiles are (CHUNK_T, N, channels) with each thread holding the chunk's time steps
and a few of one channel's N states in its registers, so the scan along time and most of the
sum over N stay inside a thread (no shuffles), and every load and store in the loop runs along
channels, the contiguous axis. That is why the state-shaped buffers inside (A, h0, h_last, the
saved chunk starts) are (N, Dm)-major here. `tl.range(..., num_stages=S)` keeps the next
chunks' loads in flight. The forward saves the state entering each chunk (only when a gradient
is wanted); the backward recomputes each chunk's states from it and runs the adjoint's reverse
scan. For few rows both directions run segments of time at once (`_forward_segment_chunks`,
kernels/selective_scan_backward.py). The scan is not memory bound: N exponentials a step and
channel (16 in every preset) for its 12 bytes of x, delta and y put its floor on the exponential
units (bench/kernels.py reports that floor as exp_floor_ms).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._dispatch import compute_dtype, new_buffer, wants_triton
from kernels._scan_tiles import (
    LOG2_E,
    chunk_addresses,
    chunk_start_mask,
    chunk_states,
    is_even,
    load_f32,
    program_tile,
    segment_carries_kernel,
    store_masked,
    take_last,
)
from kernels.selective_scan_backward import scan_backward

_CHUNK_T = 8
"""Time steps per chunk: 16-step chunks make the forward a little faster, but the backward's
chunk tiles then spill registers and forward + backward is slower (`python bench/kernels.py
--sweep --only scan`). Tuned for N = 16 (every preset has N <= 16): at N = 32 the backward's
tiles spill (sm_90), at N = 64 both directions do; 4 and 2 steps a chunk would not, but would
save 2x and 4x the chunk starts (T / CHUNK_T x N floats a channel and row). Not measured."""
_FORWARD_STAGES = 5
"""Chunks whose loads are in flight in the forward (one warp, 16 channels, the chunk above):
fewer stages leave the memory's latency showing, while 4 to 6 run alike."""


_FORWARD_SEGMENT_CHUNKS = (8, 64)
"""The fewest and the most chunks a forward segment when the forward is split along time: a
quarter of the row between the two (`_forward_segment_chunks`)."""


def _forward_block_d(batch: int, channels: int) -> int:
    """Channels per forward program (one warp): 16 (2 threads a channel, 8 states each) when there
    are many rows (Bt x Dm >= 8192); 8 (4 threads a channel) when few, for twice the programs to
    hide the memory's latency."""
    return 16 if batch * channels >= 8192 else 8


def _forward_segment_chunks(batch: int, channels: int, chunks: int) -> int:
    """Chunks per forward segment. With few rows one program a channel block walking all of T
    leaves too few programs to hide their latency (Bt 1 x Dm 1024: 128 programs), so a sequence of
    32 chunks or more then runs in segments of a quarter of it (within _FORWARD_SEGMENT_CHUNKS'
    bounds) at once, for twice the exponentials (the flow pass computes them too). Segments only
    when Bt x Dm <= 2048 (the backward's threshold), one segment otherwise; a row under 32 chunks
    gains too little from segments, and a segment longer than the row walks masked chunks
    (`python bench/kernels.py --sweep --only scan_segments`)."""
    if batch * channels > 2048 or chunks < 32:
        return max(chunks, 1)
    shortest, longest = _FORWARD_SEGMENT_CHUNKS
    return min(longest, max(shortest, chunks // 4))


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
def _selective_scan_forward_kernel(
    x_ptr, delta_ptr, A_T_ptr, B_ptr, C_ptr, D_ptr, h_start_ptr, y_ptr, h_end_ptr, gain_ptr, chunk_start_ptr,
    seq_len, chunks, segments, segment_chunks, log2_e,
    channels: tl.constexpr, groups: tl.constexpr, state_size: tl.constexpr,
    HAS_D: tl.constexpr, HAS_START: tl.constexpr, SAVE: tl.constexpr, FLOW: tl.constexpr, EVEN: tl.constexpr,
    BLOCK_D: tl.constexpr, N_PAD: tl.constexpr, CHUNK_T: tl.constexpr, STAGES: tl.constexpr,
):
    """One time segment of segment_chunks chunks (all of T when there is one segment) for a block of
    channels, from the state entering it (h_start, (Bt, segments, N, Dm); zero without HAS_START)
    to the state leaving it (h_end, the same shape). FLOW: the pass that chains segments; it writes
    no y, only the segment's end state from a zero start and its decays' product (gain)."""
    batch = tl.program_id(0)
    segment = tl.program_id(2)
    group, block, within, channel, channel_ok, n, n_ok, state_mask, state_offsets = program_tile(
        channels, groups, state_size, BLOCK_D, N_PAD)
    # exp(delta A) as exp2(delta A log2 e): the multiply folded into A once.
    A2 = tl.load(A_T_ptr + state_offsets, mask=state_mask, other=0.0).to(tl.float32) * log2_e
    segment_state = (batch.to(tl.int64) * segments + segment) * channels * state_size + state_offsets
    if HAS_START:
        h = tl.load(h_start_ptr + segment_state, mask=state_mask, other=0.0)
    else:
        h = tl.zeros([N_PAD, BLOCK_D], dtype=tl.float32)
    if HAS_D:
        D_vec = tl.load(D_ptr + channel, mask=channel_ok, other=0.0).to(tl.float32)
    total_delta = tl.zeros([BLOCK_D], dtype=tl.float32)
    first_row = batch.to(tl.int64) * seq_len
    chunk_base = chunk_start_ptr + batch.to(tl.int64) * chunks * channels * state_size + state_offsets
    for local in tl.range(0, segment_chunks, num_stages=STAGES):
        chunk = segment * segment_chunks + local
        if SAVE:  # the state entering the chunk, for the backward (none past the last chunk)
            if EVEN:
                tl.store(chunk_base + chunk * channels * state_size, h)
            else:
                saved = chunk_start_mask(chunk, chunks, within, n_ok, channels // groups)
                tl.store(chunk_base + chunk * channels * state_size, h, mask=saved)
        offsets, bc, mask, bc_mask = chunk_addresses(
            chunk, first_row, seq_len, channel, channel_ok, group, n, n_ok, channels, groups, state_size, CHUNK_T)
        xs = load_f32(x_ptr + offsets, mask, EVEN)  # EVEN: no ragged edge anywhere, no masks
        deltas = load_f32(delta_ptr + offsets, mask, EVEN)
        Bs = load_f32(B_ptr + bc, bc_mask, EVEN)
        # Rows past the end have delta 0: decay 1 and drive 0 keep the last real state.
        decay = tl.exp2(deltas[:, None, :] * A2[None, :, :])  # (CHUNK_T, N_PAD, BLOCK_D)
        states = chunk_states(decay, Bs[:, :, None] * (deltas * xs)[:, None, :], h, CHUNK_T)
        if FLOW:
            total_delta += tl.sum(deltas, axis=0)
        else:
            Cs = load_f32(C_ptr + bc, bc_mask, EVEN)
            ys = tl.sum(states * Cs[:, :, None], axis=1)  # (CHUNK_T, BLOCK_D)
            if HAS_D:
                ys += D_vec[None, :] * xs
            store_masked(y_ptr + offsets, ys, mask, EVEN)
        h = tl.reduce(states, 0, take_last)  # the chunk's last row: a register, no arithmetic
    tl.store(h_end_ptr + segment_state, h, mask=state_mask)
    if FLOW:  # exp(A x the segment's summed deltas): how its entering state reaches its end
        tl.store(gain_ptr + segment_state, tl.exp2(total_delta[None, :] * A2), mask=state_mask)


def _scan_forward(
    x: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: torch.Tensor | None, h0: torch.Tensor | None, save: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward kernel on contiguous x, delta, B, C: y, h_last (Bt, Dm, N) and, with save, the
    state entering each chunk (Bt, chunks, N, Dm) for the backward (else an empty buffer). With
    few rows, time runs in segments at once (`_forward_segment_chunks`): a flow pass finds each
    segment's end state from a zero start and its decays' product, a short sequential pass over
    segments turns those into each segment's entering state, and the main pass runs every segment
    from its own."""
    batch, seq_len, channels = x.shape
    groups, state_size = B.shape[2], B.shape[3]
    per_group = channels // groups
    chunks = triton.cdiv(seq_len, _CHUNK_T)
    # The state-shaped buffers the kernels read and write are (N, Dm)-major (module docstring).
    A_T = A.t().contiguous()
    h0_T = h0.float().transpose(1, 2).contiguous() if h0 is not None else None
    y = new_buffer(x.shape, x.dtype, x.device)
    chunk_start_T = new_buffer((batch, chunks if save else 0, state_size, channels), torch.float32, x.device)
    if seq_len == 0:
        h_last_T = h0_T if h0_T is not None else torch.zeros(batch, state_size, channels, device=x.device)
        return y, h_last_T.transpose(1, 2).contiguous(), chunk_start_T
    block_d = _forward_block_d(batch, channels)
    blocks = triton.cdiv(per_group, block_d)
    segment_chunks = _forward_segment_chunks(batch, channels, chunks)
    segments = triton.cdiv(chunks, segment_chunks)
    h_end_T = new_buffer((batch, segments, state_size, channels), torch.float32, x.device)
    h_start_T = h0_T  # (Bt, N, Dm) is the one segment's (Bt, 1, N, Dm)
    shape = dict(channels=channels, groups=groups, state_size=state_size, HAS_D=D is not None,
                 EVEN=chunks % segment_chunks == 0 and is_even(seq_len, _CHUNK_T, per_group, block_d, state_size),
                 BLOCK_D=block_d, N_PAD=triton.next_power_of_2(state_size), CHUNK_T=_CHUNK_T,
                 STAGES=_FORWARD_STAGES, num_warps=1)
    D_arg = D if D is not None else x
    if segments > 1:
        # 1. Each segment but the last from a zero start: its end state and its decays' product.
        flow = new_buffer((batch, segments, state_size, channels), torch.float32, x.device)
        gain = new_buffer((batch, segments, state_size, channels), torch.float32, x.device)
        _selective_scan_forward_kernel[(batch, groups * blocks, segments - 1)](
            x, delta, A_T, B, C, D_arg, flow, y, flow, gain, flow, seq_len, chunks, segments, segment_chunks,
            LOG2_E, HAS_START=False, SAVE=False, FLOW=True, **shape,
        )
        # 2. The state entering each segment (sequential over segments, short).
        h_start_T = new_buffer((batch, segments, state_size, channels), torch.float32, x.device)
        state_elements = state_size * channels
        segment_carries_kernel[(batch, triton.cdiv(state_elements, 1024))](
            flow, gain, h0_T if h0_T is not None else flow, h_start_T, segments, state_elements,
            HAS_INITIAL=h0_T is not None, FORWARD=True, BLOCK=1024, num_warps=4,
        )
    # 3. Every segment at once from its entering state.
    _selective_scan_forward_kernel[(batch, groups * blocks, segments)](
        x, delta, A_T, B, C, D_arg, h_start_T if h_start_T is not None else h_end_T, y, h_end_T, h_end_T,
        chunk_start_T if save else h_end_T, seq_len, chunks, segments, segment_chunks, LOG2_E,
        HAS_START=h_start_T is not None, SAVE=save, FLOW=False, **shape,
    )
    return y, h_end_T[:, -1].transpose(1, 2).contiguous(), chunk_start_T


class _SelectiveScan(torch.autograd.Function):
    """The Triton forward (saving chunk-start states) and backward (recomputing each chunk's
    states from them)."""

    @staticmethod
    def forward(ctx, x, delta, A, B, C, D, h0):
        x, delta, B, C = (t.contiguous() for t in (x, delta, B, C))
        D = D.contiguous() if D is not None else None
        y, h_last, chunk_start_T = _scan_forward(x, delta, A, B, C, D, h0, save=True)
        ctx.save_for_backward(x, delta, A, B, C, D, chunk_start_T)
        ctx.has_h0 = h0 is not None
        ctx.set_materialize_grads(False)
        return y, h_last

    @staticmethod
    def backward(ctx, grad_y, grad_h_last):
        x, delta, A, B, C, D, chunk_start_T = ctx.saved_tensors
        return scan_backward(x, delta, A, B, C, D, chunk_start_T, grad_y, grad_h_last, _CHUNK_T, ctx.has_h0)


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
        inputs = (x, delta, A, B, C, D, h0)
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
            return _SelectiveScan.apply(*inputs)
        # No gradient wanted (validation, generation): no chunk starts to save.
        y, h_last, _ = _scan_forward(x.contiguous(), delta.contiguous(), A, B.contiguous(), C.contiguous(),
                                     D.contiguous() if D is not None else None, h0, save=False)
        return y, h_last
    return selective_scan_reference(x, delta, A, B, C, D, h0)
