"""What the NS layers keep for the backward (issue #6) and that recomputing the rest changes nothing."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

from engine.models.base import chunked_token_losses, recompute_off_cuda
from engine.models.ns import dendritic as ns_dendritic
from engine.models.ns.dendritic import DendriticLayer
from engine.models.ns.hippocampal import HippocampalLayer
from engine.models.ns.model import NSLM, NSConfig

# Wide enough that the scan's chunks (L = 16) stand out; the stream (16), the pool read (24) and
# the FFN (40) of different widths, so that a saved tensor's last axis tells whose it is.
SMALL = NSConfig(
    vocab_size=29,
    eos_id=3,
    d_model=16,
    n_layers=2,
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


@pytest.fixture(autouse=True)
def recomputing_as_on_cuda() -> Iterator[None]:
    """The models recompute on CUDA tensors only; these tests hold that path on the CPU."""
    with recompute_off_cuda():
        yield


def saved_bytes(layer: torch.nn.Module, select=lambda tensor: True) -> int:
    """Bytes of the storages (each once) that one bf16-autocast forward of `layer` saves for the
    backward, parameters and their casts left out, among the saved tensors `select` accepts."""
    parameter_shapes = {tuple(sorted(p.shape)) for p in layer.parameters()}
    saved: dict[int, torch.Tensor] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tuple(sorted(tensor.shape)) not in parameter_shapes and select(tensor):
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


def test_the_dendritic_layer_keeps_only_its_projections_inputs_and_outputs(one_thread):
    torch.manual_seed(0)
    layer = DendriticLayer(SMALL)
    width, bc_width = SMALL.dendritic_width, SMALL.dendritic_groups * SMALL.dendritic_state
    per_token = (
        4 * SMALL.d_model  # the fp32 stream x
        + 2 * SMALL.d_model  # the normalised stream in bf16, in_proj's input (the norm is recomputed)
        + 2 * (2 * width + 2 * bc_width + SMALL.dendritic_heads)  # in_proj's bf16 output
        + 2 * width  # out_proj's bf16 input
    )
    # The scan's (L x L) decays alone would be 4 L H bytes per token, y and the membranes 8 E.
    assert saved_bytes(layer) <= per_token * ROWS * LENGTH


def test_the_spiking_ffn_keeps_its_input_and_output_but_not_the_membranes(one_thread):
    torch.manual_seed(0)
    layer = HippocampalLayer(SMALL)
    ffn_wide = saved_bytes(
        layer, select=lambda tensor: tensor.shape[-1] in (SMALL.ffn_dim, 2 * SMALL.ffn_dim)
    )
    # The bf16 output of the one product of ffn_in and ffn_skip (gate, up and skip: the PLIF scans
    # read the gate and up halves of it where they lie) and ffn_down's bf16 input.
    assert ffn_wide == (2 * (2 * SMALL.ffn_dim + SMALL.d_model) + 2 * SMALL.ffn_dim) * ROWS * LENGTH


def test_the_hippocampal_layer_keeps_each_normalised_stream_once_in_bf16(one_thread):
    torch.manual_seed(0)
    layer = HippocampalLayer(SMALL)
    stream_wide = saved_bytes(layer, select=lambda tensor: tensor.shape[-1] == SMALL.d_model)
    # The fp32 stream before each block, and each block's normalised stream in bf16 (the norms are
    # recomputed; the maps reading one stream share its bf16 copy).
    assert stream_wide == (2 * 4 + 2 * 2) * SMALL.d_model * ROWS * LENGTH


def passthrough(function, *args, **kwargs):
    """torch.utils.checkpoint's call without the checkpoint: everything saved, nothing recomputed."""
    return function(*args)


def losses_and_gradients(model: NSLM) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Two windows of the same rows (the second from the first's carry) under bf16 autocast."""
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, SMALL.vocab_size, (ROWS, 2 * LENGTH), generator=generator)
    tokens[:, 5] = SMALL.eos_id
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        first, carry = model(tokens[:, :LENGTH], tokens[:, :LENGTH])
        second, _ = model(tokens[:, LENGTH:], tokens[:, LENGTH:], carry)
    losses = torch.cat([first, second], dim=1)
    (first.mean() + second.mean()).backward()
    return losses.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("recompute", ["none", "all"])
def test_the_memory_savings_change_no_bit_of_the_results(one_thread, monkeypatch, recompute):
    torch.manual_seed(0)
    model = NSLM(dataclasses.replace(SMALL, n_layers=4))
    model.recompute = recompute
    losses, gradients = losses_and_gradients(model)
    again_losses, again_gradients = losses_and_gradients(model)  # run to run
    # Everything kept, nothing recomputed.
    monkeypatch.setattr(ns_dendritic, "checkpoint", passthrough)  # the hippocampal layers' too
    kept_losses, kept_gradients = losses_and_gradients(model)
    assert torch.equal(again_losses, losses) and torch.equal(kept_losses, losses)
    for gradient, again, kept in zip(gradients, again_gradients, kept_gradients, strict=True):
        assert torch.equal(again, gradient) and torch.equal(kept, gradient)


def test_chunked_losses_equal_the_whole_head_and_keep_only_the_hidden_states() -> None:
    from engine.models.base import token_losses

    torch.manual_seed(0)
    head = torch.nn.Linear(16, 300, bias=False)
    hidden = torch.randn(2, 37, 16, requires_grad=True)
    targets = torch.randint(0, 300, (2, 37))
    targets[0, 3] = -100  # IGNORE_INDEX: no loss there, in either path

    whole = token_losses(head(hidden), targets)
    whole.sum().backward()
    expected = [hidden.grad.clone(), head.weight.grad.clone()]
    hidden.grad, head.weight.grad = None, None

    saved: list[torch.Tensor] = []

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        chunked = chunked_token_losses(hidden, head.weight, targets, chunk_tokens=10)  # 8 chunks, the last of 4
    torch.testing.assert_close(chunked, whole)
    assert chunked[0, 3] == 0
    chunked.sum().backward()
    torch.testing.assert_close(hidden.grad, expected[0])
    torch.testing.assert_close(head.weight.grad, expected[1])
    # Nothing of vocabulary width is kept for the backward: only hidden states and targets.
    assert saved and all(tensor.shape[-1] != 300 for tensor in saved)


def test_on_a_cpu_the_models_keep_everything_and_recompute_nothing(one_thread) -> None:
    torch.manual_seed(0)
    layer = DendriticLayer(SMALL)
    recomputing = saved_bytes(layer)
    with recompute_off_cuda(False):  # the CPU default, outside this module's fixture
        keeping = saved_bytes(layer)
        head, hidden = torch.nn.Linear(4, 7, bias=False), torch.randn(2, 5, 4, requires_grad=True)
        widths: list[int] = []

        def keep(tensor: torch.Tensor) -> torch.Tensor:
            widths.append(tensor.shape[-1] if tensor.dim() else 0)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            chunked_token_losses(hidden, head.weight, torch.zeros(2, 5, dtype=torch.long), chunk_tokens=3)
        assert 7 in widths  # the logits are kept: the loss is taken in one piece, not recomputed
    assert keeping > 2 * recomputing


@pytest.mark.parametrize("recompute", ["none", "dendritic", "hippocampal", "all", "dendritic:1"])
def test_a_layer_recomputed_whole_runs_its_scans_twice_not_three_times(
    monkeypatch: pytest.MonkeyPatch, recompute: str
) -> None:
    """The forward and one recomputation per update, whichever layers the model recomputes whole:
    nested inside the layer's checkpoint, the parts' own checkpoints ran a third forward (ns-2b's
    profile: its dendritic scan 108 times an update for 36 layers)."""
    scans: list[int] = []
    neurons: list[int] = []
    chunked_scan, plif_scan = ns_dendritic.chunked_scan, ns_dendritic.PLIFNeurons.scan
    monkeypatch.setattr(ns_dendritic, "chunked_scan", lambda *args: scans.append(1) or chunked_scan(*args))
    monkeypatch.setattr(
        ns_dendritic.PLIFNeurons, "scan", lambda *args, **kwargs: neurons.append(1) or plif_scan(*args, **kwargs)
    )
    torch.manual_seed(0)
    model = NSLM(dataclasses.replace(SMALL, n_layers=4))
    model.recompute = recompute
    tokens = torch.randint(0, SMALL.vocab_size, (ROWS, LENGTH + 1))
    losses, _ = model(tokens[:, :-1], tokens[:, 1:])
    losses.mean().backward()
    dendritic = sum(isinstance(layer, DendriticLayer) for layer in model.layers)
    hippocampal = len(model.layers) - dendritic
    assert len(scans) == 2 * dendritic
    # The soma a dendritic layer, the write gate and the FFN's two populations a hippocampal layer;
    # the write gate is kept (not recomputed) unless its layer is recomputed whole.
    write_gate_again = hippocampal if recompute in ("hippocampal", "all") else 0
    assert len(neurons) == 2 * dendritic + 2 * 2 * hippocampal + hippocampal + write_gate_again


def test_training_makes_no_spikes_and_a_captured_forward_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layers read only the membranes in training, so their PLIF scans store no spikes there
    (a third of an fp32 soma's forward traffic); the probes' captured forward gets every spike train."""
    asked: list[bool] = []
    scan = ns_dendritic.PLIFNeurons.scan

    def recorded(*args, **kwargs):
        asked.append(kwargs["with_spikes"])
        return scan(*args, **kwargs)

    monkeypatch.setattr(ns_dendritic.PLIFNeurons, "scan", recorded)
    torch.manual_seed(0)
    model = NSLM(SMALL)
    tokens = torch.randint(0, SMALL.vocab_size, (ROWS, LENGTH + 1))
    losses, _ = model(tokens[:, :-1], tokens[:, 1:])
    losses.mean().backward()
    assert asked and not any(asked)
    asked.clear()
    x, is_eos = model.embed(tokens[:, :-1]), tokens[:, :-1] == SMALL.eos_id
    with torch.no_grad():
        for layer in model.layers:
            x, _, trace = layer(x, is_eos, None, capture=True)
            spikes = (
                [trace.soma_spikes]
                if isinstance(layer, DendriticLayer)
                else [trace.gate_spikes, trace.ffn_gate_spikes, trace.ffn_up_spikes]
            )
            assert all(train.shape[:2] == (ROWS, LENGTH) for train in spikes)
    assert asked and all(asked)


def model_saved_bytes(model: NSLM) -> int:
    """Bytes of the storages (each once) that a bf16-autocast training forward of `model` saves for
    the backward, its parameters and their bf16 casts (the only 2-d bf16 tensors) left out."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        pointer = tensor.untyped_storage().data_ptr()
        weight_cast = tensor.dtype == torch.bfloat16 and tensor.dim() == 2
        if pointer not in parameters and not weight_cast:
            saved.setdefault(pointer, tensor.untyped_storage().nbytes())
        return tensor

    tokens = torch.randint(0, SMALL.vocab_size, (ROWS, LENGTH), generator=torch.Generator().manual_seed(2))
    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
        torch.autocast("cpu", dtype=torch.bfloat16),
    ):
        model(tokens, tokens)
    return sum(saved.values())


def test_each_dendritic_layer_recomputed_whole_keeps_the_same_less() -> None:
    """`dendritic:K` sits between none and every dendritic layer, one layer's saving a step:
    the knob that fills a GPU's memory without recomputing more layers than it must."""
    torch.manual_seed(0)
    model = NSLM(dataclasses.replace(SMALL, n_layers=4, hippocampal_every=4))  # 3 dendritic layers
    kept = []
    for setting in ("none", "dendritic:1", "dendritic:2", "dendritic"):
        model.recompute = setting
        kept.append(model_saved_bytes(model))
    savings = [before - after for before, after in zip(kept, kept[1:])]
    assert all(saving > 0 for saving in savings), kept
    assert savings[0] == savings[1] == savings[2], kept
