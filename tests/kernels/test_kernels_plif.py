"""PLIF spike scan: the reference against a hand-written adjoint, the Triton kernel against the
reference (forward and surrogate backward), poisoned outputs and carry chaining."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import plif, plif_backward
from kernels._dispatch import poison
from kernels.plif import plif_membrane, plif_scan, plif_scan_reference, spike_with_surrogate

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ALPHA = 4.0


@pytest.fixture(autouse=True)
def _poisoned_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(poison, "enabled", True)


def _inputs(batch: int, steps: int, channels: int, seed: int, dtype: torch.dtype = torch.float32):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, steps, channels, generator=generator, dtype=torch.float64) * 2
    beta = torch.rand(channels, generator=generator, dtype=torch.float64) * 0.85 + 0.1
    threshold = torch.rand(channels, generator=generator, dtype=torch.float64) + 0.5
    v0 = torch.randn(batch, channels, generator=generator, dtype=torch.float64)
    return [t.to(dtype).to(DEVICE) for t in (x, beta, threshold, v0)]


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def _run_with_grads(scan, inputs, grads):
    leaves = [t.clone().requires_grad_() for t in inputs]
    outputs = scan(*leaves, alpha=ALPHA)
    sum(((o * g).sum() for o, g in zip(outputs, grads)), torch.zeros((), device=DEVICE)).backward()
    return list(outputs), [leaf.grad for leaf in leaves]


def test_surrogate_spike_is_a_step_with_sigmoid_derivative() -> None:
    u = torch.linspace(-2, 2, 41, dtype=torch.float64, requires_grad=True)
    spikes = spike_with_surrogate(u, ALPHA)
    assert torch.equal(spikes.detach(), (u > 0).double())
    spikes.sum().backward()
    sig = torch.sigmoid(ALPHA * u.detach())
    torch.testing.assert_close(u.grad, ALPHA * sig * (1 - sig))


def test_reference_backward_matches_hand_written_adjoint() -> None:
    """An independent fp64 loop of the adjoint recursion (the math the kernel implements)."""
    x, beta, th, v0 = (t.cpu().numpy() for t in _inputs(2, 9, 5, seed=1, dtype=torch.float64))
    generator = np.random.default_rng(2)
    grad_spikes, grad_v_pre = generator.standard_normal((2, 2, 9, 5))
    grad_v_last = generator.standard_normal((2, 5))
    v_pre = np.zeros_like(x)
    v = v0.copy()
    for t in range(9):
        v_pre[:, t] = beta * v + (1 - beta) * x[:, t]
        v = v_pre[:, t] - th * (v_pre[:, t] > th)
    grad_v = grad_v_last.copy()
    grad_x = np.zeros_like(x)
    grad_beta = np.zeros(5)
    grad_th = np.zeros(5)
    for t in reversed(range(9)):
        sig = 1 / (1 + np.exp(-ALPHA * (v_pre[:, t] - th)))
        surrogate = ALPHA * sig * (1 - sig)
        spike = (v_pre[:, t] > th).astype(float)
        v_before = v0 if t == 0 else v_pre[:, t - 1] - th * (v_pre[:, t - 1] > th)
        total_spike = grad_spikes[:, t] - th * grad_v
        total_v_pre = grad_v_pre[:, t] + grad_v + total_spike * surrogate
        grad_th += (-grad_v * spike - total_spike * surrogate).sum(0)
        grad_beta += (total_v_pre * (v_before - x[:, t])).sum(0)
        grad_x[:, t] = total_v_pre * (1 - beta)
        grad_v = total_v_pre * beta
    inputs = [torch.from_numpy(a).to(DEVICE) for a in (x, beta, th, v0)]
    grads = [torch.from_numpy(a).to(DEVICE) for a in (grad_spikes, grad_v_pre, grad_v_last)]
    _, got = _run_with_grads(plif_scan_reference, inputs, grads)
    for mine, want in zip(got, (grad_x, grad_beta, grad_th, grad_v)):
        np.testing.assert_allclose(mine.cpu().numpy(), want, rtol=1e-10, atol=1e-12)


def _check_kernel_against_reference(batch: int, steps: int, channels: int) -> None:
    """Every output and gradient of the Triton path against the reference, with v0."""
    inputs = _inputs(batch, steps, channels, seed=steps)
    generator = torch.Generator().manual_seed(7)
    grads = [torch.randn(batch, steps, channels, generator=generator).to(DEVICE) for _ in range(2)]
    grads.append(torch.randn(batch, channels, generator=generator).to(DEVICE))
    kernel_outputs, kernel_grads = _run_with_grads(
        lambda *a, alpha: plif_scan(*a, alpha=alpha, use_triton=True), inputs, grads
    )
    reference_outputs, reference_grads = _run_with_grads(plif_scan_reference, inputs, grads)
    # The forward is the same fp32 arithmetic step by step: spikes agree exactly.
    assert torch.equal(kernel_outputs[0], reference_outputs[0])
    for got, want in zip(kernel_outputs[1:] + kernel_grads, reference_outputs[1:] + reference_grads):
        assert not got.isnan().any()
        assert _relative_error(got, want) < 1e-5


@pytest.mark.parametrize(("batch", "steps", "channels"), [(2, 45, 37), (1, 1, 3), (3, 32, 33), (2, 7, 4099)])
def test_kernel_matches_reference(batch: int, steps: int, channels: int) -> None:
    _check_kernel_against_reference(batch, steps, channels)


def test_forward_unroll_and_stages_by_shape() -> None:
    """(8, 6) for many programs (Bt 8 x D 2560), (16, 4) for few (Bt 1 x D 2560), switching where
    the block does (batch x channels 8192)."""
    assert plif._forward_unroll_and_stages(8, 2560) == (8, 6)
    assert plif._forward_unroll_and_stages(1, 2560) == (16, 4)
    assert plif._forward_unroll_and_stages(2, 4096) == (8, 6)
    assert plif._forward_unroll_and_stages(1, 8191) == (16, 4)


def test_backward_channels_by_shape() -> None:
    """64 channels a backward program for many rows, in segments or for 2-byte gradients, 32 for one
    segment of few fp32 rows (kernels/plif_backward.py `_backward_channels`)."""
    assert plif_backward._backward_channels(8, 2560, 1, 4) == 64
    assert plif_backward._backward_channels(1, 2560, 1, 4) == 32
    assert plif_backward._backward_channels(1, 2560, 32, 4) == 64
    assert plif_backward._backward_channels(2, 4096, 1, 4) == 64
    assert plif_backward._backward_channels(1, 2560, 1, 2) == 64


def test_forward_channels_by_shape_and_input_size() -> None:
    """64 channels a forward program for many rows or 2-byte inputs, else 32 (kernels/plif.py
    `_channels_per_program`)."""
    assert plif._channels_per_program(8, 2560, 4) == 64
    assert plif._channels_per_program(1, 2560, 4) == 32
    assert plif._channels_per_program(1, 20, 2) == 64


@pytest.mark.parametrize("unroll_and_stages", [(4, 8), (8, 6), (16, 4)])
@pytest.mark.parametrize(("steps", "channels"), [(3, 37), (13, 37), (16, 37), (16, 64), (35, 64)])
def test_kernel_matches_reference_for_each_unroll(
    monkeypatch: pytest.MonkeyPatch, unroll_and_stages: tuple[int, int], steps: int, channels: int
) -> None:
    """Each forward loop shape on a small size (the big one's shape would be slow here): T shorter
    than the unroll, ragged (13 = 3 x 4 + 1 = 8 + 5; 35) and whole; 64 channels are whole blocks,
    so 16 steps of them take the unmasked loop at every unroll, 35 steps the masked one. Steps
    past the end must neither write (the outputs start as NaN) nor move the membrane (v_last)."""
    chosen = []

    def choice(batch: int, channels: int) -> tuple[int, int]:
        chosen.append((batch, channels))
        return unroll_and_stages

    monkeypatch.setattr(plif, "_forward_unroll_and_stages", choice)
    _check_kernel_against_reference(2, steps, channels)
    assert chosen == [(2, channels)]


@pytest.mark.parametrize(("steps", "channels"), [(13, 20), (32, 37), (16, 64), (35, 128)])
def test_forward_with_two_channels_a_thread_matches_reference(
    monkeypatch: pytest.MonkeyPatch, steps: int, channels: int
) -> None:
    """The forward at 64 channels a program, where the row width is a compile-time constant (bf16
    models and many rows): widths that are not a multiple of 16 (20, as an ns-2b layer's write
    gate, and 37) and whole blocks, ragged and whole T."""
    monkeypatch.setattr(plif, "_channels_per_program", lambda batch, channels, element_size: 64)
    _check_kernel_against_reference(2, steps, channels)


@pytest.mark.parametrize("chunk", [4, 8, 16])
@pytest.mark.parametrize(("steps", "channels"), [(5, 37), (19, 37), (32, 37), (24, 64)])
def test_backward_chunks_match_reference(
    monkeypatch: pytest.MonkeyPatch, chunk: int, steps: int, channels: int
) -> None:
    """The backward's chunked scan at every chunk length: T shorter than a chunk (all steps one at
    a time), ragged (the last T % chunk steps one at a time, then whole chunks), whole; 37
    channels take the masked loads, 64 whole blocks the unmasked ones."""
    monkeypatch.setattr(plif_backward, "_BACKWARD_CHUNK_T", chunk)
    _check_kernel_against_reference(2, steps, channels)


@pytest.mark.parametrize(("steps", "channels"), [(19, 37), (32, 101), (24, 64), (24, 128)])
def test_backward_with_two_channels_a_thread_matches_reference(
    monkeypatch: pytest.MonkeyPatch, steps: int, channels: int
) -> None:
    """64 channels a program in one segment (many rows; two channels a thread, contiguous where
    the width allows 8-byte loads): masked (37, and 101, odd, where no two channels are 8-byte
    aligned) and whole blocks (64, 128), ragged and whole T."""
    chosen = []

    def choice(batch: int, channels: int, segments: int, element_size: int) -> int:
        chosen.append(segments)
        return 64

    monkeypatch.setattr(plif_backward, "_backward_channels", choice)
    _check_kernel_against_reference(2, steps, channels)
    assert chosen and set(chosen) == {1}


@pytest.mark.parametrize("segment_chunks", [1, 2, 3])
@pytest.mark.parametrize(("steps", "channels"), [(48, 37), (48, 64), (37, 37)])
def test_backward_segments_match_reference(
    monkeypatch: pytest.MonkeyPatch, segment_chunks: int, steps: int, channels: int
) -> None:
    """The backward split along time (flow pass, carries, every segment at once): 48 steps are 6
    chunks, so 6 segments of one chunk, 3 of two or 2 of three; 37 steps are not whole chunks, so
    one segment (the step-by-step tail must not be split). 37 channels masked, 64 not."""
    monkeypatch.setattr(plif_backward, "_backward_segment_chunks", lambda batch, channels, steps: segment_chunks)
    _check_kernel_against_reference(2, steps, channels)
    x, beta, th, _ = _inputs(2, steps, channels, seed=9)
    leaves = [t.clone().requires_grad_() for t in (x, beta, th)]
    plif_scan(*leaves, use_triton=True)[0].sum().backward()  # no v0, no v_pre or v_last gradient
    reference_leaves = [t.clone().requires_grad_() for t in (x, beta, th)]
    plif_scan_reference(*reference_leaves)[0].sum().backward()
    for got, want in zip(leaves, reference_leaves):
        assert _relative_error(got.grad, want.grad) < 1e-5


def test_backward_segments_only_for_few_rows_and_longer_for_long_rows() -> None:
    chunks = 4096 // plif_backward._BACKWARD_CHUNK_T
    assert plif_backward._backward_segment_chunks(1, 2560, 4096) == plif_backward._SEGMENT_CHUNKS
    assert plif_backward._backward_segment_chunks(2, 2560, 4096) == plif_backward._SEGMENT_CHUNKS
    # A 32K row: _SEGMENTS segments, each longer than the shortest.
    assert plif_backward._backward_segment_chunks(1, 2560, 32768) == 8 * chunks // plif_backward._SEGMENTS
    assert plif_backward._backward_segment_chunks(3, 2560, 4096) == chunks  # 7680 channels of rows: one
    assert plif_backward._backward_segment_chunks(8, 2560, 4096) == chunks
    # T whole chunks but not whole segments: the nearest divisor of its chunks, or one segment.
    assert plif_backward._backward_segment_chunks(1, 2560, 32760) == 117  # 4095 = 35 x 117
    assert plif_backward._backward_segment_chunks(2, 2560, 4000) == 50  # 500 chunks
    assert plif_backward._backward_segment_chunks(1, 2560, 8 * 509) == 509  # prime: one segment
    assert plif_backward._backward_segment_chunks(1, 2560, 8 * 40) == 40  # too short to split


def test_leak_near_one_keeps_the_beta_gradient() -> None:
    """dL/dbeta is summed as p (v_before - v_pre) / (1 - beta), without reading x: at the models'
    largest leak (beta_max 0.99) the division must not cost the gradient its precision against
    the reference's (v_before - x) (the same fp32 forward, so the same spikes)."""
    x, _, th, v0 = _inputs(2, 40, 37, seed=11)
    beta = torch.linspace(0.95, 0.99, 37, dtype=torch.float64).float().to(DEVICE)
    leaves = [t.clone().requires_grad_() for t in (x, beta, th, v0)]
    grads = [torch.randn(2, 40, 37, generator=torch.Generator().manual_seed(3)).to(DEVICE) for _ in range(2)]
    spikes, v_pre, _ = plif_scan(*leaves, use_triton=True)
    (grad_beta,) = torch.autograd.grad([spikes, v_pre], [leaves[1]], grads)
    reference = [t.clone().requires_grad_() for t in (x, beta, th, v0)]
    (want,) = torch.autograd.grad(list(plif_scan_reference(*reference)[:2]), [reference[1]], grads)
    assert _relative_error(grad_beta, want) < 1e-5


def test_kernel_without_v0_and_with_unused_outputs() -> None:
    x, beta, th, _ = _inputs(2, 19, 7, seed=4)
    leaves = [t.clone().requires_grad_() for t in (x, beta, th)]
    spikes, _, _ = plif_scan(*leaves, use_triton=True)
    spikes.sum().backward()
    reference_leaves = [t.clone().requires_grad_() for t in (x, beta, th)]
    plif_scan_reference(*reference_leaves)[0].sum().backward()
    for got, want in zip(leaves, reference_leaves):
        assert _relative_error(got.grad, want.grad) < 1e-5


@pytest.mark.parametrize("use_triton", [True, False])
def test_carry_chains(use_triton: bool) -> None:
    x, beta, th, v0 = _inputs(2, 23, 9, seed=3)
    whole = plif_scan(x, beta, th, v0, use_triton=use_triton)
    first = plif_scan(x[:, :10], beta, th, v0, use_triton=use_triton)
    second = plif_scan(x[:, 10:], beta, th, first[2], use_triton=use_triton)
    assert torch.equal(torch.cat([first[0], second[0]], 1), whole[0])
    chained_v_pre = torch.cat([first[1], second[1]], 1)
    if use_triton and DEVICE == "cuda":
        # The compiler may fuse multiply-adds differently at another position in a tile: the
        # membranes then agree to rounding (seen on the H200), not bit for bit.
        assert _relative_error(chained_v_pre, whole[1]) < 1e-6
        assert _relative_error(second[2], whole[2]) < 1e-6
    else:
        assert torch.equal(chained_v_pre, whole[1])
        assert torch.equal(second[2], whole[2])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 kernels are checked on the GPU")
@pytest.mark.parametrize("channels", [20, 40, 64])
def test_kernel_bf16_inputs(channels: int) -> None:
    """bf16 inputs (two channels a program's thread, loaded 4 bytes at a time), widths that are and
    are not multiples of 16: the forward and the gradients against the reference's on the same bf16
    input."""
    x, beta, th, v0 = _inputs(2, 50, channels, seed=8)
    x = x.bfloat16()
    spikes, v_pre, v_last = plif_scan(x, beta, th, v0, use_triton=True)
    _, want_v_pre, want_v_last = plif_scan_reference(x, beta, th, v0)
    assert spikes.dtype == torch.bfloat16 and v_last.dtype == torch.float32
    assert _relative_error(v_pre, want_v_pre) < 1e-2
    assert _relative_error(v_last, want_v_last) < 1e-4
    grads = [torch.randn(x.shape, device=x.device, dtype=torch.bfloat16) for _ in range(2)]
    leaves = [t.detach().requires_grad_() for t in (x, beta, th, v0)]
    mine = torch.autograd.grad(plif_scan(*leaves, use_triton=True)[:2], leaves, grads)
    theirs = torch.autograd.grad(plif_scan_reference(*leaves)[:2], leaves, grads)
    for got, want in zip(mine, theirs, strict=True):
        assert _relative_error(got.float(), want.float()) < 2e-2


@pytest.mark.parametrize(
    ("batch", "steps", "channels", "dtype", "with_v0"),
    [(2, 37, 13, torch.float64, True), (3, 64, 7, torch.float32, False), (1, 1, 5, torch.float32, True)],
)
def test_the_cpu_path_keeps_the_reference_forward_and_its_gradients(batch, steps, channels, dtype, with_v0) -> None:
    """plif_scan without Triton: the reference's forward bit for bit, and its surrogate gradients."""
    x, beta, th, v0 = (t.cpu() for t in _inputs(batch, steps, channels, seed=steps, dtype=dtype))
    v0 = v0 if with_v0 else None
    generator = torch.Generator().manual_seed(7)
    grads = [torch.randn(batch, steps, channels, generator=generator, dtype=torch.float64).to(dtype) for _ in range(2)]
    grads.append(torch.randn(batch, channels, generator=generator, dtype=torch.float64).to(dtype))

    def run(scan):
        leaves = [t.clone().requires_grad_() if t is not None else None for t in (x, beta, th, v0)]
        outputs = scan(*leaves, alpha=ALPHA)
        sum((o * g).sum() for o, g in zip(outputs, grads)).backward()
        return outputs, [leaf.grad for leaf in leaves if leaf is not None]

    want_outputs, want_grads = run(plif_scan_reference)
    got_outputs, got_grads = run(lambda *args, alpha: plif_scan(*args, alpha=alpha, use_triton=False))
    for got, want in zip(got_outputs, want_outputs, strict=True):
        assert torch.equal(got.detach(), want.detach())
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    for got, want in zip(got_grads, want_grads, strict=True):
        assert _relative_error(got, want) < tolerance


@pytest.mark.parametrize("use_triton", [True, False])
@pytest.mark.parametrize(("steps", "channels", "with_v0"), [(37, 64, True), (16, 37, False)])
def test_membrane_only_scan_is_the_scan_without_its_spikes(
    record_launches, use_triton: bool, steps: int, channels: int, with_v0: bool
) -> None:
    """plif_membrane: plif_scan's membranes and last state bit for bit, and its gradients where the
    spikes get none, with no spike stored by the kernel (the NS layers in training read only the
    membrane: a third of an fp32 forward's traffic)."""
    launches = record_launches(plif, "_plif_forward_kernel")
    x, beta, th, v0 = _inputs(2, steps, channels, seed=steps)
    v0 = v0 if with_v0 else None
    generator = torch.Generator().manual_seed(5)
    grad_v_pre = torch.randn(2, steps, channels, generator=generator).to(DEVICE)
    grad_v_last = torch.randn(2, channels, generator=generator).to(DEVICE)

    def run(scan, *, spikes_first: bool):
        leaves = [t.clone().requires_grad_() if t is not None else None for t in (x, beta, th, v0)]
        outputs = scan(*leaves, alpha=ALPHA, use_triton=use_triton)
        v_pre, v_last = outputs[1:] if spikes_first else outputs
        ((v_pre * grad_v_pre).sum() + (v_last * grad_v_last).sum()).backward()
        return [v_pre.detach(), v_last.detach()] + [leaf.grad for leaf in leaves if leaf is not None]

    with_spikes = run(plif_scan, spikes_first=True)
    without = run(plif_membrane, spikes_first=False)
    for got, want in zip(without, with_spikes, strict=True):
        assert torch.equal(got, want)
    if use_triton:
        stored = [launch["WRITE_SPIKES"] for launch in launches]
        assert stored[: len(stored) // 2] == [True] * (len(stored) // 2)
        assert stored[len(stored) // 2 :] == [False] * (len(stored) // 2)


@pytest.mark.parametrize(("steps", "channels"), [(37, 64), (16, 48)])
def test_kernel_reads_a_slice_of_a_wider_input_where_it_lies(record_launches, steps: int, channels: int) -> None:
    """The FFN's gate and up halves of one product (a (Bt, T, 2F) tensor's slices, 16-element
    aligned): read in place, not copied first, with the values and gradients of the same input made
    contiguous."""
    launches = record_launches(plif, "_plif_forward_kernel")
    x, beta, th, v0 = _inputs(2, steps, 2 * channels, seed=steps)
    beta, th, v0 = beta[channels:], th[channels:], v0[:, channels:]
    wide = x.clone().requires_grad_()
    halves = wide.chunk(2, dim=-1)
    assert not halves[1].is_contiguous()
    sliced = plif_scan(halves[1], beta, th, v0, use_triton=True)
    assert launches[0]["args"][0].data_ptr() == halves[1].data_ptr()
    whole = x[..., channels:].contiguous().requires_grad_()
    contiguous = plif_scan(whole, beta, th, v0, use_triton=True)
    for got, want in zip(sliced, contiguous, strict=True):
        assert torch.equal(got, want)
    generator = torch.Generator().manual_seed(1)
    grads = [torch.randn(t.shape, generator=generator).to(DEVICE) for t in contiguous]
    torch.autograd.backward(sliced, grads)
    torch.autograd.backward(contiguous, grads)
    assert torch.equal(wide.grad[..., channels:], whole.grad)
    assert not wide.grad[..., :channels].any()


def test_a_misaligned_slice_is_copied_before_the_scan(record_launches) -> None:
    """A slice whose rows do not start 16-element aligned (20 channels of a 44-wide tensor) would be
    loaded step by step without vectorised, pipelined loads: it is copied first, same values."""
    launches = record_launches(plif, "_plif_forward_kernel")
    x, beta, th, v0 = _inputs(2, 19, 44, seed=3)
    beta, th, v0 = beta[24:], th[24:], v0[:, 24:]
    sliced = x[..., 24:]
    got = plif_scan(sliced, beta, th, v0, use_triton=True)
    assert launches[0]["args"][0].data_ptr() != sliced.data_ptr()
    for mine, theirs in zip(got, plif_scan(sliced.contiguous(), beta, th, v0, use_triton=True), strict=True):
        assert torch.equal(mine, theirs)


def test_ragged_forward_runs_its_whole_iterations_unmasked(monkeypatch: pytest.MonkeyPatch, record_launches) -> None:
    """T 37 at 16 steps an iteration: 32 steps in the unmasked loop, the last 5 in a second, masked
    launch from the first one's v_last (one masked loop over all of T ran a 32K row's forward +
    backward 1.7x slower on the H200), with the same values as the reference."""
    launches = record_launches(plif, "_plif_forward_kernel")
    monkeypatch.setattr(plif, "_forward_unroll_and_stages", lambda batch, channels: (16, 4))
    monkeypatch.setattr(plif, "_channels_per_program", lambda batch, channels, element_size: 32)
    x, beta, th, v0 = _inputs(2, 37, 64, seed=11)
    got = plif_scan(x, beta, th, v0, use_triton=True)
    assert [(launch["args"][8], launch["EVEN"], launch["HAS_V0"]) for launch in launches] == [
        (32, True, True), (5, False, True)]
    for mine, theirs in zip(got, plif_scan_reference(x, beta, th, v0)):
        assert _relative_error(mine, theirs) < 1e-6
