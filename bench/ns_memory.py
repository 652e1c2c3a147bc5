"""Bytes autograd saves for backward per token, per NS layer kind, on the CPU (issue #6: memory).

A preset's model is built with its layer count cut to one dendritic and one hippocampal layer,
and each layer runs forward once under CPU bf16 autocast (the GPU's training precision) on a
fp32 residual stream, inside `torch.autograd.graph.saved_tensors_hooks`. Every storage a saved
tensor lives in is counted once (a view keeps its whole storage alive). Parameters and their
autocast copies do not grow with the row and are left out (a saved tensor shaped like one of
the layer's parameters, or its transpose, is taken for one).

Two kernels take another path on the GPU than on the CPU, and the CPU path saves other things,
so the bench stands in for them with what the GPU path saves (computing the values with the
CPU reference): the PLIF scan (`kernels.plif._PlifScan`: its input, beta, the threshold, v0 and
the membrane in fp32) and the hippocampal pool read (flex_attention: q, k, v, the output, the
fp32 log-sum-exp and the fp32 per-key bias; the CPU's explicit read keeps (T x T) scores).

One JSON row per layer kind: bytes saved per token, the layer's input and input + output per
token (what a whole-layer recomputation keeps, for comparison), and the largest savers by
dtype and shape; one for the head (final norm, tied output map, cross-entropy); and the whole
preset's total per token (its layer counts times the rows).

    python bench/ns_memory.py [--preset ns-1p3b] [--seq-len 512] [--rows 1] [--top 12]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import torch
from torch import nn

# The repository root first: run as a script, bench/ would lead sys.path and its kernels.py
# would shadow the kernels package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.models.base import recompute_off_cuda  # noqa: E402
from engine.models.build import build_model
from engine.models.ns.dendritic import DendriticLayer  # noqa: E402
from engine.models.ns.model import NSLM  # noqa: E402
from engine.models.ns.pool_read import per_key_bias, pool_read_explicit  # noqa: E402
from engine.models.presets import preset_config  # noqa: E402
from kernels.plif import plif_scan_reference  # noqa: E402


class _PlifGpuSaves(torch.autograd.Function):
    """The CPU reference's values with what the GPU's `_PlifScan` saves (forward only)."""

    @staticmethod
    def forward(ctx, x, beta, v_th, v0, alpha):
        spikes, v_pre, v_last = plif_scan_reference(x, beta, v_th, v0, alpha)
        x = x.contiguous()
        v_pre_f32 = v_pre.float() if x.dtype != torch.float32 else v_pre
        ctx.save_for_backward(x, beta, v_th, v0, v_pre_f32)
        return spikes, v_pre, v_last


def plif_gpu_saves(
    x: torch.Tensor,
    beta: torch.Tensor,
    v_th: torch.Tensor,
    v0: torch.Tensor | None = None,
    alpha: float = 4.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`kernels.plif.plif_scan`'s signature and values, with the GPU path's saves."""
    return _PlifGpuSaves.apply(x, beta, v_th, v0, alpha)


def plif_membrane_gpu_saves(
    x: torch.Tensor,
    beta: torch.Tensor,
    v_th: torch.Tensor,
    v0: torch.Tensor | None = None,
    alpha: float = 4.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.plif.plif_membrane`'s signature and values, with the GPU path's saves."""
    _, v_pre, v_last = plif_gpu_saves(x, beta, v_th, v0, alpha)
    return v_pre, v_last


class _FlexGpuSaves(torch.autograd.Function):
    """The explicit read's values with what flex_attention saves (forward only)."""

    @staticmethod
    def forward(ctx, q, k, v, key_bias, out):
        log_sum_exp = key_bias.new_empty(key_bias.shape)  # (Bt, Ha, T) fp32, as flex keeps it
        ctx.save_for_backward(q, k, v, out, log_sum_exp, key_bias)
        return out.clone()


def pool_read_gpu_saves(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_tag: torch.Tensor,
    clock: torch.Tensor,
    rate: torch.Tensor,
) -> torch.Tensor:
    """`ns_pool_read.pool_read`'s signature and values, with the GPU path's (flex) saves."""
    with torch.no_grad():
        out = pool_read_explicit(q, k, v, log_tag, clock, rate)
    # The per-key bias as `ns_pool_read.pool_read_flex` builds it (its ops save what they save).
    return _FlexGpuSaves.apply(q, k, v, per_key_bias(log_tag, clock, rate), out)


@contextmanager
def gpu_kernel_saves() -> Iterator[None]:
    """The PLIF scan and the pool read saving what their GPU paths save (see the docstring)."""
    with (
        mock.patch("engine.models.ns.neurons.plif_scan", plif_gpu_saves),
        mock.patch("engine.models.ns.neurons.plif_membrane", plif_membrane_gpu_saves),
        mock.patch("engine.models.ns.hippocampal.pool_read", pool_read_gpu_saves),
    ):
        yield


def saved_storages(forward: Callable[[], object], module: nn.Module) -> dict[int, torch.Tensor]:
    """storage address -> one saved tensor in it, for `forward` run once under bf16 autocast."""
    parameter_shapes = {tuple(sorted(p.shape)) for p in module.parameters()}  # transposes too
    saved: dict[int, torch.Tensor] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        # Holding the tensor keeps its storage alive, so no later tensor reuses the address.
        if tuple(sorted(tensor.shape)) not in parameter_shapes:
            saved.setdefault(tensor.untyped_storage().data_ptr(), tensor)
        return tensor

    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
        torch.autocast("cpu", dtype=torch.bfloat16),
        gpu_kernel_saves(),
        recompute_off_cuda(),  # what the models do on CUDA
    ):
        forward()
    return saved


def describe(tensor: torch.Tensor) -> str:
    return f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}"


def saved_row(storages: dict[int, torch.Tensor], tokens: int, top: int) -> dict:
    """Bytes per token in all, and of the `top` largest dtype-and-shape kinds."""
    by_kind: dict[str, int] = defaultdict(int)
    for tensor in storages.values():
        by_kind[describe(tensor)] += tensor.untyped_storage().nbytes()
    largest = sorted(by_kind.items(), key=lambda item: -item[1])[:top]
    return {
        "saved_bytes_per_token": round(sum(by_kind.values()) / tokens),
        "largest": {name: round(size / tokens) for name, size in largest},
    }


def stream(model: NSLM, rows: int, seq_len: int) -> torch.Tensor:
    """A random fp32 residual stream (B, T, D) that needs a gradient."""
    torch.manual_seed(0)
    return torch.randn(rows, seq_len, model.config.d_model, requires_grad=True)


def layer_row(model: NSLM, layer: nn.Module, rows: int, seq_len: int, top: int) -> dict:
    x = stream(model, rows, seq_len)
    is_eos = torch.zeros(rows, seq_len, dtype=torch.bool)
    storages = saved_storages(lambda: layer(x, is_eos, None), layer)
    stream_bytes = x.shape[-1] * x.element_size()
    return {
        "layer": "dendritic" if isinstance(layer, DendriticLayer) else "hippocampal",
        **saved_row(storages, rows * seq_len, top),
        "input_bytes_per_token": stream_bytes,
        "input_output_bytes_per_token": 2 * stream_bytes,
    }


def head_row(model: NSLM, rows: int, seq_len: int, top: int) -> dict:
    """The final norm, the tied output map and the cross-entropy."""
    x = stream(model, rows, seq_len)
    targets = torch.randint(0, model.config.vocab_size, (rows, seq_len))
    storages = saved_storages(lambda: model.losses_from_hidden(x, targets), model)
    return {"layer": "head", **saved_row(storages, rows * seq_len, top)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="ns-1p3b")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--top", type=int, default=12, help="largest savers listed per layer")
    args = parser.parse_args()
    model = build_model(args.preset, {"n_layers": 2, "hippocampal_every": 2})  # dendritic, hippocampal
    shape = {"preset": args.preset, "rows": args.rows, "seq_len": args.seq_len}
    rows = [layer_row(model, layer, args.rows, args.seq_len, args.top) for layer in model.layers]
    rows.append(head_row(model, args.rows, args.seq_len, args.top))
    for row in rows:
        print(json.dumps({**shape, **row}), flush=True)
    # The whole preset: its own layer counts times the rows above.
    config = preset_config(args.preset)
    hippocampal = sum(config.is_hippocampal(index) for index in range(config.n_layers))
    per_token = {row["layer"]: row["saved_bytes_per_token"] for row in rows}
    total = (
        (config.n_layers - hippocampal) * per_token["dendritic"]
        + hippocampal * per_token["hippocampal"]
        + per_token["head"]
    )
    print(json.dumps({**shape, "layer": f"model ({config.n_layers - hippocampal} dendritic, "
                      f"{hippocampal} hippocampal, head)", "saved_bytes_per_token": total}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
