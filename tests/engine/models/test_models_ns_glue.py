"""The NS layers' compiled glue (`engine.models.ns.glue`, issue 22): every stage compiled computes
what it computes eagerly, forward and backward; a model with its stages compiled matches the eager
model within bf16 rounding, compiles each stage once for all the layers of a kind, recompiles
nothing on later updates or in the checkpoints' recomputation, and keeps no more for the backward.

On the CPU the stages run through inductor's C++ backend (forced on here: the model compiles them on
CUDA only); the CUDA test runs a whole ns-tiny update both ways."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint

from engine.errors import ConfigError
from engine.models.base import compile_static, recompute_off_cuda
from engine.models.ns import dendritic as ns_dendritic
from engine.models.ns import hippocampal as ns_hippocampal
from engine.models.ns.dendritic import DendriticLayer, gated_membrane, scan_steps, soma_drive
from engine.models.ns.glue import fuses_glue, normalised, with_update, with_updates
from engine.models.ns.hippocampal import HippocampalLayer, pool_terms, rotated
from engine.models.ns.model import NSLM, NSConfig
from engine.models.ns.presets import PRESETS

# Dendritic and hippocampal layers alternating, two of each: the layers of a kind share graphs.
SMALL = NSConfig(
    vocab_size=29,
    eos_id=3,
    d_model=16,
    n_layers=4,
    hippocampal_every=2,
    dendritic_heads=4,
    dendritic_head_dim=8,
    dendritic_state=8,
    dendritic_groups=2,
    chunk_len=16,
    attn_heads=2,
    attn_head_dim=12,
    ffn_dim=40,
)
ROWS, LENGTH = 2, 48
STAGES = (
    "normalised", "scan_steps", "soma_drive", "gated_membrane", "with_update", "with_updates", "rotated", "pool_terms",
)  # fmt: skip
STAGE_SIGNATURES = 8
"""Graphs of a model with both kinds of layers under bf16 autocast: each stage once (every norm's
output in bf16, the maps' dtype; `with_update` for both kinds of layers)."""


def perturbed(layer: torch.nn.Module, seed: int) -> torch.nn.Module:
    """The layer with every parameter moved off its initial value (zero maps, unit norms)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))
    return layer


def leaf(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).requires_grad_()


def stage_cases() -> dict[str, tuple[Callable[..., object], Callable[[], tuple]]]:
    """Each stage with a maker of its fp32 arguments (fresh leaves per call)."""
    torch.manual_seed(0)
    dendritic, hippocampal = perturbed(DendriticLayer(SMALL), 1), perturbed(HippocampalLayer(SMALL), 2)
    heads, head_dim, width = SMALL.dendritic_heads, SMALL.dendritic_head_dim, SMALL.dendritic_width
    attn_heads, attn_dim = SMALL.attn_heads, SMALL.attn_head_dim
    cos, sin = hippocampal.rotary.tables(LENGTH, 0, torch.device("cpu"), torch.float32)
    is_eos = torch.zeros(ROWS, LENGTH, dtype=torch.bool)
    is_eos[:, 7] = True
    return {
        "normalised": (normalised, lambda: (leaf(ROWS, LENGTH, SMALL.d_model, seed=3), dendritic.norm, torch.float32)),
        "scan_steps": (scan_steps, lambda: (leaf(ROWS, LENGTH, heads, seed=4), dendritic)),
        "soma_drive": (
            soma_drive,
            lambda: (leaf(ROWS, LENGTH, heads, head_dim, seed=5), leaf(ROWS, LENGTH, heads, head_dim, seed=6), dendritic),
        ),
        "gated_membrane": (
            gated_membrane,
            lambda: (leaf(ROWS, LENGTH, width, seed=7), leaf(ROWS, LENGTH, width, seed=8), torch.float32),
        ),
        "with_update": (with_update, lambda: (leaf(ROWS, LENGTH, 16, seed=9), leaf(ROWS, LENGTH, 16, seed=10))),
        "with_updates": (
            with_updates,
            lambda: tuple(leaf(ROWS, LENGTH, 16, seed=seed) for seed in (11, 12, 13)),
        ),
        "rotated": (
            rotated,
            lambda: (leaf(ROWS, attn_heads, LENGTH, attn_dim, seed=14), leaf(ROWS, attn_heads, LENGTH, attn_dim, seed=15),
                     cos, sin),
        ),  # fmt: skip
        "pool_terms": (
            pool_terms,
            lambda: (leaf(ROWS, LENGTH, attn_heads, seed=16), is_eos, leaf(ROWS, LENGTH, attn_heads, seed=17),
                     hippocampal),
        ),  # fmt: skip
    }


def outputs_and_gradients(stage: Callable[..., object], arguments: tuple) -> list[torch.Tensor]:
    """The stage's outputs and the gradients of a fixed random weighting of them with respect to
    every leaf argument and every parameter of a module argument."""
    modules = [argument for argument in arguments if isinstance(argument, torch.nn.Module)]
    for module in modules:
        module.zero_grad()
    outputs = stage(*arguments)
    outputs = list(outputs) if isinstance(outputs, tuple) else [outputs]
    generator = torch.Generator().manual_seed(99)
    weighting = sum((out * torch.randn(out.shape, generator=generator)).sum() for out in outputs)
    weighting.backward()
    leaves = [argument for argument in arguments if isinstance(argument, torch.Tensor) and argument.requires_grad]
    parameters = [p for module in modules for p in module.parameters() if p.grad is not None]
    return [out.detach() for out in outputs] + [t.grad for t in leaves] + [p.grad.clone() for p in parameters]


@pytest.mark.parametrize("name", STAGES)
def test_each_compiled_stage_computes_what_it_computes_eagerly(one_thread, name: str) -> None:
    cases = stage_cases()
    assert tuple(cases) == STAGES
    stage, arguments = cases[name]
    eager = outputs_and_gradients(stage, arguments())
    fused = outputs_and_gradients(compile_static(stage), arguments())
    assert len(fused) == len(eager) > 1
    for got, expected in zip(fused, eager, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.fixture
def glue_on_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[bool], None]]:
    """`set(True)` makes the layers compile their stages on the CPU as they do on CUDA (and recompute
    their checkpointed parts, `recompute_off_cuda`); `set(False)` runs them eagerly."""

    def set_fused(enabled: bool) -> None:
        for module in (ns_dendritic, ns_hippocampal):
            monkeypatch.setattr(module, "fuses_glue", lambda config, x: enabled and torch.is_grad_enabled())

    with recompute_off_cuda():
        yield set_fused


def losses_and_gradients(model: NSLM, autocast: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Two windows of the same rows (the second from the first's carry): the losses per token and
    every parameter's gradient, flattened into one vector."""
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, SMALL.vocab_size, (ROWS, 2 * LENGTH), generator=generator)
    tokens[:, 5] = SMALL.eos_id
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        first, carry = model(tokens[:, :LENGTH], tokens[:, :LENGTH])
        second, _ = model(tokens[:, LENGTH:], tokens[:, LENGTH:], carry)
    (first.mean() + second.mean()).backward()
    gradients = torch.cat([p.grad.flatten() for p in model.parameters()])
    return torch.cat([first, second], dim=1).detach(), gradients


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).norm() / expected.norm())


def test_a_model_with_compiled_glue_matches_the_eager_one_and_compiles_each_stage_once(
    one_thread, glue_on_cpu
) -> None:
    torch.manual_seed(0)
    model = NSLM(SMALL)
    glue_on_cpu(False)
    reference_losses, reference_gradients = losses_and_gradients(model, autocast=False)  # fp32
    eager_losses, eager_gradients = losses_and_gradients(model, autocast=True)
    glue_on_cpu(True)
    torch._dynamo.reset()  # count this test's compilations alone
    graphs = counters["stats"]["unique_graphs"]
    fused_losses, fused_gradients = losses_and_gradients(model, autocast=True)
    assert counters["stats"]["unique_graphs"] - graphs == STAGE_SIGNATURES
    # Later updates, and the recomputation of whole layers in the backward, compile nothing new,
    # and the compiled kernels repeat their results bit for bit.
    for recompute in ("none", "all"):
        model.recompute = recompute
        again_losses, again_gradients = losses_and_gradients(model, autocast=True)
        assert torch.equal(again_losses, fused_losses) and torch.equal(again_gradients, fused_gradients)
    assert counters["stats"]["unique_graphs"] - graphs == STAGE_SIGNATURES
    # Both bf16 runs are as far from the fp32 reference as bf16 rounding puts them (the compiled
    # stages round less often: they compute in fp32 between their bf16 inputs and outputs).
    eager_error = relative_error(eager_losses, reference_losses)
    assert relative_error(fused_losses, reference_losses) <= 2 * eager_error + 1e-4
    eager_error = relative_error(eager_gradients, reference_gradients)
    assert 0 < eager_error < 0.1
    assert relative_error(fused_gradients, reference_gradients) <= 1.5 * eager_error


def saved_bytes(layer: torch.nn.Module) -> int:
    """Bytes of the storages (each once) one bf16-autocast forward of `layer` saves for the backward."""
    saved: dict[int, torch.Tensor] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.setdefault(tensor.untyped_storage().data_ptr(), tensor)
        return tensor

    x = torch.randn(ROWS, LENGTH, SMALL.d_model, requires_grad=True)
    is_eos = torch.zeros(ROWS, LENGTH, dtype=torch.bool)
    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
        torch.autocast("cpu", dtype=torch.bfloat16),
    ):
        layer(x, is_eos, None)
    return sum(tensor.untyped_storage().nbytes() for tensor in saved.values())


@pytest.mark.parametrize("layer_class", [DendriticLayer, HippocampalLayer])
def test_compiled_stages_keep_no_more_for_the_backward(one_thread, glue_on_cpu, layer_class) -> None:
    torch.manual_seed(0)
    layer = layer_class(SMALL)
    glue_on_cpu(False)
    eager = saved_bytes(layer)
    glue_on_cpu(True)
    assert saved_bytes(layer) <= eager


def test_a_stage_keeps_compiling_past_dynamo_s_default_limit_and_its_recomputation_agrees(one_thread) -> None:
    """A line meets more shapes than Dynamo's default 8 (each length's own and shared micro-batches,
    times the dtypes a stage is called with). Each still compiles, inside non-reentrant checkpoints
    as the layers call it, and every recomputation runs the code its forward ran (the backward
    checks that the recomputed tensors match the saved ones)."""
    stage = compile_static(normalised)
    norm = perturbed(DendriticLayer(SMALL), 1).norm
    torch._dynamo.reset()  # this test's compilations alone
    graphs = counters["stats"]["unique_graphs"]
    shapes = [(rows, LENGTH, SMALL.d_model) for rows in range(1, 10)]  # 9 > Dynamo's default 8
    for shape in shapes:
        x = torch.randn(shape, requires_grad=True)
        out = checkpoint(lambda x: stage(x, norm, torch.float32) * 2.0, x, use_reentrant=False)
        out.sum().backward()
        torch.testing.assert_close(x.grad, torch.autograd.grad((normalised(x, norm, torch.float32) * 2.0).sum(), x)[0])
    assert counters["stats"]["unique_graphs"] - graphs == len(shapes)


def test_the_switch_is_a_checked_boolean_and_the_cpu_runs_the_stages_eagerly() -> None:
    with pytest.raises(ConfigError, match="compile_glue must be true or false"):
        dataclasses.replace(SMALL, compile_glue=1).validate()
    x = torch.zeros(1, 1, SMALL.d_model)
    assert not fuses_glue(SMALL, x)  # the CPU runs the stages eagerly


@pytest.mark.cuda
def test_cuda_update_with_compiled_glue_matches_the_eager_one_without_recompiling() -> None:
    """A whole ns-tiny update (the Triton scans and pool read between the stages) compiled and eager,
    both under bf16 autocast, against an fp32 eager reference; later updates (the dendritic layers
    recomputed in the backward, as ns-2b trains) compile nothing new."""
    config = PRESETS["ns-tiny"]
    tokens = torch.randint(0, config.vocab_size, (3, 192), generator=torch.Generator().manual_seed(1)).cuda()
    tokens[:, 50] = config.eos_id
    cuda_x = torch.zeros(1, device="cuda")
    assert fuses_glue(config, cuda_x) and not fuses_glue(dataclasses.replace(config, compile_glue=False), cuda_x)
    with torch.no_grad():
        assert not fuses_glue(config, cuda_x)

    def update(model: NSLM, autocast: bool) -> tuple[torch.Tensor, torch.Tensor]:
        model.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss, _ = model(tokens, tokens)
        loss.mean().backward()
        return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])

    def built(compile_glue: bool) -> NSLM:
        torch.manual_seed(0)
        return NSLM(dataclasses.replace(config, compile_glue=compile_glue)).cuda()

    reference_loss, reference_gradients = update(built(False), autocast=False)
    eager_loss, eager_gradients = update(built(False), autocast=True)
    model = built(True)
    # The eager runs compiled the loss's pieces; the rows' shape is this test's own, so what the
    # first update compiles is its stages (no reset: it would drop the loss pieces' graphs too).
    graphs = counters["stats"]["unique_graphs"]
    fused_loss, fused_gradients = update(model, autocast=True)
    first = counters["stats"]["unique_graphs"] - graphs
    assert 0 < first <= STAGE_SIGNATURES
    model.recompute = "dendritic"
    for _ in range(3):
        again_loss, _ = update(model, autocast=True)
        torch.testing.assert_close(again_loss, fused_loss, rtol=0, atol=0)
    assert counters["stats"]["unique_graphs"] - graphs == first
    eager_error = relative_error(eager_gradients, reference_gradients)
    assert relative_error(fused_loss, reference_loss) <= 2 * relative_error(eager_loss, reference_loss) + 1e-4
    assert relative_error(fused_gradients, reference_gradients) <= 1.5 * eager_error + 1e-3
