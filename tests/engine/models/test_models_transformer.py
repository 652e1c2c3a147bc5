"""Transformer baseline: exact sizes, gradients, causality, windows, groups and FLOPs."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call

from engine.errors import ConfigError
from engine.models.base import IGNORE_INDEX
from engine.models.transformer.config import PRESETS, TransformerConfig
from engine.models.transformer.model import TransformerLM

# The article's peer shape, shrunk: sinusoidal positions, offset norms, two-matrix FFN.
PEER_TINY = TransformerConfig(vocab_size=11, width=8, depth=2, heads=2, ffn_hidden=12, context_len=6)
# The large presets' traits, shrunk: RoPE, SwiGLU, final norm, tied head.
LLAMA_TINY = TransformerConfig(
    vocab_size=11, width=8, depth=2, heads=2, ffn_hidden=12, context_len=6, swiglu=True, rope=True,
    norm_offset=False, final_norm=True, tie_embeddings=True, scale_logits=False,
)  # fmt: skip


def _model(config: TransformerConfig, seed: int = 0) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM(config)


def test_article_peer_has_exactly_1541120_parameters() -> None:
    assert TransformerLM(PRESETS["transformer-1.5m"]).num_parameters() == 1_541_120


def test_large_presets_match_the_ns_presets_within_two_percent() -> None:
    from engine.models.ns.model import NSLM
    from engine.models.ns.presets import PRESETS as NS_PRESETS

    for transformer_name, ns_name in (("transformer-1p3b", "ns-1p3b"), ("transformer-2b", "ns-2b")):
        with torch.device("meta"):  # shapes only: no memory, no initialisation cost
            ours = TransformerLM(PRESETS[transformer_name]).num_parameters()
            theirs = NSLM(NS_PRESETS[ns_name]).num_parameters()
        assert abs(ours - theirs) / theirs < 0.02, (transformer_name, ours, theirs)


@pytest.mark.parametrize("config", [PEER_TINY, LLAMA_TINY], ids=["peer", "llama"])
def test_gradcheck_float64(config: TransformerConfig) -> None:
    model = _model(config).double()
    tokens = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(1))
    names = [name for name, _ in model.named_parameters()]
    params = dict(model.named_parameters())

    class Logits(torch.nn.Module):
        """The loss is float32 by contract: check the float64 logits it is computed from."""

        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.model.logits(tokens)

    wrapper = Logits()

    def of(*values: torch.Tensor) -> torch.Tensor:
        return functional_call(wrapper, {f"model.{n}": v for n, v in zip(names, values)}, (tokens,))

    inputs = tuple(params[name].detach().clone().requires_grad_(True) for name in names)
    assert torch.autograd.gradcheck(of, inputs, eps=1e-6, atol=1e-6, fast_mode=True)


@pytest.mark.parametrize("config", [PEER_TINY, LLAMA_TINY], ids=["peer", "llama"])
def test_loss_at_t_ignores_later_tokens(config: TransformerConfig) -> None:
    model = _model(config)
    generator = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 11, (3, 6), generator=generator)
    targets = torch.randint(0, 11, (3, 6), generator=generator)
    loss, carry = model(tokens, targets)
    assert carry is None and loss.dtype == torch.float32
    for t in range(5):
        changed_tokens, changed_targets = tokens.clone(), targets.clone()
        changed_tokens[:, t + 1 :] = (changed_tokens[:, t + 1 :] + 5) % 11
        changed_targets[:, t + 1 :] = (changed_targets[:, t + 1 :] + 2) % 11
        changed, _ = model(changed_tokens, changed_targets)
        assert torch.allclose(changed[:, : t + 1], loss[:, : t + 1], rtol=0, atol=1e-6)
        assert not torch.allclose(changed[:, t + 1 :], loss[:, t + 1 :])


def test_long_rows_are_independent_windows_and_ignored_targets_cost_nothing() -> None:
    model = _model(PEER_TINY)
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 11, (2, 15), generator=generator)
    targets = torch.randint(0, 11, (2, 15), generator=generator)
    targets[0, 3] = IGNORE_INDEX
    loss, _ = model(tokens, targets)
    assert loss.shape == (2, 15) and loss[0, 3] == 0
    for start in (0, 6, 12):
        window, _ = model(tokens[:, start : start + 6], targets[:, start : start + 6])
        assert torch.allclose(loss[:, start : start + 6], window, rtol=0, atol=1e-6)


def test_sinusoidal_positions_are_added_and_rope_rotates() -> None:
    peer = _model(PEER_TINY)
    assert torch.allclose(peer.positions[1, :2], torch.tensor([0.8414710, 0.5403023]))
    assert torch.allclose(peer.positions[:, 1::2][0], torch.ones(4))
    # Same token at every position: only the positions tell the rows apart.
    same = torch.full((1, 6), 3)
    logits = peer.logits(same)
    assert not torch.allclose(logits[0, 1], logits[0, 2])
    llama = _model(LLAMA_TINY)
    assert llama.head is None and not hasattr(llama, "positions")


def test_every_parameter_in_one_group_and_a_layer() -> None:
    for config, parts in ((PEER_TINY, {"embed", "head"}), (LLAMA_TINY, {"embed", "final_norm"})):
        model = _model(config)
        grouped = [name for group in model.param_groups() for name, _ in group.params]
        assert sorted(grouped) == sorted(name for name, _ in model.named_parameters())
        assert {model.layer_of(name) for name in grouped} == parts | {"layer00", "layer01"}


def test_flops_per_token_counts_matrices_and_causal_attention() -> None:
    model = TransformerLM(PRESETS["transformer-1.5m"])
    matrices = 4 * 256 * 256 + 2 * 256 * 448 + 256 * 2048
    assert model.flops_per_token(64) == 6 * matrices + 12 * 256 * 32.5
    assert model.flops_per_token(1000) == model.flops_per_token(64)  # windows of 64


def test_cpu_forward_is_bitwise_deterministic() -> None:
    tokens = torch.randint(0, 11, (2, 13), generator=torch.Generator().manual_seed(4))
    assert torch.equal(_model(LLAMA_TINY)(tokens, tokens)[0], _model(LLAMA_TINY)(tokens, tokens)[0])


def test_bad_shapes_are_refused_with_the_field() -> None:
    with pytest.raises(ConfigError, match="width 10 is not a multiple of heads 4"):
        TransformerLM(TransformerConfig(width=10, heads=4))
    with pytest.raises(ConfigError, match="depth must be positive"):
        TransformerLM(TransformerConfig(depth=0))
    with pytest.raises(ConfigError, match="compile_layers must be true or false, got 'yes'"):
        TransformerLM(TransformerConfig(compile_layers="yes"))  # type: ignore[arg-type]


@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("base", [0.0, -1.0])
def test_a_base_at_or_below_zero_is_refused_not_trained_as_nan(rope: bool, base: float) -> None:
    # base ** (-2i/d) is infinite or NaN there: every position, hence every loss, would be NaN.
    with pytest.raises(ConfigError, match=f"rope_base must be positive, got {base}"):
        TransformerConfig(rope=rope, rope_base=base).validate()


@pytest.mark.parametrize("std", [0.0, -0.02])
def test_an_init_std_at_or_below_zero_is_refused_before_torch_sees_it(std: float) -> None:
    # A negative std was torch's RuntimeError traceback out of `nsconsole check`, `new` and `run`.
    with pytest.raises(ConfigError, match=f"init_std must be positive, got {std}"):
        TransformerConfig(init_std=std).validate()


@pytest.mark.cuda
def test_cuda_matches_cpu_and_trains_under_bf16_autocast() -> None:
    for name in ("transformer-tiny", "transformer-1.5m"):
        cpu = _model(PRESETS[name])
        gpu = _model(PRESETS[name]).cuda()
        tokens = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(5))
        loss_cpu, _ = cpu(tokens[:, :-1], tokens[:, 1:])
        loss_gpu, _ = gpu(tokens[:, :-1].cuda(), tokens[:, 1:].cuda())
        assert torch.allclose(loss_gpu.cpu(), loss_cpu, rtol=0, atol=1e-3)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _ = gpu(tokens[:, :-1].cuda(), tokens[:, 1:].cuda())
        loss.mean().backward()
        assert all(torch.isfinite(p.grad).all() for p in gpu.parameters())


def test_rope_tables_are_kept_per_length_until_the_caches_are_released() -> None:
    # A captured graph reads the tables it was captured with: another length may not replace them.
    from engine.models.common import RotaryEmbedding

    rope = RotaryEmbedding(8)
    first = rope.tables(16, 0, torch.device("cpu"), torch.float32)[0]
    rope.tables(32, 0, torch.device("cpu"), torch.float32)
    assert rope.tables(16, 0, torch.device("cpu"), torch.float32)[0].data_ptr() == first.data_ptr()
    config = TransformerConfig(vocab_size=64, width=16, depth=1, heads=2, ffn_hidden=32, context_len=32, rope=True)
    model = TransformerLM(config)
    model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))
    caches = [m._cache for m in model.modules() if isinstance(m, RotaryEmbedding)]
    assert caches and all(caches)
    model.release_device_caches()
    assert not any(m._cache for m in model.modules() if isinstance(m, RotaryEmbedding))
