"""PSSA model: exact size, gradients, causality, TBPTT chunking, Ouro loops, state, probes."""

from __future__ import annotations

import copy
import dataclasses
import io
import math

import pytest
import torch
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode

from engine.models.base import IGNORE_INDEX
from engine.models.pssa.config import PRESETS, PSSAConfig
from engine.models.pssa.memory import to_poincare_ball
from engine.models.pssa.model import PSSALM

# Tiny enough for float64 gradcheck: two blocks, two Ouro passes, a bank of three slots.
GRADCHECK = PSSAConfig(
    vocab_size=7, d_latent=4, d_state=3, d_mem_key=2, mem_capacity=3, chunk_len=4, mem_top_k=2,
    depth=2, loops=2, adapter_rank=2, tau_mem=0.5,
)  # fmt: skip
SMALL = PSSAConfig(
    vocab_size=32, d_latent=8, d_state=4, d_mem_key=4, mem_capacity=8, chunk_len=6, depth=2,
    adapter_rank=2, write_loss_threshold=0.0,
)  # fmt: skip


def _model(config: PSSAConfig, seed: int = 0) -> PSSALM:
    torch.manual_seed(seed)
    model = PSSALM(config)
    # Non-zero zero-initialised branches, so every path carries signal in the checks.
    with torch.no_grad():
        for block in model.blocks:
            block.adapter_up.weight.normal_(0, 0.3)
            block.mlp_down.weight.normal_(0, 0.3)
    return model


def _fill_banks(model: PSSALM, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    config = model.config
    dtype = model.head.weight.dtype
    for block in model.blocks:
        keys = to_poincare_ball(torch.randn(config.mem_capacity, config.d_mem_key, generator=generator))
        values = torch.randn(config.mem_capacity, config.d_latent, generator=generator)
        block.bank.write(keys.to(dtype), values.to(dtype), [9.0] * config.mem_capacity, update=0)


def test_article_model_has_exactly_1544704_parameters() -> None:
    assert PSSALM(PRESETS["pssa-1.5m"]).num_parameters() == 1_544_704


def test_every_parameter_in_one_group_and_a_layer() -> None:
    model = _model(PRESETS["pssa-tiny"])
    grouped = [name for group in model.param_groups() for name, _ in group.params]
    assert sorted(grouped) == sorted(name for name, _ in model.named_parameters())
    no_decay = {name for group in model.param_groups() if not group.weight_decay for name, _ in group.params}
    assert "blocks.0.A_raw" in no_decay and "blocks.1.norm.weight" in no_decay
    assert {model.layer_of(name) for name in grouped} == {"embed", "head", "layer00", "layer01"}


def test_gradcheck_float64_through_scan_memory_loops_and_stack() -> None:
    model = _model(GRADCHECK).double().eval()
    _fill_banks(model)
    names = [
        "blocks.0.A_raw", "blocks.0.W_delta.weight", "blocks.0.W_qh.weight", "blocks.0.W_proj.weight",
        "blocks.1.W_qx.weight", "blocks.1.W_gate.weight", "blocks.1.adapter_down.weight",
        "blocks.1.norm.bias", "blocks.0.W_B.weight", "blocks.1.mlp_up.weight",
    ]  # fmt: skip
    params = dict(model.named_parameters())
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 7, (2, 4), generator=generator)
    carry = 0.1 * torch.randn(2, 2, 2, 4, 3, generator=generator, dtype=torch.float64)

    class OnePiece(torch.nn.Module):
        """The final stream (what the head reads) and the carry out of one TBPTT piece. The loss
        is float32 by contract, so the check stops before it; and it stays within one piece,
        since the carry between pieces is detached on purpose (finite differences would see
        through that cut, autograd does not)."""

        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, tokens: torch.Tensor, carry: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            stream, carry_out, _ = self.model.hidden(tokens, carry)
            return stream, carry_out

    piece = OnePiece()

    def stream(carry_in: torch.Tensor, *values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights = {f"model.{name}": value for name, value in zip(names, values)}
        return functional_call(piece, weights, (tokens, carry_in), strict=False)

    inputs = tuple(params[name].detach().clone().requires_grad_(True) for name in names)
    carry.requires_grad_(True)
    assert torch.autograd.gradcheck(stream, (carry, *inputs), eps=1e-6, atol=1e-6, fast_mode=True)


def test_loss_at_t_ignores_later_tokens() -> None:
    model = _model(SMALL).eval()
    _fill_banks(model)
    generator = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, 32, (2, 15), generator=generator)
    targets = torch.randint(0, 32, (2, 15), generator=generator)
    loss, _ = model(tokens, targets)
    for t in (2, 5, 9):  # inside the first chunk, at its last token, inside the second
        changed_tokens, changed_targets = tokens.clone(), targets.clone()
        changed_tokens[:, t + 1 :] = (changed_tokens[:, t + 1 :] + 7) % 32
        changed_targets[:, t + 1 :] = (changed_targets[:, t + 1 :] + 3) % 32
        changed, _ = model(changed_tokens, changed_targets)
        assert torch.equal(changed[:, : t + 1], loss[:, : t + 1])
        assert not torch.equal(changed[:, t + 1 :], loss[:, t + 1 :])


def test_chunked_rows_equal_one_long_row_with_writes_and_exact_carry() -> None:
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 32, (3, 18), generator=generator)
    whole = _model(SMALL).train()
    pieces = copy.deepcopy(whole)
    loss, carry = whole(tokens[:, :-1], tokens[:, 1:])
    assert all(block.bank.count > 0 for block in whole.blocks)  # the threshold 0 writes every chunk
    first, carry_first = pieces(tokens[:, :6], tokens[:, 1:7])
    second, carry_second = pieces(tokens[:, 6:17], tokens[:, 7:18], carry_first)
    assert torch.equal(torch.cat([first, second], dim=1), loss)
    assert torch.equal(carry_second, carry)
    for a, b in zip(whole.blocks, pieces.blocks):
        assert torch.equal(a.bank.keys, b.bank.keys) and a.bank.count == b.bank.count


def test_split_inside_a_chunk_equals_the_whole_chunk_when_nothing_is_written() -> None:
    # In fp64, so that 1e-6 tests the structure and not the CPU's fp32 rounding: in fp32 this
    # failed on the H200 machine's x86 CPU (other vector paths), though it passed here; in fp64 it
    # passes on both.
    model = _model(SMALL).double().eval()
    _fill_banks(model)
    tokens = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(6))
    loss, carry = model(tokens, tokens)
    head, carry_head = model(tokens[:, :2], tokens[:, :2])
    tail, carry_tail = model(tokens[:, 2:], tokens[:, 2:], carry_head)
    assert torch.allclose(torch.cat([head, tail], dim=1), loss, rtol=0, atol=1e-6)
    assert torch.allclose(carry_tail, carry, rtol=0, atol=1e-6)


def test_gradient_stops_at_chunk_edges() -> None:
    model = _model(SMALL).eval()
    first = torch.arange(1, 7).repeat(2, 1)  # ids 1..6 only in the first chunk
    second = torch.arange(10, 16).repeat(2, 1)  # ids 10..15 only in the second
    tokens = torch.cat([first, second], dim=1)
    loss, _ = model(tokens, tokens)
    loss[:, 6:].sum().backward()
    assert torch.count_nonzero(model.embed.weight.grad[1:7]) == 0
    assert torch.count_nonzero(model.embed.weight.grad[10:16]) > 0


def _stack(model: PSSALM, u: torch.Tensor, carry: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The blocks written out by hand: u0 = b0(e), u_i = u_{i-1} + b_i(u_{i-1}) / sqrt(depth)."""
    states = []
    for index, block in enumerate(model.blocks):
        out, h_last, _ = block(u, carry[index])
        u = out if index == 0 else u + out / math.sqrt(len(model.blocks))
        states.append(h_last)
    return u, states


@pytest.mark.parametrize("loops", [1, 2])
def test_ouro_passes_share_weights_and_keep_their_own_carry(loops: int) -> None:
    config = dataclasses.replace(SMALL, loops=loops)
    model = _model(config).eval()
    _fill_banks(model)
    tokens = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(7))
    carry = 0.1 * torch.randn(loops, 2, 2, 8, 4, generator=torch.Generator().manual_seed(8))
    loss, new_carry = model(tokens, tokens, carry)
    with torch.no_grad():
        u, states = _stack(model, model.embed(tokens), carry[0])
        expected_carry = [torch.stack(states)]
        for loop in range(1, loops):
            update, states = _stack(model, u, carry[loop])
            u = u + update / loops
            expected_carry.append(torch.stack(states))
        logits = model.head(u) / math.sqrt(8)
        expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten(), reduction="none")
    assert torch.allclose(loss.flatten(), expected, rtol=0, atol=1e-6)
    assert torch.allclose(new_carry, torch.stack(expected_carry), rtol=1e-5, atol=1e-6)
    if loops == 2:
        assert not torch.allclose(new_carry[0], new_carry[1])


def test_rates_are_cached_until_a_raw_changes() -> None:
    block = _model(SMALL).blocks[0]
    with torch.no_grad():
        first = block.rates()
        assert block.rates() is first  # unchanged: no recomputation
        block.A_raw[0, 0] += 1.0  # in-place write bumps the version counter
        second = block.rates()
    assert second is not first
    assert torch.equal(second, -torch.nn.functional.softplus(block.A_raw.detach()))
    # The flat-buffer optimizer's way: the parameter is a .data view of a buffer it writes.
    flat = block.A_raw.detach().clone().flatten()
    block.A_raw.data = flat.view(8, 4)
    with torch.no_grad():
        block.rates()
        version = block.A_raw._version
        flat.mul_(0.5)
        assert block.A_raw._version == version  # the version counter misses this write
        assert torch.equal(block.rates(), -torch.nn.functional.softplus(flat.view(8, 4)))
    rates = block.rates()  # with grad: the cached values, and the exact derivative
    rates.sum().backward()
    assert torch.allclose(block.A_raw.grad, -torch.sigmoid(block.A_raw.detach()))


def test_initial_time_constants_are_log_spaced() -> None:
    block = _model(PRESETS["pssa-1.5m"]).blocks[0]
    tau = 1 / torch.nn.functional.softplus(block.A_raw.detach().double())  # (d, N)
    expected = torch.logspace(math.log10(1.5), math.log10(200.0), 16, dtype=torch.float64)
    assert torch.allclose(tau, expected.expand(256, 16), rtol=1e-5)


def test_cpu_forward_is_bitwise_deterministic() -> None:
    tokens = torch.randint(0, 32, (2, 13), generator=torch.Generator().manual_seed(9))
    a, b = _model(SMALL).train(), _model(SMALL).train()
    loss_a, carry_a = a(tokens, tokens)
    loss_b, carry_b = b(tokens, tokens)
    assert torch.equal(loss_a, loss_b) and torch.equal(carry_a, carry_b)


class _HostReads(TorchDispatchMode):
    """Records the ops a CUDA graph capture cannot hold: reading a value on the host (`.item()`,
    `float()`, `int()`, `if tensor`), host data made a tensor (`torch.tensor(list)`, a copy to
    the device on CUDA), and outputs whose shape depends on the data. Not seen from the CPU:
    `tolist()` (it reads memory without an op) and `torch.equal`, which only the CPU path of
    `PSSABlock.rates` calls."""

    FLAGGED = frozenset({
        torch.ops.aten._local_scalar_dense, torch.ops.aten.lift_fresh, torch.ops.aten.nonzero,
        torch.ops.aten.masked_select, torch.ops.aten._unique2,
    })  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(
        self, func: torch._ops.OpOverload, types: tuple, args: tuple = (), kwargs: dict | None = None
    ) -> object:
        if func.overloadpacket in self.FLAGGED:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_training_step_reads_nothing_on_the_host() -> None:
    """Four pieces of three rows into banks of eight slots: appends, then a full bank whose head
    slot resists, a row without targets (nan loss), the dreaming record, then the backward."""
    model = _model(SMALL).train()
    model.set_update(7)
    tokens = torch.randint(0, 32, (3, 24), generator=torch.Generator().manual_seed(13))
    targets = torch.roll(tokens, -1, dims=1)
    targets[1, :6] = IGNORE_INDEX
    with _HostReads() as reads:
        loss, _ = model(tokens, targets)
        loss.sum().backward()
    assert reads.seen == []
    assert all(block.bank.count == 8 and block.bank.counters.defended > 0 for block in model.blocks)
    assert len(model.dream_cache) == 8


def test_training_and_loading_keep_every_buffer_in_place() -> None:
    """A captured step replays on fixed addresses, so a training forward, a checkpoint load and
    the clock write the model's buffers (banks, update clock, dreaming record) in place."""
    model = _model(SMALL).train()
    addresses = {name: buffer.data_ptr() for name, buffer in model.named_buffers()}
    tokens = torch.randint(0, 32, (3, 13), generator=torch.Generator().manual_seed(14))
    model(tokens, tokens)[0].sum().backward()
    model.load_extra_state_dict(model.extra_state_dict())
    model.set_update(3)
    assert {name: buffer.data_ptr() for name, buffer in model.named_buffers()} == addresses
    assert model.blocks[0].bank.count > 0


def test_extra_state_round_trip_restores_banks_and_outputs() -> None:
    model = _model(SMALL).train()
    tokens = torch.randint(0, 32, (3, 13), generator=torch.Generator().manual_seed(10))
    model.set_update(42)
    model(tokens, tokens)
    model.consolidate()
    buffer = io.BytesIO()
    torch.save({"params": model.state_dict(), "extra": model.extra_state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    restored = PSSALM(SMALL)
    restored.load_state_dict(saved["params"])
    restored.load_extra_state_dict(saved["extra"])
    assert restored.update == 42 and len(restored.dream_cache) == len(model.dream_cache)
    for a, b in zip(model.blocks, restored.blocks):
        assert a.bank.count == b.bank.count and a.bank.head == b.bank.head
        assert torch.equal(a.bank.values, b.bank.values) and torch.equal(a.bank.confidence, b.bank.confidence)
        assert torch.equal(a.consolidated_up, b.consolidated_up)
    model.eval(), restored.eval()
    assert torch.equal(model(tokens, tokens)[0], restored(tokens, tokens)[0])


def test_extra_state_of_another_shape_is_refused() -> None:
    state = _model(SMALL).extra_state_dict()
    # The setting that changed is named (a line's run.json changed it since the checkpoint).
    with pytest.raises(ValueError, match="saved with mem_capacity .*set model.overrides.mem_capacity back to"):
        PSSALM(dataclasses.replace(SMALL, mem_capacity=4)).load_extra_state_dict(state)
    misshapen = {**state, "blocks.1.bank.keys": state["blocks.1.bank.keys"][:, :2]}
    with pytest.raises(ValueError, match="bank.keys has shape"):
        PSSALM(SMALL).load_extra_state_dict(misshapen)


def test_consolidation_moves_fast_weight_into_slow_exactly() -> None:
    model = _model(SMALL)
    block = model.blocks[0]
    fast_before = block.adapter_up.weight.detach().clone()
    model.consolidate()
    assert torch.allclose(block.consolidated_up, 0.01 * fast_before, rtol=1e-6, atol=0)
    assert torch.allclose(block.adapter_up.weight, 0.99 * fast_before, rtol=1e-6, atol=0)
    assert torch.allclose(block.adapter_up.weight + block.consolidated_up, fast_before, rtol=0, atol=1e-7)


def test_probes_on_hand_built_state() -> None:
    model = _model(SMALL).eval()
    rates = torch.tensor([0.5, 0.25, 0.125, 0.0625])  # softplus(A_raw) per state, every channel
    with torch.no_grad():
        for block in model.blocks:
            block.W_delta.weight.zero_()  # delta = softplus(0) = ln 2 at every token
            block.A_raw.copy_(torch.log(torch.expm1(rates)).expand(8, 4))
    # Block 0: three slots at the same key, so a top-4 read spreads evenly over 3; block 1 empty.
    model.blocks[0].bank.write(torch.zeros(3, 4), torch.randn(3, 8), [9.0] * 3, update=0)
    tokens = torch.randint(0, 32, (2, 10), generator=torch.Generator().manual_seed(11))
    probes = model.probes(tokens, tokens, eos_id=0)
    taus = 1 / (rates.double() * math.log(2.0))  # 2.885, 5.771, 11.54, 23.08 tokens
    assert probes["pssa/memory_occupancy"] == pytest.approx(3 / 16)
    assert probes["pssa/read_entropy"] == pytest.approx(math.log(3.0), abs=1e-6)
    assert probes["pssa/ssm_tau_max"] == pytest.approx(float(taus.max()), rel=1e-6)
    assert probes["pssa/ssm_tau_p50"] == pytest.approx(float(taus.median()), rel=1e-6)
    assert model.blocks[1].bank.count == 0  # probing never writes


def test_probes_per_block_on_hand_built_banks() -> None:
    model = _model(SMALL).eval()
    bank = model.blocks[0].bank
    bank.write(torch.zeros(2, 4), torch.randn(2, 8), [9.0, 9.0], update=3)
    bank.confidence[:2] = torch.tensor([0.9, 0.3])
    bank.last_touched[:2] = torch.tensor([3, 8])
    bank.write_counts[1:] = torch.tensor([5, 4])  # overwrites, defended
    model.set_update(20)
    saved = model.extra_state_dict()
    tokens = torch.randint(0, 32, (2, 10), generator=torch.Generator().manual_seed(11))
    probes = model.probes(tokens, tokens, eos_id=0)
    assert {key: value for key, value in probes.items() if key.startswith("pssa/block00/")} == {
        "pssa/block00/occupancy": 2 / 8, "pssa/block00/writes": 2.0, "pssa/block00/overwrites": 5.0,
        "pssa/block00/defended": 4.0, "pssa/block00/confidence_mean": pytest.approx(0.6),
        "pssa/block00/confidence_min": pytest.approx(0.3), "pssa/block00/age_mean": 14.5,
        "pssa/block00/age_max": 17.0,
    }  # fmt: skip
    # An empty bank has counts and occupancy but no slot to give a confidence or an age.
    assert {key: value for key, value in probes.items() if key.startswith("pssa/block01/")} == {
        "pssa/block01/occupancy": 0.0, "pssa/block01/writes": 0.0, "pssa/block01/overwrites": 0.0,
        "pssa/block01/defended": 0.0,
    }  # fmt: skip
    after = model.extra_state_dict()
    assert saved.keys() == after.keys() and all(torch.equal(saved[key], after[key]) for key in saved)


def test_flops_per_token_counts_matrices_scan_and_read() -> None:
    model = PSSALM(PRESETS["pssa-1.5m"])
    matrices = 6 * (3 * 256 * 256 + 2 * 256 * 16 + 2 * 256 * 32 + 2 * 256 * 16 + 4 * 256 * 256 + 256 * 2048)
    scan_and_read = 3 * (8 * 256 * 16 + 3 * 32 * 512 + 2 * 4 * 256)
    assert model.flops_per_token(64) == matrices + scan_and_read


def test_bad_carry_is_refused() -> None:
    model = _model(SMALL)
    tokens = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="carry has shape"):
        model(tokens, tokens, torch.zeros(1, 2, 3, 8, 4))


@pytest.mark.cuda
def test_cuda_matches_cpu_and_trains_under_bf16_autocast() -> None:
    config = dataclasses.replace(PRESETS["pssa-tiny"], write_loss_threshold=0.0)
    cpu = _model(config).train()
    gpu = copy.deepcopy(cpu).cuda()
    tokens = torch.randint(0, 256, (4, 41), generator=torch.Generator().manual_seed(12))
    loss_cpu, carry_cpu = cpu(tokens[:, :-1], tokens[:, 1:])
    loss_gpu, carry_gpu = gpu(tokens[:, :-1].cuda(), tokens[:, 1:].cuda())
    # Two fp32 orders of the same sums, each off the fp64 model by its own rounding. Measured on the
    # H200 (2026-11-29) against the fp64 model: row losses within 6.0e-5 (CPU) and 7.0e-5 (GPU;
    # 8.3e-5 with the reference scan in place of the kernel); the carried states (values up to 18)
    # within 2.0e-4 (CPU), 2.1e-4 (GPU) and 4.1e-4 (GPU, reference scan).
    assert torch.allclose(loss_gpu.cpu(), loss_cpu, rtol=0, atol=2e-4)
    assert torch.allclose(carry_gpu.cpu(), carry_cpu, rtol=1e-4, atol=1e-3)
    for a, b in zip(cpu.blocks, gpu.blocks):
        assert a.bank.count == b.bank.count and b.bank.keys.is_cuda
        # An element that cancels keeps the rounding of the terms it came from, and the values reach
        # 66 and 135 (an fp32 ulp there is 8e-6 and 1.5e-5): allowed 2e-5 of the largest value. The
        # GPU's differed by 7.6e-4 at one element of 512 on an H100 (2026-12-06; 5e-4 passed on the H200).
        scale = float(a.bank.values.abs().max())
        torch.testing.assert_close(b.bank.values.cpu(), a.bank.values, rtol=1e-4, atol=2e-5 * scale)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss, _ = gpu(tokens[:, :-1].cuda(), tokens[:, 1:].cuda(), carry_gpu)
    loss.sum().backward()
    assert torch.isfinite(loss).all()
    assert all(torch.isfinite(p.grad).all() for p in gpu.parameters() if p.grad is not None)
    restored = _model(config).cuda()
    restored.load_extra_state_dict({k: v.cuda() for k, v in gpu.extra_state_dict().items()})
    assert restored.blocks[0].bank.keys.is_cuda and restored.blocks[0].bank.confidence.is_cuda


@pytest.mark.cuda
def test_a_captured_training_step_replays_like_eager_steps() -> None:
    """A forward+backward captured as a CUDA graph, replayed at two update clocks, leaves the
    losses, banks and dreaming record that two eager steps leave (the memory state carries from
    replay to replay through the buffers)."""
    config = dataclasses.replace(PRESETS["pssa-tiny"], write_loss_threshold=0.0, mem_capacity=8)
    eager = _model(config).cuda().train()
    graphed = copy.deepcopy(eager)
    tokens = torch.randint(0, 256, (3, 41), generator=torch.Generator().manual_seed(15)).cuda()
    inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: ignored targets, nan row losses, nothing written
        for _ in range(2):
            loss, _ = graphed(inputs, torch.full_like(targets, IGNORE_INDEX))
            loss.sum().backward()
    torch.cuda.current_stream().wait_stream(side)
    assert all(block.bank.count == 0 for block in graphed.blocks)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured_loss, _ = graphed(inputs, targets)
        captured_loss.sum().backward()
    for update in (5, 6):
        graphed.set_update(update)
        graph.replay()
        eager.set_update(update)
        eager_loss, _ = eager(inputs, targets)
        eager_loss.sum().backward()
        torch.testing.assert_close(captured_loss, eager_loss)
        for a, b in zip(graphed.blocks, eager.blocks):
            assert (a.bank.count, a.bank.head, a.bank.counters) == (b.bank.count, b.bank.head, b.bank.counters)
            assert torch.equal(a.bank.last_touched, b.bank.last_touched)
            for name in ("keys", "values", "confidence"):
                torch.testing.assert_close(getattr(a.bank, name), getattr(b.bank, name))
    assert graphed.blocks[0].bank.counters.defended > 0  # 2 x 3 rows x 3 pieces met 8 slots
    cached = [torch.stack(pair) for pair in graphed.dream_cache.sequences]
    expected = [torch.stack(pair) for pair in eager.dream_cache.sequences]
    assert len(cached) == 8 and all(torch.equal(a, b) for a, b in zip(cached, expected))
