"""PSSA dreaming: the fresh-task guard, bit-exact restoration, the cache and its checkpoint state."""

from __future__ import annotations

import pytest
import torch

from engine.models.base import IGNORE_INDEX
from engine.models.pssa.config import PSSAConfig
from engine.models.pssa.dream import LOSS_TOLERANCE, DreamSources, _dream_from, _memory_seeds, dream
from engine.models.pssa.memory import to_poincare_ball
from engine.models.pssa.model import PSSALM

# Threshold 0: every chunk is written and cached (a random model's loss, ~ln 24, is below 3.5).
CONFIG = PSSAConfig(
    vocab_size=24, d_latent=8, d_state=4, d_mem_key=4, mem_capacity=6, chunk_len=8, adapter_rank=2,
    write_loss_threshold=0.0,
)  # fmt: skip


def _dreaming_model() -> PSSALM:
    """A model whose dreaming cache holds three chunks."""
    torch.manual_seed(0)
    model = PSSALM(CONFIG).train()
    tokens = torch.randint(0, 24, (3, 9), generator=torch.Generator().manual_seed(1))
    model(tokens[:, :-1], tokens[:, 1:])
    assert len(model.dream_cache) == 3
    return model


def _fresh() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 24, (2, 7), generator=torch.Generator().manual_seed(2))
    return tokens, torch.roll(tokens, -1, dims=1)


def test_kept_steps_never_raise_the_fresh_loss_beyond_the_tolerance() -> None:
    model = _dreaming_model()
    fresh_tokens, fresh_targets = _fresh()
    report = model.dream(fresh_tokens, fresh_targets, lr=0.5, steps=3)
    assert report.steps_tried == 9
    assert report.steps_kept > 0
    assert report.fresh_loss_after <= report.fresh_loss_before + LOSS_TOLERANCE


def test_a_step_that_would_raise_the_fresh_loss_is_rejected_bit_for_bit() -> None:
    model = _dreaming_model()
    fresh_tokens, fresh_targets = _fresh()
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    # A step so large that even after ten halvings it overshoots: every attempt must fail.
    report = model.dream(fresh_tokens, fresh_targets, lr=1e9, steps=1)
    assert report.steps_tried == 3 and report.steps_kept == 0
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name
    assert report.fresh_loss_after == report.fresh_loss_before


def test_only_head_rows_of_rehearsed_targets_change() -> None:
    model = _dreaming_model()
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    rehearsed = set()
    for _, targets in model.dream_cache.sequences:
        rehearsed |= {int(t) for t in targets if t != IGNORE_INDEX}
    model.dream(*_fresh(), lr=0.5, steps=1)
    for name, param in model.named_parameters():
        if name != "head.weight":
            assert torch.equal(param, before[name]), name
    changed = (model.head.weight != before["head.weight"]).any(dim=1).nonzero().flatten().tolist()
    assert changed and set(changed) <= rehearsed


def test_fresh_task_is_validated() -> None:
    model = _dreaming_model()
    tokens, targets = _fresh()
    with pytest.raises(ValueError, match="equal shapes"):
        model.dream(tokens, targets[:, :3])
    with pytest.raises(ValueError, match="over chunk_len"):
        model.dream(torch.zeros(1, 9, dtype=torch.long), torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.dream(tokens, targets + 24)
    with pytest.raises(ValueError, match="no scored target"):
        model.dream(tokens, torch.full_like(targets, IGNORE_INDEX))


def test_cache_keeps_the_newest_and_round_trips() -> None:
    model = _dreaming_model()
    tokens = torch.randint(0, 24, (5, 5), generator=torch.Generator().manual_seed(3))
    model(tokens[:, :-1], tokens[:, 1:])  # five more 4-token chunks: capacity 6 keeps the last 6
    cache = model.dream_cache.sequences
    assert len(cache) == 6
    assert torch.equal(cache[-1][0][:4], tokens[4, :-1])
    assert torch.equal(cache[-1][1][4:], torch.full((4,), IGNORE_INDEX))  # padded to chunk_len
    state = model.extra_state_dict()
    other = PSSALM(CONFIG)
    other.load_extra_state_dict(state)
    for (a_tokens, a_targets), (b_tokens, b_targets) in zip(cache, other.dream_cache.sequences):
        assert torch.equal(a_tokens, b_tokens) and torch.equal(a_targets, b_targets)


def test_recorded_chunks_reach_the_cache_in_order_within_its_capacity() -> None:
    """Training records gated chunks on the device; the cache gets them, oldest first, when read:
    rows without a target are skipped, a piece of more gated rows than the capacity keeps its
    last ones, a later forward's chunks follow, and a checkpoint load replaces what is pending."""
    config = PSSAConfig(
        vocab_size=24, d_latent=8, d_state=4, d_mem_key=4, mem_capacity=3, chunk_len=4, adapter_rank=2,
        write_loss_threshold=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = PSSALM(config).train()
    saved = model.extra_state_dict()
    generator = torch.Generator().manual_seed(4)
    first = torch.randint(0, 24, (5, 8), generator=generator)
    first_targets = torch.roll(first, -1, dims=1)
    first_targets[1, :4] = IGNORE_INDEX  # piece 0 of row 1: no target, nan loss
    first_targets[3, 4:] = IGNORE_INDEX  # piece 1 of row 3
    model(first, first_targets)
    second = torch.randint(0, 24, (2, 3), generator=generator)
    model(second, second)
    pad = torch.full((1,), IGNORE_INDEX)
    expected = [(first[4, 4:], first_targets[4, 4:])]  # the last of piece 1's four recorded rows
    expected += [(torch.cat([second[row], torch.zeros(1, dtype=torch.long)]), torch.cat([second[row], pad]))
                 for row in range(2)]  # fmt: skip
    cache = model.dream_cache.sequences
    assert len(cache) == 3
    for (tokens, targets), (want_tokens, want_targets) in zip(cache, expected):
        assert torch.equal(tokens, want_tokens) and torch.equal(targets, want_targets)
    model(first, first_targets)
    model.load_extra_state_dict(saved)
    assert len(model.dream_cache) == 0


def test_a_dream_from_a_memory_value_runs_the_model_s_own_stack_from_the_live_carry() -> None:
    """A memory value stands in for the first token's embedding: a value equal to token 5's
    embedding dreams the hidden states a plain read of 5 and the dreamt tokens gives, from the
    same (non-zero) live carry; the dreamt tokens are the targets, and a seed redraws them."""
    model = _dreaming_model()
    live = 0.1 * torch.randn(model.initial_carry(1).shape, generator=torch.Generator().manual_seed(5))
    seed = model.embed.weight[5].detach().clone()
    sources = DreamSources(length=5)
    hidden, dreamt = _dream_from(model, seed, live, sources, torch.Generator().manual_seed(6))
    assert hidden.shape == (1, 5, CONFIG.d_latent) and dreamt.shape == (1, 5)
    assert int(dreamt.min()) >= 0 and int(dreamt.max()) < CONFIG.vocab_size
    with torch.no_grad():
        expected, _, _ = model.hidden(torch.cat([torch.tensor([[5]]), dreamt[:, :-1]], dim=1), live)
    torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-6)
    again = _dream_from(model, seed, live, sources, torch.Generator().manual_seed(6))[1]
    assert torch.equal(again, dreamt)


def test_generate_mode_dreams_from_each_newest_memory_value_every_round() -> None:
    model = _dreaming_model()
    assert model.blocks[0].bank.count == 3
    sources = DreamSources(sequences=2, cached=False, generated=True, repeats=3, length=4)
    report = dream(model, *_fresh(), lr=0.5, steps=2, sources=sources, generator=torch.Generator().manual_seed(7))
    assert report.sequences == 2 * 3 and report.generated_tokens == 2 * 3 * 4 and report.steps_tried == 12
    assert report.fresh_loss_after <= report.fresh_loss_before + LOSS_TOLERANCE


def test_generate_mode_without_memory_values_changes_nothing() -> None:
    torch.manual_seed(0)
    model = PSSALM(CONFIG)
    before = model.head.weight.detach().clone()
    report = dream(model, *_fresh(), lr=0.5, steps=1, sources=DreamSources(cached=False, generated=True))
    assert (report.sequences, report.generated_tokens, report.steps_tried) == (0, 0, 0)
    assert torch.equal(model.head.weight, before)


def test_sequences_rehearses_only_the_newest_cached_chunks() -> None:
    model = _dreaming_model()
    _, newest_targets = model.dream_cache.sequences[-1]
    before = model.head.weight.detach().clone()
    report = dream(model, *_fresh(), lr=0.5, steps=1, sources=DreamSources(sequences=1))
    assert report.sequences == 1 and report.steps_kept == 1
    changed = (model.head.weight != before).any(dim=1).nonzero().flatten().tolist()
    assert changed and set(changed) <= {int(t) for t in newest_targets if t != IGNORE_INDEX}


def test_memory_seeds_are_the_newest_written_values_across_the_ring_s_wrap() -> None:
    """Six slots take eight writes: the last two overwrite slots 0 and 1 (a loss far past any
    confidence), so the newest values are rows 7, 6, 5, ... in that order."""
    torch.manual_seed(0)
    model = PSSALM(CONFIG)
    bank = model.blocks[0].bank
    generator = torch.Generator().manual_seed(8)
    keys = to_poincare_ball(torch.randn(8, CONFIG.d_mem_key, generator=generator))
    values = torch.randn(8, CONFIG.d_latent, generator=generator)
    bank.write(keys, values, [1e6] * 8, 1000)
    assert (bank.count, bank.head) == (6, 2)
    seeds = _memory_seeds(model, 4)
    for seed, row in zip(seeds, (7, 6, 5, 4), strict=True):
        assert torch.equal(seed, values[row])
    assert len(_memory_seeds(model, None)) == 6
