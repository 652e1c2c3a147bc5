"""Benchmark of the Triton kernels against their PyTorch references on the GPU.

Prints one JSON row per (kernel, size, implementation): median milliseconds, the bytes the work
must move at the least (each input read once, each output written once), the achieved GB/s on
those bytes, its share of the card's measured copy bandwidth, and the kernel's speed-up over
each reference. Run on a CUDA machine: `python bench/kernels.py [--out rows.jsonl] [--quick]`.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pynvml
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.adamw import adamw_step, adamw_step_reference  # noqa: E402
from kernels.grad_norms import segment_sq_sums, segment_sq_sums_reference  # noqa: E402
from kernels.plif import plif_membrane, plif_scan, plif_scan_reference, spike_with_surrogate  # noqa: E402
from kernels.poincare import poincare_read, poincare_read_reference  # noqa: E402
from kernels.selective_scan import selective_scan, selective_scan_reference  # noqa: E402

ROWS: list[dict] = []


def time_ms(fn: Callable[[], object], budget_s: float = 0.6, most: int = 50) -> float:
    """Median device time of one call, in ms: after a warm-up, the calls are queued back to back,
    each between two CUDA events, with no host synchronisation until the last. The host's work for
    a call (tens of microseconds for a Triton launch, more through autograd) then overlaps the
    device work queued before it, as in a training step, instead of being timed as an idle device:
    synchronising after every call added 0.09-0.23 ms to the scans' sub-millisecond timings
    (bench/RESULTS.md, session 6; the queued ones agree with Nsight Compute's durations). The
    count is what fits the budget by the second warm-up's time (the first compiles), at least 3
    and at most `most`."""
    fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    warm_up_s = time.perf_counter() - started
    count = max(3, min(most, int(budget_s / max(warm_up_s, 1e-6))))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(count)]
    for begin, end in events:
        begin.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(begin.elapsed_time(end) for begin, end in events)


def graph_ms(fn: Callable[[], object]) -> float:
    """Median device time of one call replayed from a CUDA graph, in ms: `fn` warmed up on a side
    stream, captured once, and the replays timed by `time_ms`. This is how the trainer's graph
    engine runs a step. At small shapes `time_ms` of the eager call holds the host's work
    (autograd, a dozen launches) with the device idle, and the replay does not (bench/RESULTS.md,
    session 7: a selective-scan forward + backward at Bt 4 x T 256 x Dm 1024 is 0.92-1.02 ms
    eagerly and 0.087 ms replayed)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_ms(graph.replay)


def emit(kernel: str, size: str, impl: str, ms: float, nbytes: float, copy_gbs: float, **extra) -> dict:
    gbs = nbytes / ms / 1e6
    row = {"kernel": kernel, "size": size, "impl": impl, "ms": round(ms, 4), "min_bytes": int(nbytes),
           "GB_s": round(gbs, 1), "frac_of_copy": round(gbs / copy_gbs, 3), **extra}
    ROWS.append(row)
    print(json.dumps(row), flush=True)
    return row


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def speedups(kernel: str, size: str) -> None:
    """Adds each reference's time over the Triton time to the Triton row."""
    rows = [r for r in ROWS if r["kernel"] == kernel and r["size"] == size]
    triton_rows = [r for r in rows if r["impl"] == "triton"]
    if not triton_rows:
        return
    summary = {"kernel": kernel, "size": size, "impl": "speedup"}
    for r in rows:
        if r["impl"] != "triton":
            summary[f"vs_{r['impl']}"] = round(r["ms"] / triton_rows[0]["ms"], 2)
    ROWS.append(summary)
    print(json.dumps(summary), flush=True)


def copy_bandwidth() -> float:
    source = torch.randn(1024**3, device="cuda")  # 4 GiB
    target = torch.empty_like(source)
    ms = time_ms(lambda: target.copy_(source))
    gbs = 2 * source.numel() * 4 / ms / 1e6
    print(json.dumps({"kernel": "copy", "size": "4 GiB", "impl": "torch", "ms": round(ms, 4), "GB_s": round(gbs, 1)}),
          flush=True)
    return gbs


def bench_adamw(count: int, copy_gbs: float, compile_reference: bool) -> None:
    size = f"{count:.2e} fp32"
    buffers = [torch.randn(count, device="cuda") * s for s in (1.0, 0.5, 0.05)]
    buffers.append(torch.rand(count, device="cuda") * 1e-4)
    scalars = {k: torch.tensor(v, dtype=dtype, device="cuda") for k, v, dtype in
               (("step", 10, torch.int64), ("lr", 3e-4, torch.float32), ("weight_decay", 0.1, torch.float32),
                ("grad_norm", 0.8, torch.float64))}
    hyper = {"max_norm": 1.0, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}
    nbytes = count * 4 * 7  # read param, grad, m, v; write param, m, v
    emit("adamw", size, "triton", time_ms(lambda: adamw_step(*buffers, **scalars, **hyper)), nbytes, copy_gbs)
    emit("adamw", size, "torch_eager", time_ms(lambda: adamw_step_reference(*buffers, **scalars, **hyper)),
         nbytes, copy_gbs)
    if compile_reference:
        compiled = torch.compile(adamw_step_reference)
        emit("adamw", size, "torch_compile", time_ms(lambda: compiled(*buffers, **scalars, **hyper)),
             nbytes, copy_gbs)
    speedups("adamw", size)
    torch.cuda.empty_cache()


def bench_grad_norms(count: int, segments: int, copy_gbs: float) -> None:
    size = f"{count:.2e} fp32, {segments} segments"
    flat = torch.randn(count, device="cuda")
    generator = torch.Generator().manual_seed(0)
    cuts = torch.randint(0, count, (segments - 1,), generator=generator).sort().values
    offsets = torch.cat([torch.tensor([0]), cuts, torch.tensor([count])]).cuda()
    nbytes = count * 4
    emit("grad_norms", size, "triton", time_ms(lambda: segment_sq_sums(flat, offsets)), nbytes, copy_gbs)
    emit("grad_norms", size, "torch_eager", time_ms(lambda: segment_sq_sums_reference(flat, offsets)),
         nbytes, copy_gbs)
    # The usual eager alternative: one fused multi-tensor norm over views of the segments.
    views = [flat[a:b] for a, b in zip(offsets.tolist(), offsets.tolist()[1:])]
    emit("grad_norms", size, "torch_foreach_norm",
         time_ms(lambda: torch.stack(torch._foreach_norm(views)).square()), nbytes, copy_gbs)
    speedups("grad_norms", size)
    torch.cuda.empty_cache()


def _scan_step_factory():
    """One scan step as a function torch.compile can fuse (the loop stays in Python)."""

    def step(h, x_t, delta_t, A, B_t, C_t):
        h = torch.exp(delta_t[:, :, None] * A) * h + (delta_t * x_t)[:, :, None] * B_t[:, None, :]
        return h, (h * C_t[:, None, :]).sum(-1)

    return torch.compile(step)


EXPS_PER_SM_CLOCK = 16
"""exp2 results an SM's special-function units give a clock on compute capability 9.0 (the CUDA C
Programming Guide's arithmetic-instruction throughput table: 16, against 128 fp32 FMAs)."""


def exp_floor_ms(exps: int) -> float:
    """The least time `exps` exponentials take on this GPU with every SM's exp unit busy all the
    time at its top clock: a floor no kernel that computes them can beat, whatever its bytes."""
    pynvml.nvmlInit()
    clock_hz = pynvml.nvmlDeviceGetMaxClockInfo(pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device()),
                                                pynvml.NVML_CLOCK_SM) * 1e6
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return exps / (sms * EXPS_PER_SM_CLOCK * clock_hz) * 1e3


def bench_selective_scan(batch: int, steps: int, channels: int, state: int, copy_gbs: float,
                         references: bool) -> None:
    size = f"Bt {batch} T {steps} Dm {channels} N {state} G 1 fp32"
    x = torch.randn(batch, steps, channels, device="cuda")
    delta = torch.nn.functional.softplus(torch.randn(batch, steps, channels, device="cuda") - 2)
    A = -torch.exp(torch.randn(channels, state, device="cuda") * 0.5)
    B = torch.randn(batch, steps, 1, state, device="cuda")
    C = torch.randn(batch, steps, 1, state, device="cuda")
    D = torch.randn(channels, device="cuda")
    grad_y = torch.randn_like(x)
    io = batch * steps * (3 * channels + 2 * state) * 4  # x, delta, y; B, C
    io_backward = io + batch * steps * (3 * channels + 2 * state) * 4  # + read gy, B, C again; write gx, gdelta
    leaves = [t.clone().requires_grad_() for t in (x, delta, A, B, C, D)]

    def forward_backward(scan):
        def run():
            y, _ = scan(*leaves)
            torch.autograd.grad(y, leaves, grad_y)  # no .grad accumulation: a training step's work
        return run

    # One exp(delta A) a state update: the forward cannot beat the exp unit's floor, the backward
    # (which recomputes them) neither, so 70 % of copy is out of reach where that floor is higher.
    floor_ms = exp_floor_ms(batch * steps * channels * state)
    with torch.no_grad():
        forward_ms = time_ms(lambda: selective_scan(x, delta, A, B, C, D))
        emit("selective_scan_fwd", size, "triton", forward_ms, io, copy_gbs, exp_floor_ms=round(floor_ms, 4),
             frac_of_exp_floor=round(floor_ms / forward_ms, 3))
    # The forward as in training: it also saves the state entering each chunk for the backward.
    emit("selective_scan_fwd", size, "triton_saving", time_ms(lambda: selective_scan(*leaves)), io, copy_gbs)
    emit("selective_scan_fwd_bwd", size, "triton", time_ms(forward_backward(selective_scan)), io_backward, copy_gbs)
    if references:
        with torch.no_grad():
            error = relative_error(selective_scan(x, delta, A, B, C, D)[0], selective_scan_reference(x, delta, A, B, C, D)[0])
            emit("selective_scan_fwd", size, "torch_eager",
                 time_ms(lambda: selective_scan_reference(x, delta, A, B, C, D), budget_s=0), io, copy_gbs,
                 triton_rel_err_y=error)
            step = _scan_step_factory()
            B1, C1 = B[:, :, 0], C[:, :, 0]

            def compiled_scan():
                h = x.new_zeros(batch, channels, state)
                ys = []
                for t in range(steps):
                    h, y_t = step(h, x[:, t], delta[:, t], A, B1[:, t], C1[:, t])
                    ys.append(y_t)
                return torch.stack(ys, 1) + D * x, h

            emit("selective_scan_fwd", size, "torch_compile_step", time_ms(compiled_scan, budget_s=0), io, copy_gbs)
        emit("selective_scan_fwd_bwd", size, "torch_eager",
             time_ms(forward_backward(selective_scan_reference), budget_s=0), io_backward, copy_gbs)
    speedups("selective_scan_fwd", size)
    speedups("selective_scan_fwd_bwd", size)
    torch.cuda.empty_cache()


def bench_plif(batch: int, steps: int, channels: int, copy_gbs: float, references: bool) -> None:
    size = f"Bt {batch} T {steps} D {channels} fp32"
    x, beta, threshold = _plif_case(batch, steps, channels)
    io = batch * steps * channels * 4 * 3  # read x; write spikes, v_pre
    io_backward = io + batch * steps * channels * 4 * 4  # + read v_pre, gs, gv_pre; write gx
    grads = [torch.randn_like(x), torch.randn_like(x)]
    leaves = [t.clone().requires_grad_() for t in (x, beta, threshold)]

    with torch.no_grad():
        emit("plif_fwd", size, "triton", time_ms(lambda: plif_scan(x, beta, threshold)), io, copy_gbs)
        # The NS layers' training call: membranes only, no spike stored (read x; write v_pre).
        emit("plif_fwd", size, "triton_membrane_only", time_ms(lambda: plif_membrane(x, beta, threshold)),
             io * 2 // 3, copy_gbs)
    emit("plif_fwd_bwd", size, "triton", time_ms(_plif_training_call(plif_scan, leaves, grads)), io_backward, copy_gbs)
    if references:
        with torch.no_grad():
            error = relative_error(plif_scan(x, beta, threshold)[1], plif_scan_reference(x, beta, threshold)[1])
            emit("plif_fwd", size, "torch_eager", time_ms(lambda: plif_scan_reference(x, beta, threshold), budget_s=0),
                 io, copy_gbs, triton_rel_err_v_pre=error)

            @torch.compile
            def step(v, x_t):
                v_pre = beta * v + (1 - beta) * x_t
                spike = spike_with_surrogate(v_pre - threshold, 4.0)
                return v_pre - threshold * spike, spike, v_pre

            def compiled_scan():
                v = x.new_zeros(batch, channels)
                spikes, potentials = [], []
                for t in range(steps):
                    v, spike, v_pre = step(v, x[:, t])
                    spikes.append(spike)
                    potentials.append(v_pre)
                return torch.stack(spikes, 1), torch.stack(potentials, 1), v

            emit("plif_fwd", size, "torch_compile_step", time_ms(compiled_scan, budget_s=0), io, copy_gbs)
        emit("plif_fwd_bwd", size, "torch_eager", time_ms(_plif_training_call(plif_scan_reference, leaves, grads), budget_s=0),
             io_backward, copy_gbs)
    speedups("plif_fwd", size)
    speedups("plif_fwd_bwd", size)
    torch.cuda.empty_cache()


def bench_plif_bf16(copy_gbs: float) -> None:
    """The PLIF scan as the NS models run it under bf16 autocast (bf16 x from a linear map, bf16
    gradients), replayed from a CUDA graph, at the models' shapes: a hippocampal layer's write gate
    (20 or 16 heads) and FFN neurons, a dendritic soma. Side by side with session 7's channel rule,
    one channel a thread for few rows, which loaded 2-byte values one step at a time (kernels/plif.py
    `_channels_per_program`)."""
    plif_module, backward_module = sys.modules["kernels.plif"], sys.modules["kernels.plif_backward"]
    rules = (plif_module._channels_per_program, backward_module._backward_channels)
    session7 = (lambda batch, channels, _size: 64 if batch * channels >= 8192 else 32,
                lambda batch, channels, segments, _size: 64 if segments > 1 or batch * channels >= 8192 else 32)
    for batch, steps, channels in [(1, 4096, 20), (4, 4096, 16), (1, 4096, 2560), (1, 4096, 7680), (4, 4096, 6144),
                                   (8, 4096, 2560)]:
        x, beta, threshold = _plif_case(batch, steps, channels)
        x = x.bfloat16()
        size = f"Bt {batch} T {steps} D {channels} bf16"
        elements = batch * steps * channels
        io = elements * 2 * 3  # read x; write spikes, v_pre (the fp32 copy of v_pre is the kernel's own)
        io_backward = io + elements * 2 * 3  # + read the two gradients, write dx (v_pre_f32 not counted)
        grads = [torch.randn_like(x), torch.randn_like(x)]
        leaves = [t.clone().requires_grad_() for t in (x, beta, threshold)]
        want = _plif_grads_of(plif_scan_reference, [x, beta, threshold], grads)
        for name, (forward_rule, backward_rule) in (("triton", rules), ("triton_session7_rule", session7)):
            patch(plif_module, _channels_per_program=forward_rule)
            patch(backward_module, _backward_channels=backward_rule)
            error = relative_error(_plif_grads_of(plif_scan, [x, beta, threshold], grads)[3], want[3])
            with torch.no_grad():
                emit("plif_bf16_fwd", size, name, graph_ms(functools.partial(plif_scan, x, beta, threshold)), io,
                     copy_gbs)
            emit("plif_bf16_fwd_bwd", size, name, graph_ms(_plif_training_call(plif_scan, leaves, grads)),
                 io_backward, copy_gbs, rel_err_dx=error)
        patch(plif_module, _channels_per_program=rules[0])
        patch(backward_module, _backward_channels=rules[1])
        speedups("plif_bf16_fwd", size)
        speedups("plif_bf16_fwd_bwd", size)
    torch.cuda.empty_cache()


def bench_poincare(queries: int, slots: int, key_dim: int, value_dim: int, top_k: int, copy_gbs: float) -> None:
    size = f"Nq {queries} S {slots} Dk {key_dim} Dv {value_dim} top_k {top_k}"
    q = torch.randn(queries, key_dim, device="cuda")
    q = q / q.norm(dim=1, keepdim=True) * torch.rand(queries, 1, device="cuda") * 0.9
    keys = torch.randn(slots, key_dim, device="cuda")
    keys = keys / keys.norm(dim=1, keepdim=True) * torch.rand(slots, 1, device="cuda") * 0.9
    values = torch.randn(slots, value_dim, device="cuda")
    occupied = torch.rand(slots, device="cuda") < 0.9
    grad_m = torch.randn(queries, value_dim, device="cuda")
    io = (queries * (key_dim + value_dim) + slots * (key_dim + value_dim)) * 4
    leaf = q.clone().requires_grad_()

    def forward_backward(read):
        def run():
            torch.autograd.grad(read(leaf, keys, values, occupied, 0.1, top_k), leaf, grad_m)
        return run

    compiled = torch.compile(poincare_read_reference)
    error = relative_error(poincare_read(q, keys, values, occupied, 0.1, top_k),
                           poincare_read_reference(q, keys, values, occupied, 0.1, top_k))
    print(json.dumps({"kernel": "poincare_fwd", "size": size, "triton_rel_err_m": error}), flush=True)
    emit("poincare_fwd_bwd", size, "triton", time_ms(forward_backward(poincare_read)), io, copy_gbs)
    emit("poincare_fwd_bwd", size, "torch_eager", time_ms(forward_backward(poincare_read_reference)), io, copy_gbs)
    emit("poincare_fwd_bwd", size, "torch_compile", time_ms(forward_backward(compiled)), io, copy_gbs)
    speedups("poincare_fwd_bwd", size)
    torch.cuda.empty_cache()


def _scan_case(batch: int, steps: int, channels: int, state: int, seed: int):
    generator = torch.Generator(device="cuda").manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=generator)

    inputs = [draw(batch, steps, channels), torch.nn.functional.softplus(draw(batch, steps, channels) - 2),
              -torch.exp(draw(channels, state) * 0.5), draw(batch, steps, 1, state), draw(batch, steps, 1, state),
              draw(channels)]
    return [t.requires_grad_() for t in inputs]


def _grads_of(scan, leaves: list[torch.Tensor], grad_y: torch.Tensor) -> list[torch.Tensor]:
    """The output and the gradients of every leaf (returned, not accumulated into .grad)."""
    y, _ = scan(*leaves)
    return [y, *torch.autograd.grad(y, leaves, grad_y)]


def _plif_case(batch: int, steps: int, channels: int) -> list[torch.Tensor]:
    """x, beta in (0.1, 0.9) and a threshold in (0.5, 1.5), on the GPU."""
    return [torch.randn(batch, steps, channels, device="cuda"), torch.rand(channels, device="cuda") * 0.8 + 0.1,
            torch.rand(channels, device="cuda") + 0.5]


def _plif_training_call(scan, leaves: list[torch.Tensor], grads: list[torch.Tensor]) -> Callable[[], object]:
    """A call of the scan as a training step makes it: forward, then the gradients of the leaves
    from dL/dspikes and dL/dv_pre (returned, not accumulated into .grad)."""

    def run():
        spikes, v_pre, _ = scan(*leaves)
        return torch.autograd.grad([spikes, v_pre], leaves, grads)

    return run


def _plif_grads_of(scan, inputs: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Spikes, v_pre, v_last and the gradients of x, beta and threshold (on fresh leaves)."""
    leaves = [t.clone().requires_grad_() for t in inputs]
    spikes, v_pre, v_last = scan(*leaves)
    return [spikes, v_pre, v_last, *torch.autograd.grad([spikes, v_pre], leaves, grads)]


def patch(module, **values) -> None:
    """Sets a kernel module's tuning knobs for a sweep; a name it does not have is an error (a
    misspelt knob would otherwise sweep nothing)."""
    for name, value in values.items():
        if not hasattr(module, name):
            raise AttributeError(f"{module.__name__} has no {name} to sweep")
        setattr(module, name, value)


def sweep_selective_scan(copy_gbs: float) -> None:
    """Times block-shape variants of the selective scan, each checked against the reference first."""
    scan_module = sys.modules["kernels.selective_scan"]
    backward_module = sys.modules["kernels.selective_scan_backward"]
    check = _scan_case(2, 203, 96, 16, seed=1)
    check_grad = torch.randn(2, 203, 96, device="cuda")
    want = _grads_of(selective_scan_reference, check, check_grad)
    big = _scan_case(8, 4096, 1024, 16, seed=2)
    big_grad = torch.randn(8, 4096, 1024, device="cuda")
    io = 8 * 4096 * (3 * 1024 + 32) * 4
    default_segments = backward_module._backward_segment_chunks
    # (steps a chunk, forward channels a program, forward stages, backward channels, backward stages,
    # backward chunks a segment or None for the kernel's choice); the first is the kernel's own.
    for chunk, fwd_block, fwd_stages, bwd_block, bwd_stages, segment in [
        (8, 16, 5, 8, 3, None), (8, 16, 5, 8, 3, 8), (8, 16, 5, 8, 2, None), (8, 16, 4, 8, 3, None),
        (8, 8, 4, 8, 3, None), (16, 8, 5, 8, 2, None), (8, 16, 5, 4, 3, None), (8, 16, 5, 4, 3, 8),
    ]:
        patch(scan_module, _CHUNK_T=chunk, _FORWARD_STAGES=fwd_stages,
              _forward_block_d=lambda _batch, _channels, block=fwd_block: block)
        patch(backward_module, _BACKWARD_BLOCK_D=bwd_block, _BACKWARD_STAGES=bwd_stages,
              _backward_segment_chunks=default_segments if segment is None
              else lambda _batch, _channels, _chunks, segment=segment: segment)
        config = (f"chunk {chunk} fwd {fwd_block} ch {fwd_stages} stages, bwd {bwd_block} ch {bwd_stages} stages"
                  f", {segment or 'auto'} chunks a segment")
        try:
            got = _grads_of(selective_scan, check, check_grad)
            error = max(relative_error(a, b) for a, b in zip(got, want))
            with torch.no_grad():
                forward_ms = time_ms(lambda: selective_scan(*big), budget_s=0.3)
            both_ms = time_ms(lambda: _grads_of(selective_scan, big, big_grad), budget_s=0.3)
            emit("sweep_scan", config, "triton_fwd", forward_ms, io, copy_gbs, rel_err=error)
            emit("sweep_scan", config, "triton_fwd_bwd", both_ms, 2 * io, copy_gbs)
        except Exception as failure:
            print(json.dumps({"kernel": "sweep_scan", "size": config, "error": str(failure)[:500]}), flush=True)


def sweep_scan_segments(copy_gbs: float) -> None:
    """The selective scan split along time for few rows (`_forward_segment_chunks`,
    `_backward_segment_chunks`): the kernels' own choice against forced segment lengths (0: one
    segment), forward + backward replayed from a CUDA graph (`graph_ms`), each checked against
    the reference first."""
    scan_module = sys.modules["kernels.selective_scan"]
    backward_module = sys.modules["kernels.selective_scan_backward"]
    defaults = (scan_module._forward_segment_chunks, backward_module._backward_segment_chunks)
    check = _scan_case(1, 203, 96, 16, seed=1)
    check_grad = torch.randn(1, 203, 96, device="cuda")
    want = _grads_of(selective_scan_reference, check, check_grad)
    # (forward chunks a segment, backward chunks a segment); None: the kernel's own choice.
    variants = [(None, None), (None, 8), (None, 16), (None, 32), (None, 64), (None, 0), (0, None), (8, None),
                (16, None), (64, None)]
    for batch, steps, channels in [(1, 32768, 1024), (1, 8192, 1024), (2, 4096, 1024), (1, 4096, 1024),
                                   (1, 2048, 2048), (2, 256, 1024)]:
        case = _scan_case(batch, steps, channels, 16, seed=2)
        grad = torch.randn(batch, steps, channels, device="cuda")
        io = batch * steps * (3 * channels + 32) * 4
        for forward, backward in variants:
            patch(scan_module, _forward_segment_chunks=defaults[0] if forward is None
                  else lambda _batch, _channels, chunks, segment=forward: segment or max(chunks, 1))
            patch(backward_module, _backward_segment_chunks=defaults[1] if backward is None
                  else lambda _batch, _channels, chunks, segment=backward: segment or max(chunks, 1))
            config = (f"Bt {batch} T {steps} Dm {channels} N 16, segments of {_segment_name(forward)} chunks forward,"
                      f" {_segment_name(backward)} backward")
            try:
                error = max(relative_error(a, b) for a, b in zip(_grads_of(selective_scan, check, check_grad), want))
                both_ms = graph_ms(lambda case=case, grad=grad: _grads_of(selective_scan, case, grad))
                emit("sweep_scan_segments", config, "triton_fwd_bwd_graph", both_ms, 2 * io, copy_gbs, rel_err=error)
            except Exception as failure:
                print(json.dumps({"kernel": "sweep_scan_segments", "size": config, "error": str(failure)[:500]}),
                      flush=True)
    patch(scan_module, _forward_segment_chunks=defaults[0])
    patch(backward_module, _backward_segment_chunks=defaults[1])


def _segment_name(segment: int | None) -> str:
    return "auto" if segment is None else str(segment or "all")


def sweep_plif_segments(copy_gbs: float) -> None:
    """The PLIF backward for few rows: its own segments and channels a program against forced ones
    (segments: chunks a segment, 0 one segment), forward + backward replayed from a CUDA graph
    (`graph_ms`), each checked against the reference first; ragged rows included."""
    module = sys.modules["kernels.plif_backward"]
    defaults = (module._backward_segment_chunks, module._backward_channels)
    # 128 chunks and ragged channel blocks: every forced length below splits it into segments.
    check = _plif_case(1, 1024, 300)
    check_grads = [torch.randn(1, 1024, 300, device="cuda") for _ in range(2)]
    want = _plif_grads_of(plif_scan_reference, check, check_grads)
    # (chunks a segment, channels a program); None: the kernel's own choice.
    variants = [(None, None), (16, None), (32, None), (64, None), (128, None), (0, None), (None, 32), (None, 64)]
    for batch, steps, channels in [(1, 32768, 2560), (1, 32760, 2560), (1, 8192, 2560), (2, 4096, 2560),
                                   (2, 4000, 2560), (3, 4096, 2560), (1, 4096, 1024)]:
        leaves = [t.requires_grad_() for t in _plif_case(batch, steps, channels)]
        grads = [torch.randn(batch, steps, channels, device="cuda") for _ in range(2)]
        io = batch * steps * channels * 4 * 7  # fwd: x in, spikes and v_pre out; bwd: v_pre, 2 grads in, dx out
        for segment, block in variants:
            patch(module, _backward_segment_chunks=defaults[0] if segment is None
                  else lambda _batch, _channels, t, segment=segment: segment or max(t // module._BACKWARD_CHUNK_T, 1),
                  _backward_channels=defaults[1] if block is None
                  else lambda _batch, _channels, _segments, _size, block=block: block)
            config = (f"Bt {batch} T {steps} D {channels}, {_segment_name(segment)} chunks a segment,"
                      f" {block or 'auto'} channels a program")
            try:
                error = max(relative_error(a, b) for a, b in zip(_plif_grads_of(plif_scan, check, check_grads), want))
                emit("sweep_plif_segments", config, "triton_fwd_bwd_graph",
                     graph_ms(_plif_training_call(plif_scan, leaves, grads)), io, copy_gbs, rel_err=error)
            except Exception as failure:
                print(json.dumps({"kernel": "sweep_plif_segments", "size": config, "error": str(failure)[:500]}),
                      flush=True)
    patch(module, _backward_segment_chunks=defaults[0], _backward_channels=defaults[1])


def sweep_plif(copy_gbs: float) -> None:
    """Times variants of the PLIF scan's backward, each checked against the reference first."""
    plif_backward_module = sys.modules["kernels.plif_backward"]
    # A ragged shape (masked loops), a whole one (unmasked: whole chunks and channel blocks) and one
    # in two time segments by the kernel's own choice (few rows, T two segments).
    checks = []
    for batch, steps, channels in [(2, 203, 300), (2, 256, 256), (1, 512, 256)]:
        checks.append((_plif_case(batch, steps, channels),
                       [torch.randn(batch, steps, channels, device="cuda") for _ in range(2)]))
    want_plif = [_plif_grads_of(plif_scan_reference, *check) for check in checks]
    # The forward's (channels a program, steps an iteration, stages) and the backward's (channels a
    # program, steps a chunk, stages, chunks a segment: None for the kernel's choice, 0 for one
    # segment). The kernel's own first and again later (the spread between repeats is the noise).
    plif_module = sys.modules["kernels.plif"]
    default_forward = (plif_module._channels_per_program, plif_module._forward_unroll_and_stages)
    default_segments = plif_backward_module._backward_segment_chunks
    default_channels = plif_backward_module._backward_channels
    for forward, (backward_block, backward_chunk, backward_stages, segment) in [
        (None, (None, 8, 4, None)), (None, (32, 8, 4, None)), (None, (64, 8, 3, None)),
        ((64, 8, 6), (None, 8, 4, None)), ((64, 8, 8), (None, 8, 4, None)), ((64, 4, 8), (None, 8, 4, None)),
        (None, (None, 8, 4, None)),
    ]:
        if forward is None:
            patch(plif_module, _channels_per_program=default_forward[0], _forward_unroll_and_stages=default_forward[1])
        else:
            patch(plif_module, _channels_per_program=lambda _batch, _channels, _size, block=forward[0]: block,
                  _forward_unroll_and_stages=lambda _batch, _channels, shape=forward[1:]: shape)
        patch(plif_backward_module, _backward_channels=default_channels if backward_block is None
              else lambda _batch, _channels, _segments, _size, block=backward_block: block, _BACKWARD_CHUNK_T=backward_chunk,
              _BACKWARD_STAGES=backward_stages,
              _backward_segment_chunks=default_segments if segment is None
              else lambda _batch, _channels, steps, segment=segment, chunk=backward_chunk: segment or max(steps // chunk, 1))
        config = (f"forward {forward or 'auto'}, backward block {backward_block or 'auto'} chunk {backward_chunk}"
                  f" stages {backward_stages}, {'auto' if segment is None else segment or 'all'} chunks a segment")
        try:
            error = max(relative_error(a, b) for check, want in zip(checks, want_plif)
                        for a, b in zip(_plif_grads_of(plif_scan, *check), want))
            for batch, steps in [(8, 4096), (1, 32768)]:
                x, b2, t2 = leaves = [t.requires_grad_() for t in _plif_case(batch, steps, 2560)]
                grads = [torch.randn_like(x), torch.randn_like(x)]
                with torch.no_grad():
                    forward_ms = time_ms(lambda x=x, b2=b2, t2=t2: plif_scan(x, b2, t2), budget_s=0.3)
                both_ms = time_ms(_plif_training_call(plif_scan, leaves, grads), budget_s=0.3)
                io = batch * steps * 2560 * 4 * 3
                emit("sweep_plif", f"{config} Bt {batch} T {steps}", "triton_fwd", forward_ms, io, copy_gbs,
                     rel_err=error)
                emit("sweep_plif", f"{config} Bt {batch} T {steps}", "triton_fwd_bwd", both_ms, io + io * 4 // 3,
                     copy_gbs)
        except Exception as failure:
            print(json.dumps({"kernel": "sweep_plif", "size": config, "error": str(failure)[:500]}), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, help="also write the rows here as JSON lines")
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument("--sweep", action="store_true", help="time block-shape variants of the scans instead")
    parser.add_argument("--only", nargs="*", default=None,
                        help="kernels to run (adamw grad_norms scan plif plif_bf16 poincare; with --sweep also "
                        "scan_segments plif_segments)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    wanted = set(args.only) if args.only else {"adamw", "grad_norms", "scan", "plif", "plif_bf16", "poincare"}
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}), flush=True)
    copy_gbs = copy_bandwidth()
    if args.sweep:
        if "scan" in wanted:
            sweep_selective_scan(copy_gbs)
        if "scan" in wanted or "scan_segments" in wanted:
            sweep_scan_segments(copy_gbs)
        if "plif" in wanted:
            sweep_plif(copy_gbs)
        if "plif" in wanted or "plif_segments" in wanted:
            sweep_plif_segments(copy_gbs)
        if args.out:
            args.out.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
        return 0
    params = 10**7 if args.quick else 2 * 10**9
    scan_sizes = [(2, 512, 256, 16)] if args.quick else [(8, 4096, 1024, 16), (1, 32768, 1024, 16)]
    plif_sizes = [(2, 512, 256)] if args.quick else [(8, 4096, 2560), (1, 32768, 2560)]
    runs: list[tuple[str, Callable[[], None]]] = [
        ("adamw", lambda: bench_adamw(params, copy_gbs, compile_reference=True)),
        ("grad_norms", lambda: bench_grad_norms(params, 300, copy_gbs)),
    ]
    for index, (batch, steps, channels, state) in enumerate(scan_sizes):
        runs.append(("scan", lambda b=batch, t=steps, c=channels, n=state, first=index == 0:
                     bench_selective_scan(b, t, c, n, copy_gbs, references=first)))
    for index, (batch, steps, channels) in enumerate(plif_sizes):
        runs.append(("plif", lambda b=batch, t=steps, c=channels, first=index == 0:
                     bench_plif(b, t, c, copy_gbs, references=first)))
    if not args.quick:
        runs.append(("plif_bf16", lambda: bench_plif_bf16(copy_gbs)))
    for top_k in (4, 0):
        runs.append(("poincare", lambda k=top_k: bench_poincare(512 if args.quick else 32768, 512, 32, 256, k,
                                                                copy_gbs)))
    for name, run in runs:
        if name not in wanted:
            continue
        try:
            run()
        except Exception as error:  # one kernel's failure must not hide the others' figures
            failure = {"kernel": name, "error": f"{type(error).__name__}: {error}"[:2000]}
            ROWS.append(failure)
            print(json.dumps(failure), flush=True)
            torch.cuda.empty_cache()
        if args.out:  # after every kernel, so a run cut short still leaves its rows
            args.out.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
