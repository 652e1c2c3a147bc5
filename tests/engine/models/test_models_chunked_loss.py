"""The chunked cross-entropy every family's loss goes through on CUDA (`chunked_token_losses`):
equal to the whole-logits loss in value and gradients, and it never holds the whole logits."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from engine.models.base import IGNORE_INDEX, chunked_token_losses, recompute_off_cuda, token_losses
from engine.models.transformer.config import TransformerConfig
from engine.models.transformer.model import TransformerLM

VOCAB, WIDTH = 300, 16


def _inputs(dtype: torch.dtype, device: str = "cpu", tokens: int = 37) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, tokens, WIDTH, generator=generator, dtype=torch.float64)
    weight = torch.randn(VOCAB, WIDTH, generator=generator, dtype=torch.float64) / WIDTH**0.5
    targets = torch.randint(0, VOCAB, (3, tokens), generator=generator)
    targets[0, 3] = targets[2, 5] = IGNORE_INDEX
    upstream = torch.rand(3, tokens, generator=generator, dtype=torch.float64)  # not one value per token
    return (hidden.to(device, dtype).requires_grad_(), weight.to(device, dtype).requires_grad_(), targets.to(device),
            upstream.to(device, dtype))  # fmt: skip


def _whole_of_logits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """F.cross_entropy over the whole (B, T, V) logits, in float64."""
    flat = F.cross_entropy(logits.double().flatten(0, 1), targets.flatten(), reduction="none")
    return flat.view(targets.shape)


def _whole(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, scale: float) -> torch.Tensor:
    return _whole_of_logits((hidden @ weight.T) * scale, targets)


@pytest.mark.parametrize("scale", [None, 0.25], ids=["unscaled", "scaled"])
def test_float64_chunked_equals_the_whole_loss_and_its_gradients(scale: float | None) -> None:
    hidden, weight, targets, upstream = _inputs(torch.float64)
    whole = _whole(hidden, weight, targets, 1.0 if scale is None else scale)
    expected = torch.autograd.grad((whole * upstream).sum(), (hidden, weight))
    with recompute_off_cuda():  # the CUDA path, on the CPU
        # 12 pieces, the last of 1
        chunked = chunked_token_losses(hidden, weight, targets, scale, chunk_tokens=10)
    assert chunked.dtype == torch.float64 and chunked.shape == (3, 37)
    assert chunked[0, 3] == 0 and chunked[2, 5] == 0
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-12)
    gradients = torch.autograd.grad((chunked * upstream).sum(), (hidden, weight))
    for gradient, reference in zip(gradients, expected, strict=True):
        torch.testing.assert_close(gradient, reference, rtol=0, atol=1e-12)


def test_without_autograd_the_pieces_give_the_same_losses() -> None:
    hidden, weight, targets, _ = _inputs(torch.float64)
    with recompute_off_cuda(), torch.no_grad():
        chunked = chunked_token_losses(hidden, weight, targets, chunk_tokens=16)
    torch.testing.assert_close(chunked, _whole(hidden, weight, targets, 1.0), rtol=0, atol=1e-12)


def test_a_piece_must_hold_a_token() -> None:
    hidden, weight, targets, _ = _inputs(torch.float64)
    with recompute_off_cuda(), pytest.raises(ValueError, match="chunk_tokens must be positive, got 0"):
        chunked_token_losses(hidden, weight, targets, chunk_tokens=0)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied-scaled"])
def test_the_transformer_loss_and_gradients_are_those_of_its_logits(tied: bool) -> None:
    config = TransformerConfig(vocab_size=53, width=16, depth=2, heads=2, ffn_hidden=24, context_len=8, rope=tied,
                               swiglu=tied, final_norm=tied, tie_embeddings=tied, scale_logits=not tied)  # fmt: skip
    torch.manual_seed(0)
    model = TransformerLM(config).double()
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 53, (2, 19), generator=generator)  # three windows, the last short
    targets = torch.randint(0, 53, (2, 19), generator=generator)
    targets[1, 0] = IGNORE_INDEX
    upstream = torch.rand(2, 19, generator=generator, dtype=torch.float64)

    def gradients(losses: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.autograd.grad((losses * upstream).sum(), list(model.parameters())))

    whole = _whole_of_logits(model.logits(tokens), targets)
    expected = gradients(whole)
    assert torch.equal(model(tokens, targets)[0], token_losses(model.logits(tokens), targets))  # the CPU path
    with recompute_off_cuda():
        chunked, _ = model(tokens, targets)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-12)
    for gradient, reference in zip(gradients(chunked), expected, strict=True):
        torch.testing.assert_close(gradient, reference, rtol=0, atol=1e-12)


def _relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value - reference).norm() / reference.norm())


@pytest.mark.cuda
def test_cuda_bf16_pieces_match_the_whole_loss_in_a_fraction_of_its_memory() -> None:
    torch.manual_seed(0)
    tokens, vocab, width = 8192, 65536, 256
    hidden = torch.randn(1, tokens, width, device="cuda").requires_grad_()
    weight = (torch.randn(vocab, width, device="cuda") / width**0.5).requires_grad_()
    targets = torch.randint(0, vocab, (1, tokens), device="cuda")
    targets[0, :7] = IGNORE_INDEX
    results = []
    for losses_of in (
        lambda: token_losses(hidden @ weight.T, targets),
        lambda: chunked_token_losses(hidden, weight, targets),
    ):
        hidden.grad = weight.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            losses = losses_of()
        losses.sum().backward()
        torch.cuda.synchronize()
        results.append((losses.detach(), hidden.grad, weight.grad, torch.cuda.max_memory_allocated() - base))
    (
        (whole, whole_hidden, whole_weight, whole_peak),
        (chunked, chunked_hidden, chunked_weight, chunked_peak),
    ) = results
    assert chunked.dtype == torch.float32 and torch.all(chunked[0, :7] == 0)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=2e-2)
    assert _relative_error(chunked_hidden, whole_hidden) < 1e-2
    assert _relative_error(chunked_weight, whole_weight) < 1e-2
    # The whole path holds bf16 and fp32 logits and their softmax (GiBs here); the pieces a few 256 MiB.
    assert chunked_peak < whole_peak / 4, (chunked_peak, whole_peak)


@pytest.mark.cuda
def test_cuda_compiled_layers_equal_the_eager_layers_with_one_graph_for_all() -> None:
    from torch._dynamo.utils import counters

    config = TransformerConfig(vocab_size=512, width=128, depth=4, heads=4, ffn_hidden=256, context_len=256,
                               swiglu=True, rope=True, norm_offset=False, final_norm=True, tie_embeddings=True,
                               scale_logits=False)  # fmt: skip
    tokens = torch.randint(0, 512, (2, 257), generator=torch.Generator().manual_seed(0)).cuda()
    results = []
    for compiled in (False, True):  # the eager run first: it compiles the loss's pieces
        torch.manual_seed(0)
        model = TransformerLM(TransformerConfig(**{**config.__dict__, "compile_layers": compiled})).cuda()
        graphs_before = counters["stats"]["unique_graphs"]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _ = model(tokens[:, :-1], tokens[:, 1:])
        loss.mean().backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    assert counters["stats"]["unique_graphs"] - graphs_before == 1  # four layers, one compiled graph
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=0, atol=3e-2)
    for compiled_grad, eager_grad in zip(compiled_grads, eager_grads, strict=True):
        assert _relative_error(compiled_grad, eager_grad) < 2e-2
