"""The NS layers' elementwise glue, compiled into fused kernels on CUDA.

Between their matrix products and the Triton kernels (the chunked scan, the PLIF scans, the pool
read), the layers do elementwise work: the RMSNorms, the steps and decays, the skip path, the
gating, RoPE, the pool clocks and tags, the centred residual adds. Eagerly every operation is a
kernel of its own that reads and writes a (B, T, width) tensor, in the forward, in the backward and
again in the recomputation: in a profile of one ns-2b update (B 8 x T 4096, bf16 autocast, recompute
dendritic, eager engine) those kernels took about 680 of its 1,790 ms, more than the matrix products
(557 ms). So the layers run each region between two kernels or matrix products as a stage function,
`fused(stage, enabled)(...)`: where `fuses_glue` says so, through torch.compile (a region becomes a
kernel or two forward and backward), elsewhere as it is.

Regions and not whole layers: the kernels are autograd.Functions launching Triton kernels, called
inside non-reentrant checkpoints and, in the graph engine, inside CUDA-graph captures. Dynamo would
have to trace into them or break the graph at each; the regions between them are plain tensor code
that it traces whole, without a break. A stage takes its layer's modules as arguments (their
parameters become graph inputs), so the layers of one kind share one compiled graph per shape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from engine.models.base import compile_static
from engine.models.common import RMSNorm
from engine.models.ns.config import NSConfig

Stage = TypeVar("Stage", bound=Callable[..., object])


def fuses_glue(config: NSConfig, x: torch.Tensor) -> bool:
    """Whether a layer's stages run compiled for the stream x: with `compile_glue`, on CUDA, under
    autograd (the training forward and its recomputation), not in float64. The CPU presets are the
    exact reference and would pay the compilation for nothing; the no-grad forwards (validation,
    probes, decoding) run eagerly, so their shapes add no compilations (as the transformer's
    `compile_layers`); float64 is for gradient checks."""
    return config.compile_glue and x.is_cuda and torch.is_grad_enabled() and x.dtype != torch.float64


def fused(stage: Stage, enabled: bool) -> Stage:
    """`stage` compiled where `enabled` (see `fuses_glue`), else `stage` itself."""
    return compile_static(stage) if enabled else stage


def centred(update: torch.Tensor) -> torch.Tensor:
    """Residual centering: a layer's update minus its mean over the width (B, T, D)."""
    return update - update.mean(dim=-1, keepdim=True)


def normalised(x: torch.Tensor, norm: RMSNorm, dtype: torch.dtype) -> torch.Tensor:
    """norm(x) in `dtype` (x first: `recomputed_in_backward` reads its device): compiled, a bf16 map's input comes out of the norm's kernel in bf16,
    not as an fp32 tensor that autocast then copies (the same values: one rounding of the norm)."""
    return norm(x).to(dtype)


def with_update(x: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    """The stream x plus a layer's update, centred. Compiled, the mean, the difference and the sum
    are one kernel, computed in fp32 from the bf16 update (eagerly, the centred update is rounded
    to bf16 before the sum: the two differ by that rounding)."""
    return x + centred(update)


def with_updates(x: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """The stream x plus the centred sum of two maps' outputs (`with_update`'s, for a block with a
    skip map; a function of its own, so each call site keeps its own compilations)."""
    return x + centred(first + second)
