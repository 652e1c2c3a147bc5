"""PSSA's selective scan: `h_ij <- exp(delta_i A_ij) h_ij + delta_i B_j x_i`, `y_i = sum_j C_j h_ij`.

On CUDA the Triton kernel (`kernels.selective_scan`) runs it. On the CPU `_NativeScan` does (the
C loops of `native`, the same arithmetic, when the host's compiler builds them), else `_CpuScan`,
with a hand-written backward: autograd through the step-by-step definition records several nodes a
token (the reference's 64 steps cost more than all of a pssa-1.5m block's matrices), while here
the work is a few tensor operations per block of `TIME_BLOCK` tokens and one fused multiply-add
per token and direction.

The state-sized work (decays, states, adjoints: L x B x N x d numbers, 8 MiB a chunk of
pssa-1.5m) is memory bound on a CPU, so it runs block by block in time: a block's decays,
states and adjoints are made, used and done with while they are in the cache, instead of one
pass over the whole chunk per operation. Inside, time leads and channels are innermost
(L, B, N, d): a token's state is one contiguous slice, and the batched matrix-vector products
against B and C run in the orientation the CPU BLAS does fast (one thread: 45 us a block of y
against 217 us in the (d, N) layout).

Forward, per block: `decay = exp2(delta A log2 e)` (exp2 is several times faster than exp on
the CPU), `drive = (delta x) B`, the recurrence `h_t = decay_t h_{t-1} + drive_t` one token at a
time, `y_t = C_t h_t`. Of the states only each block's first (the state before its first token)
is kept for the backward, which makes the block's decays and states again from it. Keeping every
state instead meant writing a chunk's 8 MiB of states to fresh memory in each forward (its page
faults included) and reading them back: measured on pssa-1.5m's scan (8 rows of 64 tokens, one
thread, a loaded 2-core machine), the forward ran 1.9 ms faster this way (4.6 -> 2.7 ms) and the
backward about 0.3 ms slower; a chunk's saved tensors are 8 MiB smaller. A forward without a
gradient runs the same blocks and saves nothing.

Backward, per block from the last, with the block's decays and states: the states' adjoint
`lam_t = gy_t C_t + decay_{t+1} lam_{t+1}` (the reverse recurrence, entering the chunk's last
token with the carry's gradient), then what is local to a token: `g(delta x)_i = sum_j lam_ji B_j`,
`g B_j = sum_i lam_ji (delta x)_i`, `g C_j = sum_i gy_i h_ji`, and through the decay
`r = lam_t h_{t-1} decay_t`: `g delta_i += sum_j r_ji A_ji`, `g A_ji += sum_t r_ji delta_i`. A
decay enters only as one token's exp(delta A) <= 1, never as a product over tokens or its
inverse, so nothing overflows or underflows for any time constant (tests hold the scan to the
step-by-step definition in float64 to 1e-12, forward and gradients, with time constants from
0.02 to 20,000 tokens).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.models.pssa import native
from kernels._dispatch import compute_dtype
from kernels.selective_scan import selective_scan

LOG2_E = 1.4426950408889634
"""log2(e): exp(v) = exp2(v log2 e)."""
TIME_BLOCK = 8
"""Tokens per block of the CPU scan: a block's decays or states of pssa-1.5m (8 rows x 16 states
x 256 channels) are 1 MiB, which the caches hold beside the block's other tensors; 16 ran
alike and 32 slower (`bench/models_cpu.py`-sized scan, one thread), 4 pays more operations."""


def pssa_scan(
    x: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    h0: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta (Bt, L, d); A (d, N); B, C (Bt, L, N), one group shared by every channel; h0
    (Bt, d, N) or None -> y (Bt, L, d) in x's dtype and the last state (Bt, d, N) in float32
    (float64 for float64 inputs)."""
    if x.is_cuda:
        return selective_scan(x, delta, A, B.unsqueeze(2), C.unsqueeze(2), None, h0)
    if A.shape[1] <= native.MAX_STATES and native.library(TIME_BLOCK) is not None:
        return _NativeScan.apply(x, delta, A, B, C, h0)
    return _CpuScan.apply(x, delta, A, B, C, h0)


def _time_major(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(Bt, L, ...) -> contiguous (L, Bt, ...) in dtype."""
    return t.transpose(0, 1).to(dtype).contiguous()


def _blocks(length: int) -> list[tuple[int, int]]:
    return [(start, min(start + TIME_BLOCK, length)) for start in range(0, length, TIME_BLOCK)]


def _decays(steps: torch.Tensor, rates_log2: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """A block's exp(delta A) = exp2(delta A log2 e): steps (n, Bt, d), rates_log2 (N, d) ->
    (n, Bt, N, d) in the first n rows of buffer."""
    decay = buffer[: steps.shape[0]]
    torch.mul(steps[:, :, None, :], rates_log2, out=decay)
    return torch.exp2(decay, out=decay)


def _states(
    inputs: torch.Tensor, B_t: torch.Tensor, decay: torch.Tensor, first: torch.Tensor, buffer: torch.Tensor
) -> torch.Tensor:
    """A block's states (n, Bt, N, d) in the first n rows of buffer, from its inputs (n, Bt, d)
    = delta x, B_t (n, Bt, N), decays (n, Bt, N, d) and the state before it, first (Bt, N, d)."""
    states = buffer[: inputs.shape[0]]
    torch.mul(inputs[:, :, None, :], B_t[:, :, :, None], out=states)
    last = first
    for state, step_decay in zip(states.unbind(0), decay.unbind(0)):
        # h_t = drive_t + decay_t h_{t-1}: the step-by-step definition's multiply-add.
        last = state.addcmul_(step_decay, last)
    return states


class _CpuScan(torch.autograd.Function):
    """The scan's CPU forward and hand-written backward (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x, delta, A, B, C, h0):  # noqa: ANN001, ANN205 (autograd's signature)
        dtype = compute_dtype(x, delta, A, B, C, h0)
        batch, length, channels = x.shape
        states_n = A.shape[1]
        steps = _time_major(delta, dtype)  # (L, Bt, d)
        inputs = steps * _time_major(x, dtype)  # (L, Bt, d): delta x
        rates = A.t().to(dtype).contiguous()  # (N, d)
        rates_log2 = rates * LOG2_E  # exp(delta A) = exp2(delta A log2 e): exp2 is the faster
        B_t, C_t = _time_major(B, dtype), _time_major(C, dtype)  # (L, Bt, N)
        blocks = _blocks(length)
        span = min(length, TIME_BLOCK)
        decay = x.new_empty((span, batch, states_n, channels), dtype=dtype)
        states = torch.empty_like(decay)
        # Each block's first state, (blocks, Bt, N, d): the backward starts its blocks from them.
        firsts = x.new_empty((len(blocks), batch, states_n, channels), dtype=dtype)
        if h0 is not None:
            firsts[0].copy_(h0.transpose(1, 2))
        else:
            firsts[0].zero_()
        y = x.new_empty((length, batch, channels), dtype=dtype)
        for index, (start, stop) in enumerate(blocks):
            block_decay = _decays(steps[start:stop], rates_log2, decay)
            block_states = _states(inputs[start:stop], B_t[start:stop], block_decay, firsts[index], states)
            rows = (stop - start) * batch
            torch.bmm(C_t[start:stop].view(rows, 1, states_n), block_states.view(rows, states_n, channels),
                      out=y[start:stop].view(rows, 1, channels))  # fmt: skip
            if index + 1 < len(blocks):
                firsts[index + 1].copy_(block_states[-1])
        h_last = block_states[-1].transpose(1, 2).clone()  # (Bt, d, N)
        if any(ctx.needs_input_grad):
            ctx.save_for_backward(steps, inputs, x, rates, B_t, C_t, firsts)
            ctx.h0_given = h0 is not None
            ctx.input_dtypes = (x.dtype, delta.dtype, A.dtype, B.dtype, C.dtype, h0.dtype if h0 is not None else None)
        ctx.set_materialize_grads(False)
        return y.transpose(0, 1).to(x.dtype), h_last

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor | None, grad_last: torch.Tensor | None):  # noqa: ANN205
        steps, inputs, x, rates, B_t, C_t, firsts = ctx.saved_tensors
        length, batch, channels = steps.shape
        states_n = rates.shape[0]
        dtype = steps.dtype
        gy = _time_major(grad_y, dtype) if grad_y is not None else steps.new_zeros(steps.shape)
        g_inputs = torch.empty_like(inputs)  # (L, Bt, d): g(delta x)
        g_steps = torch.empty_like(steps)  # (L, Bt, d): g delta through the decays
        g_B, g_C = torch.empty_like(B_t), torch.empty_like(C_t)  # (L, Bt, N)
        g_rates = torch.zeros_like(rates)  # (N, d)
        span = min(length, TIME_BLOCK)
        adjoint = steps.new_empty((span, batch, states_n, channels))
        work, decay, states = torch.empty_like(adjoint), torch.empty_like(adjoint), torch.empty_like(adjoint)
        rates_log2 = rates * LOG2_E
        # The adjoint reaching the block's last state from later tokens (the carry's, at the end).
        after = grad_last.to(dtype).transpose(1, 2) if grad_last is not None else None
        blocks = _blocks(length)
        for index in range(len(blocks) - 1, -1, -1):
            start, stop = blocks[index]
            n, rows = stop - start, (stop - start) * batch
            lam, r = adjoint[:n], work[:n]
            block_decay = _decays(steps[start:stop], rates_log2, decay)
            block_states = _states(inputs[start:stop], B_t[start:stop], block_decay, firsts[index], states)
            # g C_j = sum_i gy_i h_ji (the product against the states' transpose is the fast
            # orientation of a batched matrix-vector product here).
            torch.bmm(gy[start:stop].view(rows, 1, channels), block_states.view(rows, states_n, channels).transpose(1, 2),
                      out=g_C[start:stop].view(rows, 1, states_n))  # fmt: skip
            torch.mul(gy[start:stop, :, None, :], C_t[start:stop, :, :, None], out=lam)
            if after is not None:
                lam[n - 1].add_(after)
            steps_lam, steps_decay = lam.unbind(0), block_decay.unbind(0)
            for t in range(n - 2, -1, -1):
                steps_lam[t].addcmul_(steps_decay[t + 1], steps_lam[t + 1])
            after = block_decay[0] * lam[0]  # into h_{start-1}: the previous block's, or h0's gradient
            torch.bmm(B_t[start:stop].view(rows, 1, states_n), lam.view(rows, states_n, channels),
                      out=g_inputs[start:stop].view(rows, 1, channels))  # fmt: skip
            torch.bmm(inputs[start:stop].view(rows, 1, channels), lam.view(rows, states_n, channels).transpose(1, 2),
                      out=g_B[start:stop].view(rows, 1, states_n))  # fmt: skip
            # r = lam_t h_{t-1} decay_t: the gradient of delta A.
            if n > 1:
                torch.mul(lam[1:], block_states[:-1], out=r[1:])
            if index > 0 or ctx.h0_given:
                torch.mul(lam[0], firsts[index], out=r[0])
            else:
                r[0].zero_()
            r.mul_(block_decay)
            g_rates += torch.mul(r, steps[start:stop, :, None, :], out=lam).sum(dim=(0, 1))
            torch.sum(r.mul_(rates), dim=2, out=g_steps[start:stop])
        x_dtype, delta_dtype, A_dtype, B_dtype, C_dtype, h0_dtype = ctx.input_dtypes
        g_x = (g_inputs * steps).transpose(0, 1).to(x_dtype)
        g_delta = torch.addcmul(g_steps, g_inputs, x.transpose(0, 1).to(dtype)).transpose(0, 1).to(delta_dtype)
        g_h0 = after.transpose(1, 2).to(h0_dtype) if h0_dtype is not None and after is not None else None
        g_A = g_rates.t().to(A_dtype)
        return g_x, g_delta, g_A, g_B.transpose(0, 1).to(B_dtype), g_C.transpose(0, 1).to(C_dtype), g_h0


class _NativeScan(torch.autograd.Function):
    """The same scan by `native`'s C loops: the tensors pass in their own (Bt, L, ...) layout."""

    @staticmethod
    def forward(ctx: Any, x, delta, A, B, C, h0):  # noqa: ANN001, ANN205 (autograd's signature)
        dtype = compute_dtype(x, delta, A, B, C, h0)
        batch, length, channels = x.shape
        wide = [t.to(dtype).contiguous() for t in (x, delta, B, C)]
        rates = A.t().to(dtype).contiguous()  # (N, d)
        rates_log2 = rates * LOG2_E
        h0_wide = h0.to(dtype).contiguous() if h0 is not None else None
        training = any(ctx.needs_input_grad)
        blocks = -(-length // TIME_BLOCK)
        # Each block's first state, (blocks, Bt, N, d): the backward starts its blocks from them.
        firsts = x.new_empty((blocks, batch, rates.shape[0], channels), dtype=dtype) if training else None
        lib = native.library(TIME_BLOCK)
        y, h_last = native.forward(lib, wide[0], wide[1], rates_log2, wide[2], wide[3], h0_wide, firsts)
        if training:
            ctx.save_for_backward(wide[0], wide[1], rates_log2, rates, wide[2], wide[3], firsts)
            ctx.h0_given = h0 is not None
            ctx.input_dtypes = (x.dtype, delta.dtype, A.dtype, B.dtype, C.dtype, h0.dtype if h0 is not None else None)
        ctx.set_materialize_grads(False)
        return y.to(x.dtype), h_last

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor | None, grad_last: torch.Tensor | None):  # noqa: ANN205
        saved = ctx.saved_tensors
        dtype = saved[0].dtype
        gy = grad_y.to(dtype).contiguous() if grad_y is not None else None
        g_last = grad_last.to(dtype).contiguous() if grad_last is not None else None
        g_x, g_delta, g_rates, g_B, g_C, g_h0 = native.backward(native.library(TIME_BLOCK), saved, gy, g_last)
        x_dtype, delta_dtype, A_dtype, B_dtype, C_dtype, h0_dtype = ctx.input_dtypes
        return (g_x.to(x_dtype), g_delta.to(delta_dtype), g_rates.t().to(A_dtype), g_B.to(B_dtype),
                g_C.to(C_dtype), g_h0.to(h0_dtype) if ctx.h0_given else None)  # fmt: skip
