"""Stepwise decoding equals the full forward (the decoding contract in engine/models/base.py).

For every family with a decoder: the logits of a prompt's prefill followed by one token at a time
(and of pieces of several tokens) equal those of one decode of the whole sequence and those of
`logits()`, the path the training loss is computed from, in float64 on the CPU to 1e-9 (measured:
at most about 1e-13; not bitwise, since a matrix product over T rows and over one row may add in
another order), over sequences that cross the transformer's windows, PSSA's chunks and NS's scan
chunks (NS: prefill by the chunked scan, one token by the recurrence, the pool read over a cache).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.models.base import LanguageModel, token_losses
from engine.models.build import build_model
from engine.models.ns.hippocampal import HippocampalLayer
from engine.models.ns.model import NSLM
from engine.models.ns.scan import chunked_scan, recurrent_step
from engine.models.pssa.memory import to_poincare_ball
from engine.models.pssa.model import PSSALM
from engine.models.transformer.config import PRESETS as TRANSFORMER_PRESETS
from engine.models.transformer.model import TransformerLM

pytestmark = pytest.mark.usefixtures("one_thread")

LLAMA_STYLE_TINY = {
    name: getattr(TRANSFORMER_PRESETS["transformer-1p3b"], name)
    for name in ("swiglu", "rope", "rope_base", "norm_offset", "final_norm", "tie_embeddings", "scale_logits")
}
"""transformer-tiny with the large presets' traits (RoPE at the cached offset, SwiGLU, tied head)."""

CASES: dict[str, tuple[str, dict[str, Any], int]] = {
    # (preset, overrides, sequence length): each longer than a window / chunk.
    "transformer-tiny": ("transformer-tiny", {}, 80),
    "transformer-tiny-rope": ("transformer-tiny", LLAMA_STYLE_TINY, 80),
    "transformer-1.5m": ("transformer-1.5m", {}, 140),
    "pssa-tiny": ("pssa-tiny", {}, 40),
    "pssa-tiny-loops": ("pssa-tiny", {"loops": 2}, 40),
    "pssa-1.5m": ("pssa-1.5m", {}, 140),
    "ns-tiny": ("ns-tiny", {}, 80),
    # Short chunks (a prefill crosses several), two groups of B and C, two hippocampal layers.
    "ns-tiny-grouped": ("ns-tiny", {"chunk_len": 16, "dendritic_groups": 2, "hippocampal_every": 2}, 40),
}

TOLERANCE = 1e-9


def _model(preset: str, overrides: dict[str, Any]) -> LanguageModel:
    """A float64 model in eval mode; PSSA with full banks and non-zero adapters and MLPs, NS with
    clock and write maps that vary per token (they start at zero: every tag equal, every clock
    step 1), so the memory read, the pool's per-key bias and every branch carry signal."""
    torch.manual_seed(0)
    model = build_model(preset, overrides).double().eval()
    if isinstance(model, PSSALM):
        generator = torch.Generator().manual_seed(1)
        config = model.config
        with torch.no_grad():
            for block in model.blocks:
                block.adapter_up.weight.normal_(0, 0.3, generator=generator)
                block.mlp_down.weight.normal_(0, 0.3, generator=generator)
                keys = to_poincare_ball(torch.randn(config.mem_capacity, config.d_mem_key, generator=generator))
                values = torch.randn(config.mem_capacity, config.d_latent, generator=generator)
                block.bank.write(keys.double(), values.double(), [9.0] * config.mem_capacity, update=0)
    if isinstance(model, NSLM):
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for layer in model.layers:
                if isinstance(layer, HippocampalLayer):
                    for linear in (layer.clock_proj, layer.write_proj):
                        linear.weight.normal_(0, 0.3, generator=generator)
                        linear.bias.normal_(0, 0.3, generator=generator)
    return model


def _tokens(model: LanguageModel, length: int, rows: int = 2) -> torch.Tensor:
    vocab = model.embed.weight.shape[0]
    tokens = torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(2))
    if isinstance(model, NSLM):
        tokens[:, 5::9] = model.config.eos_id  # document ends: the pool clocks jump there
    return tokens


def _decode_in_pieces(model: LanguageModel, tokens: torch.Tensor, cuts: list[int]) -> torch.Tensor:
    state = model.decode_state(tokens.shape[0], tokens.device)
    pieces = []
    for start, end in zip([0, *cuts], [*cuts, tokens.shape[1]]):
        logits, state = model.decode(tokens[:, start:end], state)
        assert logits.shape == (tokens.shape[0], end - start, model.embed.weight.shape[0])
        pieces.append(logits)
    return torch.cat(pieces, dim=1)


@pytest.mark.parametrize("case", list(CASES))
@torch.no_grad()
def test_stepwise_decoding_equals_one_decode_and_the_full_forward(case: str) -> None:
    preset, overrides, length = CASES[case]
    model = _model(preset, overrides)
    tokens = _tokens(model, length)
    full = model.logits(tokens)
    assert full.dtype == torch.float64 and full.shape == (2, length, model.embed.weight.shape[0])
    # logits() is what the training loss is computed from.
    assert torch.equal(token_losses(full, tokens), model(tokens, tokens)[0])
    one_decode = _decode_in_pieces(model, tokens, [])
    # A 7-token prompt, then one token at a time.
    stepwise = _decode_in_pieces(model, tokens, list(range(7, length)))
    # Uneven pieces, some of them across a window or chunk edge.
    uneven = _decode_in_pieces(model, tokens, [cut for cut in (3, 4, 29, 30, 45, 61, 62, 100) if cut < length])
    for decoded in (one_decode, stepwise, uneven):
        assert (decoded - full).abs().max().item() <= TOLERANCE


@torch.no_grad()
def test_decoding_reads_the_pssa_banks_and_changes_nothing_in_the_model() -> None:
    model = _model("pssa-tiny", {})
    tokens = _tokens(model, 20)
    before = {name: tensor.clone() for name, tensor in model.extra_state_dict().items()}
    with_banks = _decode_in_pieces(model, tokens, list(range(1, 20)))
    after = model.extra_state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    # The banks are read: empty banks give other logits.
    empty = _model("pssa-tiny", {})
    for block in empty.blocks:
        block.bank.slot_count.zero_()
    assert not torch.allclose(_decode_in_pieces(empty, tokens, list(range(1, 20))), with_banks)


@torch.no_grad()
def test_the_transformer_opens_a_new_window_where_training_did() -> None:
    model = _model("transformer-tiny", {})
    window = model.config.context_len
    tokens = _tokens(model, 2 * window + 5, rows=1)
    state = model.decode_state(1, tokens.device)
    _, state = model.decode(tokens[:, : window + 3], state)
    assert state.window_tokens == 3  # the second window holds its own three tokens only
    # The second window's logits are those of its tokens alone: nothing crosses the edge.
    second, _ = model.decode(tokens[:, window + 3 : 2 * window], state)
    alone = model.logits(tokens[:, window : 2 * window])
    assert (second - alone[:, 3:]).abs().max().item() <= TOLERANCE


@torch.no_grad()
def test_rope_decoding_keeps_a_few_tables_not_one_per_token() -> None:
    model = _model("transformer-tiny", LLAMA_STYLE_TINY)
    state = model.decode_state(1, torch.device("cpu"))
    for token in range(model.config.context_len):
        _, state = model.decode(torch.tensor([[token]]), state)
    rotary = model.rotary
    assert rotary is not None and len(rotary._cache) <= 6  # lengths 1, 2, 4, 8, 16, 32


@torch.no_grad()
def test_ns_decoding_grows_only_the_pools_and_runs_past_the_longest_context() -> None:
    # The forward reads a long row whole, so the decoder never resets: past longest_context the
    # logits still equal the full forward's, the recurrent state keeps its size, and each
    # hippocampal layer's pool holds every token seen.
    model = _model("ns-tiny", {"rope_max_seq_len": 24})
    tokens = _tokens(model, 40)
    state = model.decode_state(2, tokens.device)
    pieces, carry_shapes = [], []
    for start in range(tokens.shape[1]):
        logits, state = model.decode(tokens[:, start : start + 1], state)
        pieces.append(logits)
        assert state.carry is not None
        carry_shapes.append({name: tensor.shape for name, tensor in state.carry.items()})
        assert [pool.length for pool in state.pools.values()] == [start + 1]
    assert tokens.shape[1] > model.longest_context
    assert all(shapes == carry_shapes[0] for shapes in carry_shapes)
    assert carry_shapes[0]["layer00.compartments"] == (2, 4, 16, 16)  # (B, H, N, P)
    assert (torch.cat(pieces, dim=1) - model.logits(tokens)).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("groups", [1, 2])
def test_one_token_steps_the_recurrence_as_the_chunked_scan_does(groups: int) -> None:
    generator = torch.Generator().manual_seed(3)
    batch, heads, head_dim, state_size = 2, 4, 3, 5

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    u, dt, A = rand(batch, 1, heads, head_dim), rand(batch, 1, heads).exp(), -rand(heads).exp()
    B, C = rand(batch, 1, groups, state_size), rand(batch, 1, groups, state_size)
    state0 = rand(batch, heads, state_size, head_dim)
    stepped = recurrent_step(u, dt, A, B, C, 8, state0)
    scanned = chunked_scan(u, dt, A, B, C, 8, state0)
    for ours, theirs in zip(stepped, scanned):
        assert ours.dtype == torch.float64 and (ours - theirs).abs().max().item() <= TOLERANCE


def test_decoders_are_found_by_class_not_by_name() -> None:
    assert TransformerLM.decodes() and PSSALM.decodes() and NSLM.decodes()

    class WithoutDecoder(PSSALM):
        decode = LanguageModel.decode

    assert not WithoutDecoder.decodes()


@pytest.mark.cuda
@pytest.mark.parametrize(
    "case", ["transformer-1.5m", "pssa-1.5m", "pssa-tiny-loops", "ns-tiny", "ns-tiny-grouped"]
)
@torch.no_grad()
def test_stepwise_decoding_on_cuda_equals_the_full_forward_to_bf16_rounding(case: str) -> None:
    preset, overrides, length = CASES[case]
    model = _model(preset, overrides).float().cuda()
    tokens = _tokens(model, length).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        full = model.logits(tokens)
        stepwise = _decode_in_pieces(model, tokens, list(range(7, length)))
    assert full.dtype == torch.float32 and stepwise.dtype == torch.float32
    # bf16 keeps 8 bits of mantissa: differences of a few units of its rounding of the logits' scale.
    scale = full.abs().max().item()
    assert (stepwise - full).abs().max().item() <= 2 ** -6 * scale

