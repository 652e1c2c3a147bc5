"""The dendritic chunked scan against its definition (a step-by-step loop) and the kernels' reference."""

from __future__ import annotations

import pytest
import torch

from engine.models.ns.scan import chunked_scan, compiled_chunked_scan, segment_sums
from kernels.selective_scan import selective_scan


def sequential_scan(u, dt, A, B, C, state0):
    """The recurrence one token at a time: V_t = exp(A dt_t) V_{t-1} + dt_t B_t u_t^T, y_t = C_t^T V_t."""
    batch, length, heads, _ = u.shape
    heads_per_group = heads // B.shape[2]
    state = state0.clone()  # (Bt, H, N, P)
    outputs = []
    for t in range(length):
        B_t = B[:, t].repeat_interleave(heads_per_group, dim=1)  # (Bt, H, N)
        C_t = C[:, t].repeat_interleave(heads_per_group, dim=1)
        decay = torch.exp(A * dt[:, t])  # (Bt, H)
        state = decay[..., None, None] * state + dt[:, t, :, None, None] * B_t[..., None] * u[:, t, :, None, :]
        outputs.append(torch.einsum("bhn,bhnp->bhp", C_t, state))
    return torch.stack(outputs, dim=1), state


def random_inputs(batch=2, length=37, heads=4, head_dim=3, groups=2, state=5, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    u = normal(batch, length, heads, head_dim)
    dt = torch.rand(batch, length, heads, generator=generator, dtype=torch.float64)
    A = -3 * torch.rand(heads, generator=generator, dtype=torch.float64)
    B, C = normal(batch, length, groups, state), normal(batch, length, groups, state)
    state0 = normal(batch, heads, state, head_dim)
    return u, dt, A, B, C, state0


def test_segment_sums_are_the_sums_between_positions():
    x = torch.tensor([1.0, 2.0, 4.0, 8.0], dtype=torch.float64)
    sums = segment_sums(x)
    for i in range(4):
        for j in range(4):
            expected = x[j + 1 : i + 1].sum() if i >= j else float("-inf")
            assert sums[i, j] == expected


@pytest.mark.parametrize("chunk_len", [1, 4, 8, 64])
def test_chunked_scan_equals_the_sequential_recurrence(chunk_len):
    u, dt, A, B, C, state0 = random_inputs()
    y, last = chunked_scan(u, dt, A, B, C, chunk_len, state0)
    y_ref, last_ref = sequential_scan(u, dt, A, B, C, state0)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(last, last_ref, rtol=1e-10, atol=1e-10)


def test_chunked_scan_equals_the_selective_scan_reference_with_grouped_B_and_C():
    u, dt, A, B, C, state0 = random_inputs(heads=6, groups=3, head_dim=2)
    batch, length, heads, head_dim = u.shape
    state = B.shape[-1]
    y, last = chunked_scan(u, dt, A, B, C, 8, state0)
    # selective_scan's channels are the heads' channels side by side: channel h * P + p has
    # head h's step and decay, and reads group (h * P + p) // (H * P / G) = h // (H / G).
    x = u.reshape(batch, length, heads * head_dim)
    delta = dt.repeat_interleave(head_dim, dim=-1)
    A_channels = A.repeat_interleave(head_dim).unsqueeze(-1).expand(heads * head_dim, state).contiguous()
    h0 = state0.transpose(-1, -2).reshape(batch, heads * head_dim, state)
    y_ref, h_last = selective_scan(x, delta, A_channels, B, C, None, h0)
    torch.testing.assert_close(y.reshape(batch, length, heads * head_dim), y_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(last.transpose(-1, -2).reshape(batch, heads * head_dim, state), h_last)


@pytest.mark.parametrize("split", [1, 13, 16, 36])
def test_the_state_carries_exactly_across_windows(split):
    u, dt, A, B, C, state0 = random_inputs()
    y, last = chunked_scan(u, dt, A, B, C, 8, state0)
    first = slice(None, split)
    rest = slice(split, None)
    y1, carried = chunked_scan(u[:, first], dt[:, first], A, B[:, first], C[:, first], 8, state0)
    y2, last2 = chunked_scan(u[:, rest], dt[:, rest], A, B[:, rest], C[:, rest], 8, carried)
    torch.testing.assert_close(torch.cat([y1, y2], dim=1), y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(last2, last, rtol=1e-12, atol=1e-12)


def test_a_fast_head_beside_a_slow_one_stays_finite_with_finite_gradients():
    u, dt, A, B, C, state0 = random_inputs(length=20)
    A = torch.tensor([-1e4, -1e-4, -1.0, -30.0], dtype=torch.float64, requires_grad=True)
    dt = (dt * 50).requires_grad_()
    y, last = chunked_scan(u.float(), dt.float(), A.float(), B.float(), C.float(), 8, state0.float())
    (y.sum() + last.sum()).backward()
    assert torch.isfinite(y).all() and torch.isfinite(last).all()
    assert torch.isfinite(A.grad).all() and torch.isfinite(dt.grad).all()
    y_ref, _ = sequential_scan(u, dt.detach(), A.detach(), B, C, state0)
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-4, atol=1e-4)


def test_chunked_scan_gradients_match_finite_differences():
    inputs = [t.requires_grad_() for t in random_inputs(batch=1, length=7, heads=2, head_dim=2, groups=1, state=3)]

    def scan(u, dt, A, B, C, state0):
        return chunked_scan(u, dt, A, B, C, 3, state0)

    assert torch.autograd.gradcheck(scan, inputs)


@pytest.mark.cuda
def test_cuda_compiled_scan_matches_the_sequential_one_and_repeats_bit_for_bit():
    """`compiled_chunked_scan` (what the dendritic layers run on CUDA) against the recurrence, and
    its outputs and gradients bitwise the same on a second run (inductor's deterministic mode)."""
    inputs = [t.float().cuda() for t in random_inputs(batch=2, length=200, heads=4, head_dim=8, groups=2, state=6)]
    y_want, last_want = sequential_scan(*inputs)

    def outputs_and_grads() -> list[torch.Tensor]:
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        u, dt, A, B, C, state0 = leaves
        y, last = compiled_chunked_scan()(u, dt, A, B, C, 16, state0)
        (y.square().sum() + last.sum()).backward()
        return [y.detach(), last.detach(), *(leaf.grad for leaf in leaves)]

    first, second = outputs_and_grads(), outputs_and_grads()
    torch.testing.assert_close(first[0], y_want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(first[1], last_want, rtol=1e-4, atol=1e-4)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
