"""Flat-buffer AdamW: views, in-place accumulation, the update, norms, skips, state round trip."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from engine.models.base import LanguageModel, token_losses
from engine.training.optim import AdamWSettings, FlatAdamW, ParameterAverage
from engine.training.step import EagerEngine


class TwoLayerLM(LanguageModel):
    """A small real model of the interface: embedding, two residual MLP layers, a norm, an untied head."""

    longest_context = 16

    def __init__(self, vocab: int = 11, width: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens, targets, carry=None):
        hidden = self.embed(tokens)  # (B, T, C)
        for layer in self.layers:
            hidden = hidden + torch.tanh(layer(hidden))
        return token_losses(self.head(self.norm(hidden)), targets), None

    def flops_per_token(self, seq_len: int) -> float:
        return 6.0 * self.num_parameters()

    def layer_of(self, param_name: str) -> str:
        if param_name.startswith("layers."):
            return f"layer{int(param_name.split('.')[1]):02d}"
        return param_name.split(".")[0]


SETTINGS = AdamWSettings(beta1=0.9, beta2=0.95, eps=1e-8, clip=1.0)


def build(seed: int = 0) -> tuple[TwoLayerLM, FlatAdamW]:
    torch.manual_seed(seed)
    model = TwoLayerLM()
    return model, FlatAdamW(model, SETTINGS, torch.device("cpu"))


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    window = torch.randint(0, 11, (3, 7), generator=torch.Generator().manual_seed(seed))
    return window[:, :-1], window[:, 1:]


def backward(model: TwoLayerLM, seed: int, scale: float = 1.0) -> None:
    tokens, targets = batch(seed)
    loss, _ = model(tokens, targets)
    (loss.sum() * scale).backward()


def test_parameters_are_views_and_backward_accumulates_in_place() -> None:
    model, optimizer = build()
    start, end = optimizer.params.data_ptr(), optimizer.params.data_ptr() + optimizer.numel * 4
    for parameter in model.parameters():
        assert start <= parameter.data_ptr() < end
    grad_start = optimizer.grads.data_ptr()
    backward(model, 1)
    first = optimizer.grads.clone()
    assert first.abs().sum() > 0
    backward(model, 2)
    for parameter in model.parameters():
        assert grad_start <= parameter.grad.data_ptr() < grad_start + optimizer.numel * 4
    model_b, optimizer_b = build()
    backward(model_b, 2)
    torch.testing.assert_close(optimizer.grads, first + optimizer_b.grads)
    assert [g.name for g in optimizer.groups] == ["decay", "no_decay"]


def test_update_matches_torch_adamw_with_clipping() -> None:
    model, optimizer = build()
    reference = TwoLayerLM()
    reference.load_state_dict(model.state_dict())
    decay = [p for n, p in reference.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in reference.named_parameters() if p.dim() < 2]
    torch_adamw = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=3e-3, betas=(0.9, 0.95), eps=1e-8,
    )
    for update in range(4):
        optimizer.zero_grad()
        backward(model, update, scale=5.0)  # large enough that clipping at 1.0 bites
        optimizer.set_hyperparameters(lr=3e-3, weight_decay=0.1)
        optimizer.compute_norms()
        optimizer.apply_update()
        stats = optimizer.read_stats()

        torch_adamw.zero_grad()
        backward(reference, update, scale=5.0)
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        assert stats.grad_norm == pytest.approx(norm.item(), rel=1e-5)
        assert stats.grad_norm > 1.0
        torch_adamw.step()
    for (name, mine), theirs in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6, msg=name)
    assert optimizer.step.item() == 4


def test_norms_per_layer_and_group() -> None:
    model, optimizer = build()
    backward(model, 3)
    optimizer.compute_norms()
    stats = optimizer.read_stats()
    grads = dict(model.named_parameters())

    def norm(names: list[str]) -> float:
        return math.sqrt(sum(grads[n].grad.double().square().sum().item() for n in names))

    assert stats.layer_norms["layer01"] == pytest.approx(norm(["layers.1.weight", "layers.1.bias"]), rel=1e-5)
    assert stats.layer_norms["embed"] == pytest.approx(norm(["embed.weight"]), rel=1e-5)
    assert set(stats.layer_norms) == {"embed", "layer00", "layer01", "norm", "head"}
    no_decay = [n for n, p in model.named_parameters() if p.dim() < 2]
    assert stats.group_norms["no_decay"] == pytest.approx(norm(no_decay), rel=1e-5)
    assert stats.grad_norm == pytest.approx(norm(list(grads)), rel=1e-5)


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_nonfinite_update_is_skipped_bit_identically(poison: float) -> None:
    model, optimizer = build()
    for update in range(2):  # some real state first
        optimizer.zero_grad()
        backward(model, update)
        optimizer.set_hyperparameters(lr=1e-2, weight_decay=0.1)
        optimizer.compute_norms()
        optimizer.apply_update()
        optimizer.read_stats()
    before = [t.clone() for t in (optimizer.params, optimizer.exp_avg, optimizer.exp_avg_sq, optimizer.step)]
    for skip in range(1, 3):
        optimizer.zero_grad()
        backward(model, 9)
        model.layers[0].weight.grad[0, 0] = poison  # a NaN gradient lands in the flat buffer
        optimizer.set_hyperparameters(lr=1e-2, weight_decay=0.1)
        optimizer.compute_norms()
        optimizer.apply_update()
        stats = optimizer.read_stats()
        assert not stats.finite
        assert optimizer.nonfinite_in_a_row == skip
        after = (optimizer.params, optimizer.exp_avg, optimizer.exp_avg_sq, optimizer.step)
        for old, new in zip(before, after):
            assert torch.equal(old, new)
    optimizer.zero_grad()
    backward(model, 10)
    optimizer.compute_norms()
    optimizer.apply_update()
    assert optimizer.read_stats().finite and optimizer.nonfinite_in_a_row == 0
    assert optimizer.step.item() == 3


def test_weight_decay_only_on_the_decay_group() -> None:
    model, optimizer = build()
    before = optimizer.params.clone()
    optimizer.zero_grad()  # a zero gradient: the update is weight decay alone
    optimizer.set_hyperparameters(lr=0.5, weight_decay=0.2)
    optimizer.compute_norms()
    optimizer.apply_update()
    decay, no_decay = optimizer.groups
    torch.testing.assert_close(optimizer.params[: decay.end], before[: decay.end] * 0.9)
    assert torch.equal(optimizer.params[no_decay.start :], before[no_decay.start :])


def test_state_round_trip_and_layout_checks() -> None:
    model, optimizer = build()
    backward(model, 1)
    optimizer.compute_norms()
    optimizer.set_hyperparameters(lr=1e-2, weight_decay=0.0)
    optimizer.apply_update()
    weights = {k: v.clone() for k, v in optimizer.weights_by_name(optimizer.params.cpu()).items()}
    state = optimizer.state_tensors()
    _, fresh = build(seed=5)
    fresh.load(weights, state)
    for buffer in ("params", "exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(getattr(fresh, buffer), getattr(optimizer, buffer))
    weights["head.weight"] = weights["head.weight"][:, :3]
    with pytest.raises(ValueError, match="head.weight: shape"):
        fresh.load(weights, state)
    assert optimizer.layout()[0] == ["embed.weight", 0, [11, 8]]


def test_parameter_average_starts_then_follows() -> None:
    model, optimizer = build()
    average = ParameterAverage(optimizer, horizon_tokens=400, from_tokens=200)
    average.after_update(tokens_trained=100, update_tokens=100, finite=True)
    assert not average.started
    average.after_update(tokens_trained=200, update_tokens=100, finite=True)
    assert torch.equal(average.average, optimizer.params)
    start = optimizer.params.clone()
    with torch.no_grad():
        optimizer.params.add_(1.0)
    average.after_update(tokens_trained=300, update_tokens=100, finite=False)
    assert torch.equal(average.average, start)
    average.after_update(tokens_trained=300, update_tokens=100, finite=True)
    torch.testing.assert_close(average.average, start + 0.25)


def test_huge_finite_gradient_clips_through_the_engine_and_counts_no_skip() -> None:
    """A 1e21 gradient: its fp32 squares overflow, the float64 norm does not, so the update clips
    (a bounded step) instead of being skipped as non-finite."""
    model, optimizer = build()
    model.layers[0].weight.register_hook(lambda grad: grad * 1e21)
    engine = EagerEngine(model, optimizer, micro_batch_rows=2)
    before = optimizer.params.clone()
    lr, weight_decay = 1e-2, 0.1
    windows = torch.randint(0, 11, (3, 8), generator=torch.Generator().manual_seed(4))
    result = engine.run_update(windows, lr=lr, weight_decay=weight_decay)
    assert result.stats.finite and result.stats.grad_norm > 1e20
    assert optimizer.nonfinite_in_a_row == 0 and optimizer.step.item() == 1
    moved = (optimizer.params - before).abs()
    assert moved.max() > 0
    # Adam's first step is at most lr per element (m_hat / sqrt(v_hat) = sign), plus the decay.
    assert torch.all(moved <= lr * (1 + 1e-4) + lr * weight_decay * before.abs())
    assert torch.isfinite(optimizer.exp_avg).all() and torch.isfinite(optimizer.exp_avg_sq).all()


def test_step_counter_advances_past_2_pow_24() -> None:
    """An fp32 counter stops at 2^24 (2^24 + 1 rounds back to 2^24); the int64 one does not."""
    model, optimizer = build()
    optimizer.step.fill_(2**24)
    for update in range(2):
        optimizer.zero_grad()
        backward(model, update)
        optimizer.set_hyperparameters(lr=1e-3, weight_decay=0.0)
        optimizer.compute_norms()
        optimizer.apply_update()
    assert optimizer.step.item() == 2**24 + 2


def test_checkpoint_with_an_fp32_step_still_loads(tmp_path: Path) -> None:
    """Checkpoints written before the int64 counter hold the step as fp32 in optimizer.safetensors."""
    model, optimizer = build()
    weights = {k: v.clone() for k, v in optimizer.weights_by_name(optimizer.params.cpu()).items()}
    state = optimizer.state_tensors()
    state["step"] = torch.tensor(12345.0, dtype=torch.float32)
    save_file(state, tmp_path / "optimizer.safetensors")
    fresh_model, fresh = build(seed=5)
    fresh.load(weights, load_file(tmp_path / "optimizer.safetensors"))
    assert fresh.step.dtype == torch.int64 and fresh.step.item() == 12345
    backward(fresh_model, 1)
    fresh.set_hyperparameters(lr=1e-3, weight_decay=0.0)
    fresh.compute_norms()
    fresh.apply_update()
    assert fresh.step.item() == 12346
