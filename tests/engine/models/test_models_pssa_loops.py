"""PSSA's Ouro loops as the article composes them, against a hand-unrolled reference in float64.

The article (spec/pssa-article-ru.txt, "Обучение: прямой и обратный проход"): pass 0 reads the
embeddings; every later pass reads the stream the passes before it left and adds its output
scaled by loop_scale = 1 / loops; the backward walks the passes in reverse order, hands each
pass the stream's adjoint times loop_scale, and adds the adjoint that reaches the pass's input
back into the stream's (the residual adjoint). Each pass has its own carry; weights and banks
are shared. Here that recipe is computed pass by pass, each pass a separate autograd graph from
a detached input, and the model's one autograd graph must give the same loss, carries and
gradients.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.models.pssa.config import PSSAConfig
from engine.models.pssa.memory import to_poincare_ball
from engine.models.pssa.model import PSSALM

CONFIG = PSSAConfig(
    vocab_size=11, d_latent=6, d_state=3, d_mem_key=3, mem_capacity=6, chunk_len=9, mem_top_k=2,
    depth=2, adapter_rank=2, tau_mem=0.5,
)  # fmt: skip


def _model(loops: int) -> PSSALM:
    torch.manual_seed(0)
    config = PSSAConfig(**{**CONFIG.__dict__, "loops": loops})
    model = PSSALM(config).double().eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for block in model.blocks:  # the zero-initialised branches carry signal too
            block.adapter_up.weight.normal_(0, 0.3, generator=generator)
            block.mlp_down.weight.normal_(0, 0.3, generator=generator)
            keys = to_poincare_ball(torch.randn(6, 3, generator=generator, dtype=torch.float64))
            block.bank.write(keys, torch.randn(6, 6, generator=generator, dtype=torch.float64), [9.0] * 6, 0)
    return model


def _one_pass(model: PSSALM, stream: torch.Tensor, carry: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass over the stack, by hand: b0, then each later block as a residual / sqrt(depth)."""
    states = []
    for index, block in enumerate(model.blocks):
        out, h_last, _ = block(stream, carry[index])
        stream = out if index == 0 else stream + out / math.sqrt(len(model.blocks))
        states.append(h_last)
    return stream, torch.stack(states)


def _accumulate(into: dict[str, torch.Tensor], names: list[str], grads: tuple[torch.Tensor | None, ...]) -> None:
    for name, grad in zip(names, grads):
        if grad is not None:
            into[name] = into[name] + grad if name in into else grad


def _article_reference(
    model: PSSALM, tokens: torch.Tensor, targets: torch.Tensor, carry: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Row losses, the carry out and every parameter's gradient of sum(losses), pass by pass."""
    loops = model.config.loops
    loop_scale = 1.0 / loops
    named = dict(model.named_parameters())
    names = [name for name in named if name != "embed.weight"]
    params = [named[name] for name in names]
    # Forward, step by step: u_0 = pass_0(e), u_l = u_{l-1} + loop_scale * pass_l(u_{l-1}).
    with torch.no_grad():
        streams = [model.embed(tokens)]  # the input of each pass
        carries = []
        for loop in range(loops):
            out, states = _one_pass(model, streams[-1], carry[loop])
            carries.append(states)
            streams.append(out if loop == 0 else streams[-1] + loop_scale * out)
    # The head's adjoint of the final stream.
    final = streams[-1].clone().requires_grad_()
    logits = model.head(final) / math.sqrt(model.config.d_latent)
    losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    grads: dict[str, torch.Tensor] = {}
    adjoint, *head_grads = torch.autograd.grad(losses.sum(), [final, *params], allow_unused=True)
    _accumulate(grads, names, tuple(head_grads))
    # Backward, passes in reverse order: each later pass gets loop_scale times the stream's
    # adjoint, and the adjoint at its input is added back into the stream's (the residual).
    for loop in range(loops - 1, 0, -1):
        inp = streams[loop].clone().requires_grad_()
        out, _ = _one_pass(model, inp, carry[loop])
        input_adjoint, *pass_grads = torch.autograd.grad(out, [inp, *params], loop_scale * adjoint, allow_unused=True)
        _accumulate(grads, names, tuple(pass_grads))
        adjoint = adjoint + input_adjoint
    # Pass 0 reads the embeddings: its input adjoint is the embedding rows' gradient.
    embedded = model.embed(tokens)
    out, _ = _one_pass(model, embedded, carry[0])
    pass_grads = torch.autograd.grad(out, [named["embed.weight"], *params], adjoint, allow_unused=True)
    _accumulate(grads, ["embed.weight", *names], pass_grads)
    return losses.view_as(targets.double()), torch.stack(carries), grads


@pytest.mark.parametrize("loops", [1, 2, 3])
def test_loops_compose_and_differentiate_as_the_article_does(loops: int) -> None:
    model = _model(loops)
    generator = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 11, (2, 7), generator=generator)
    targets = torch.randint(0, 11, (2, 7), generator=generator)
    carry = 0.3 * torch.randn(loops, 2, 2, 6, 3, generator=generator, dtype=torch.float64)
    expected_losses, expected_carry, expected_grads = _article_reference(model, tokens, targets, carry)
    # The model's own composition (`hidden`, what forward and the decoder run), with the loss
    # kept in float64 here: the model's token losses are float32 by contract.
    stream, carry_out, _ = model.hidden(tokens, carry)
    logits = model.head(stream) / math.sqrt(model.config.d_latent)
    losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    losses.sum().backward()
    torch.testing.assert_close(losses.view_as(expected_losses), expected_losses, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(model(tokens, targets, carry)[0].double(), expected_losses, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(carry_out, expected_carry, rtol=1e-12, atol=1e-12)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected_grads[name], rtol=1e-10, atol=1e-12, msg=name)
    if loops > 1:  # each pass has its own carry
        assert not torch.allclose(carry_out[0], carry_out[1])
