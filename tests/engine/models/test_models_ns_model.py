"""The NS model as a whole: gradients, causality, the carry, recomputation, presets and the interface."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.errors import ConfigError
from engine.models import common
from engine.models.base import IGNORE_INDEX
from engine.models.ns import hippocampal as ns_hippocampal
from engine.models.ns.dendritic import DendriticLayer
from engine.models.ns.model import NSLM, NSConfig
from engine.models.ns.pool_read import pool_read_explicit
from engine.models.ns.presets import PRESETS

# Small enough for float64 gradient checks: three dendritic layers, then one hippocampal.
MICRO = NSConfig(
    vocab_size=13,
    eos_id=2,
    d_model=8,
    n_layers=4,
    dendritic_heads=2,
    dendritic_head_dim=3,
    dendritic_state=2,
    dendritic_groups=2,
    chunk_len=4,
    attn_heads=2,
    attn_head_dim=4,
    ffn_dim=6,
)


def build(config: NSConfig = MICRO, seed: int = 0, **overrides) -> NSLM:
    torch.manual_seed(seed)
    return NSLM(dataclasses.replace(config, **overrides))


def random_tokens(batch: int, length: int, vocab: int = MICRO.vocab_size, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def float64_rms_norm(self, x):
    """common.RMSNorm computes in float32; the same arithmetic kept in the input's float64."""
    normed = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
    return normed * self.weight


class Logits(torch.nn.Module):
    """The model's logits as a module's forward, for torch.func.functional_call."""

    def __init__(self, model: NSLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.model.hidden(tokens)
        return self.model.logits_from_hidden(hidden)


def test_whole_model_gradients_match_finite_differences(monkeypatch):
    # Thresholds far above any membrane: no neuron fires and the surrogate's weight is
    # exp(-4 * 2000)-small, so apart from the spikes (their surrogate is tested in
    # test_models_ns_neurons) every gradient of the model must equal the finite differences.
    monkeypatch.setattr(common.RMSNorm, "forward", float64_rms_norm)
    # One dendritic and one hippocampal layer; single-threaded (tiny ops only lose to threads).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    wrapper = Logits(build(threshold_init=2000.0, n_layers=2, hippocampal_every=2, init_std=0.5).double())
    tokens = random_tokens(2, 7)
    tokens[0, 3] = MICRO.eos_id
    names = [name for name, _ in wrapper.named_parameters()]
    values = tuple(p.detach().clone().requires_grad_() for p in wrapper.parameters())

    def logits(*params):
        return torch.func.functional_call(wrapper, dict(zip(names, params)), (tokens,))

    try:
        assert torch.autograd.gradcheck(logits, values, fast_mode=True)
    finally:
        torch.set_num_threads(threads)


def test_causality_a_later_token_never_changes_an_earlier_loss(one_thread):
    model = build()
    tokens = random_tokens(2, 19)
    loss, _ = model(tokens, tokens)
    for position in (0, 5, 12, 18):
        changed = tokens.clone()
        changed[:, position] = (changed[:, position] + 1) % MICRO.vocab_size
        changed_loss, _ = model(changed, tokens)
        torch.testing.assert_close(changed_loss[:, :position], loss[:, :position], rtol=0, atol=1e-6)
        assert not torch.allclose(changed_loss[:, position:], loss[:, position:])


def test_the_carry_continues_a_row_exactly_across_windows(one_thread):
    # Dendritic layers only: everything that crosses a window is in the carry.
    model = build(hippocampal_every=0).double()
    tokens = random_tokens(2, 23)
    whole, whole_carry = model(tokens, tokens)
    first, carry = model(tokens[:, :9], tokens[:, :9])
    rest, rest_carry = model(tokens[:, 9:], tokens[:, 9:], carry)
    torch.testing.assert_close(torch.cat([first, rest], dim=1).double(), whole.double(), rtol=1e-6, atol=1e-6)
    assert whole_carry.keys() == rest_carry.keys() == {f"layer0{i}.{n}" for i in range(4) for n in ("compartments", "soma")}
    for name in whole_carry:
        torch.testing.assert_close(rest_carry[name], whole_carry[name], rtol=1e-10, atol=1e-10)
    fresh, _ = model(tokens[:, 9:], tokens[:, 9:])
    assert not torch.allclose(fresh, rest)  # the carry is used


def test_the_hippocampal_clock_and_write_gate_continue_across_windows(one_thread):
    # Layer 3 reads the dendritic layers' output, which the carry continues exactly; its pool
    # read is within the window, so only the state before the read is compared.
    model = build().double()
    tokens = random_tokens(2, 21)
    tokens[:, 4] = MICRO.eos_id
    _, whole = model(tokens, tokens)
    _, carry = model(tokens[:, :10], tokens[:, :10])
    _, rest = model(tokens[:, 10:], tokens[:, 10:], carry)
    for name in ("layer03.clock", "layer03.write_gate"):
        torch.testing.assert_close(rest[name], whole[name], rtol=1e-10, atol=1e-10)
    assert all(not value.requires_grad for value in rest.values())


def test_a_carry_from_another_model_is_refused():
    with pytest.raises(ValueError, match="layer00.compartments"):
        build()(random_tokens(1, 4), random_tokens(1, 4), {"layer00.soma": torch.zeros(1, 6)})


@pytest.mark.parametrize("mode", ["all", "dendritic", "hippocampal", "dendritic:2"])
def test_recomputation_changes_nothing_but_memory(one_thread, mode):
    tokens = random_tokens(2, 11)
    reference, recomputed = build(), build()
    recomputed.recompute = mode
    results = []
    for model in (reference, recomputed):
        loss, _ = model(tokens, tokens)
        loss.sum().backward()
        results.append((loss, [p.grad for p in model.parameters()]))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=0)
    for recomputed_grad, reference_grad in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(recomputed_grad, reference_grad, rtol=1e-6, atol=1e-9)
    with pytest.raises(ValueError, match="recompute must be one of"):
        recomputed.recompute = "some"
    assert recomputed.recompute == mode  # a refused setting leaves the one in force


def test_a_kind_with_a_count_recomputes_that_many_of_its_layers_whole():
    model = build()
    dendritic = [index for index, layer in enumerate(model.layers) if isinstance(layer, DendriticLayer)]
    model.recompute = "dendritic:2"
    assert [not layer.recompute_parts for layer in model.layers] == [
        index in dendritic[:2] for index in range(len(model.layers))
    ]
    for setting in ("dendritic:0", f"dendritic:{len(dendritic) + 1}", "dendritic:x", "all:1"):
        with pytest.raises(ValueError, match="recompute"):
            model.recompute = setting


def test_ignored_targets_have_zero_loss_and_the_forward_is_deterministic(one_thread):
    model = build()
    tokens = random_tokens(2, 9)
    targets = tokens.clone()
    targets[0, :4] = IGNORE_INDEX
    loss, carry = model(tokens, targets)
    again, carry_again = model(tokens, targets)
    assert loss.dtype == torch.float32 and loss.shape == (2, 9)
    assert torch.equal(loss[0, :4], torch.zeros(4)) and (loss[0, 4:] > 0).all()
    assert torch.equal(loss, again)
    assert all(torch.equal(carry[name], carry_again[name]) for name in carry)
    assert torch.equal(build(seed=3).embed.weight, build(seed=3).embed.weight)


def test_parameter_groups_and_layer_buckets():
    model = build()
    groups = model.param_groups()
    grouped = [name for group in groups for name, _ in group.params]
    assert sorted(grouped) == sorted(name for name, _ in model.named_parameters())
    decay = {name for name, _ in groups[0].params}
    assert "layers.0.in_proj.weight" in decay and "embed.weight" in decay
    assert "layers.0.A_log" not in decay and "layers.3.clock_log_rate" not in decay
    assert model.layer_of("layers.3.qkv.weight") == "layer03"
    assert model.layer_of("embed.weight") == "embed"
    assert model.layer_of("final_norm.weight") == "final_norm"
    assert not hasattr(model, "head")  # the output head is the embedding


def test_flops_count_matrices_scan_and_attention():
    model = build(PRESETS["ns-tiny"])
    config = model.config
    matrices = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    short, long = model.flops_per_token(128), model.flops_per_token(4096)
    assert short > 6 * (matrices + config.vocab_size * config.d_model)
    # The growth with the row is the attention of the one hippocampal layer (12 * width per
    # key seen) and the chunked scan's state passing between chunks.
    attention_growth = 12 * config.attn_width * (4096 - 128) / 2
    assert attention_growth < long - short < 1.5 * attention_growth


@pytest.mark.parametrize(("name", "target"), [("ns-2b", 2.0e9), ("ns-1p3b", 1.3e9)])
def test_large_presets_have_their_advertised_size(name, target):
    with torch.device("meta"):
        model = NSLM(PRESETS[name])
    count = model.num_parameters()
    print(f"{name}: {count:,} parameters")
    assert abs(count - target) / target < 0.05
    assert model.longest_context == PRESETS[name].rope_max_seq_len


def test_small_presets_build_and_run(one_thread):
    for name in ("ns-tiny", "tiny-32k"):
        with torch.device("meta"):
            model = NSLM(PRESETS[name])
        assert model.longest_context == (32768 if name == "tiny-32k" else PRESETS[name].rope_max_seq_len)
    model = build(PRESETS["ns-tiny"])
    tokens = random_tokens(1, 70, vocab=PRESETS["ns-tiny"].vocab_size)
    loss, carry = model(tokens, tokens)
    assert torch.isfinite(loss).all() and len(carry) == 10


def test_invalid_shapes_are_refused_with_the_field_named():
    with pytest.raises(ConfigError, match="dendritic_heads .6. must be a multiple of dendritic_groups .4."):
        build(dendritic_heads=6, dendritic_groups=4)
    with pytest.raises(ConfigError, match="attn_head_dim must be even"):
        build(attn_head_dim=5)
    with pytest.raises(ConfigError, match="beta_max must be in"):
        build(beta_max=1.0)
    with pytest.raises(ConfigError, match="eos_id must be in"):
        build(eos_id=13)
    with pytest.raises(ConfigError, match="compile_scan must be true or false, got 'yes'"):
        build(compile_scan="yes")


def test_a_few_updates_lower_the_loss_on_a_repeated_row(one_thread):
    model = build()
    tokens = random_tokens(2, 16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    losses = []
    for _ in range(12):
        loss, _ = model(tokens, tokens.roll(-1, dims=1))
        optimizer.zero_grad()
        loss.mean().backward()
        optimizer.step()
        losses.append(loss.mean().item())
    assert losses[-1] < 0.7 * losses[0]


@pytest.mark.cuda
def test_cuda_forward_backward_with_the_pool_kernel_matches_the_explicit_read(monkeypatch):
    """The hippocampal layers' Triton pool read (the CUDA path) against the explicit biased softmax."""
    model = build(PRESETS["ns-tiny"]).cuda()
    tokens = random_tokens(2, 200, vocab=PRESETS["ns-tiny"].vocab_size).cuda()
    tokens[:, 50] = PRESETS["ns-tiny"].eos_id
    kernel_loss, _ = model(tokens, tokens)
    kernel_loss.mean().backward()
    kernel_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    monkeypatch.setattr(ns_hippocampal, "pool_read", pool_read_explicit)
    loss, carry = model(tokens, tokens)
    loss.mean().backward()
    torch.testing.assert_close(kernel_loss, loss, rtol=1e-4, atol=1e-4)
    for kernel_grad, p in zip(kernel_grads, model.parameters()):
        torch.testing.assert_close(kernel_grad, p.grad, rtol=1e-3, atol=1e-5)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        bf16_loss, bf16_carry = model(tokens, tokens)
    assert torch.isfinite(bf16_loss).all()
    assert all(value.dtype == torch.float32 for value in bf16_carry.values())


@pytest.mark.cuda
@pytest.mark.parametrize("scan", ["compiled", "kernel"])
def test_cuda_compiled_scan_matches_the_eager_one(scan):
    """The dendritic layers' chunked scan through torch.compile, or through the Triton kernels (the
    default on CUDA), gives the eager scan's loss and gradients. (Bitwise repeatability of the
    whole model's gradients is tests/kernels/test_pool_attention.py's.)"""
    tokens = random_tokens(2, 200, vocab=PRESETS["ns-tiny"].vocab_size).cuda()

    def loss_and_grads(compile_scan: bool, scan_kernel: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model = build(PRESETS["ns-tiny"], compile_scan=compile_scan, scan_kernel=scan_kernel).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _ = model(tokens, tokens)
        loss.mean().backward()
        return loss.detach(), [p.grad for p in model.parameters()]

    eager_loss, eager_grads = loss_and_grads(False, False)
    compiled_loss, compiled_grads = loss_and_grads(scan == "compiled", scan == "kernel")
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=2e-2, atol=2e-2)
    for compiled, eager in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(compiled, eager, rtol=5e-2, atol=1e-3)
