"""The dendritic layer: a selective SSM of compartments per head feeding a PLIF soma per channel.

    x -> RMSNorm -> in_proj -> (z, u, B, C, dt_raw)
    dt = softplus(dt_raw + b_h)                    per token and head
    A_h = -exp(A_log_h)
    V_t = exp(A_h dt_t) V_{t-1} + dt_t B_t u_t^T    N x P compartments per head (chunked scan)
    y_t = C_t^T V_t + D_h u_t
    soma: PLIF neurons on y (per channel); output = out_proj(soma membrane * silu(z)),
    centred over D (its mean over the width is removed) before it joins the residual stream.

Memory: everything between in_proj and out_proj (the scan, the skip, the soma, the gating) and
the RMSNorm run under a non-reentrant `torch.utils.checkpoint` (`recomputed_in_backward`): the
backward keeps their inputs (the stream x and in_proj's bf16 output) and recomputes the rest,
which it would otherwise keep: the scan's (L x L) decay matrices and fp32 per-chunk tensors, y,
the membranes, the normalised stream (fp32, per channel). An ns-1p3b layer under bf16 autocast
kept 109 KB per token, 25 KB now (`bench/ns_memory.py`). The recomputation is one more forward
of the scan, the PLIF scan and the norm (a few percent of the layer's FLOPs; the projections are
not recomputed) and gives the same values, so the gradients are unchanged. On CUDA only
(`recompute_saves_memory`): on a CPU it cost a third of ns-tiny's step for memory nobody lacks.

Speed on CUDA: the elementwise work between the matrix products and the kernels runs as compiled
stages (`engine.models.ns.glue`, config `compile_glue`): the norm with in_proj's bf16 cast, dt and
A (`scan_steps`), y + D u with the soma's leak and threshold (`soma_drive`), the gating in out_proj's
dtype (`gated_membrane`) and the centred residual add. The stages are called inside the checkpoints
as the eager operations were, and keep no more for the backward.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from engine.models.base import compute_dtype, recompute_saves_memory
from engine.models.common import RMSNorm
from engine.models.ns.config import NSConfig
from engine.models.ns.glue import fused, fuses_glue, normalised, with_update
from engine.models.ns.neurons import PLIFNeurons, at_least_fp32
from engine.models.ns.scan import chunked_scan, compiled_chunked_scan, recurrent_step
from kernels.ssd_scan import ssd_scan


@dataclass
class DendriticTrace:
    """What a dendritic layer's probes read (validation only)."""

    dt: torch.Tensor
    """(Bt, T, H) the heads' steps."""
    A: torch.Tensor
    """(H,) the heads' decays (negative)."""
    soma_spikes: torch.Tensor
    """(Bt, T, H * P) the soma's spikes."""


def recomputed_in_backward(function: Callable[..., Any], *args: Any, enabled: bool = True) -> Any:
    """function(*args) with only the arguments kept for the backward, which recomputes the rest
    (non-reentrant torch.utils.checkpoint): for the parts whose intermediates weigh more per
    token than their recomputation costs. Called directly where `recompute_saves_memory` says no
    (no graph recorded, or a CPU), or where not `enabled`: inside a layer the model already
    recomputes whole (`NSModel.recompute`), whose own checkpoint keeps only the layer's input.
    Nested, the part would run three times an update (the forward, the layer's recomputation,
    then its own): ns-2b ran its dendritic scan 108 times an update for 36 layers."""
    if not enabled or not recompute_saves_memory(args[0]):
        return function(*args)
    # Nothing recomputed draws random numbers: no RNG state to stash (or to read in a CUDA graph capture).
    return checkpoint(function, *args, use_reentrant=False, preserve_rng_state=False)


class DendriticLayer(nn.Module):
    """See the module docstring. State across windows: compartments and soma membranes."""

    state_names = ("compartments", "soma")

    def __init__(self, config: NSConfig) -> None:
        super().__init__()
        self.config = config
        heads, width = config.dendritic_heads, config.dendritic_width
        self.bc_width = config.dendritic_groups * config.dendritic_state
        self.recompute_parts = True
        """Whether the layer's parts recompute their intermediates in the backward (see
        `recomputed_in_backward`); False while the model recomputes the whole layer."""
        self.norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self.in_proj = nn.Linear(config.d_model, 2 * width + 2 * self.bc_width + heads, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(heads))
        self.A_log = nn.Parameter(torch.empty(heads))
        self.skip = nn.Parameter(torch.empty(heads))  # D_h: u's direct path to y
        self.soma = PLIFNeurons(
            width,
            beta_max=config.beta_max,
            alpha=config.surrogate_alpha,
            threshold_init=config.initial_threshold,
            tau_min=config.neuron_tau_min,
            tau_max=config.neuron_tau_max,
        )
        self.out_proj = nn.Linear(width, config.d_model, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Steps and decay rates log-spaced over the heads (fast and slow heads from the start)."""
        config, device = self.config, self.dt_bias.device
        heads = config.dendritic_heads
        dt = torch.exp(
            torch.linspace(math.log(config.dt_init_min), math.log(config.dt_init_max), heads, device=device)
        )
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
        self.A_log.copy_(
            torch.linspace(math.log(config.a_init_min), math.log(config.a_init_max), heads, device=device)
        )
        self.skip.fill_(1.0)

    def steps(self, dt_raw: torch.Tensor) -> torch.Tensor:
        """(Bt, T, H) raw steps -> dt = softplus(dt_raw + b), float32 (float64 for a float64 model)."""
        return F.softplus(at_least_fp32(dt_raw) + at_least_fp32(self.dt_bias))

    def decay(self) -> torch.Tensor:
        """(H,) A_h = -exp(A_log_h) < 0."""
        return -torch.exp(at_least_fp32(self.A_log))

    def forward(
        self,
        x: torch.Tensor,
        is_eos: torch.Tensor,
        state: dict[str, torch.Tensor] | None,
        capture: bool = False,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], DendriticTrace | None]:
        """x (Bt, T, D) -> x + update, the new state, and a trace when `capture` (is_eos unused)."""
        config = self.config
        width, heads = config.dendritic_width, config.dendritic_heads
        fuse = fuses_glue(config, x)
        normed = recomputed_in_backward(
            fused(normalised, fuse), x, self.norm, compute_dtype(x), enabled=self.recompute_parts
        )
        projected = self.in_proj(normed)  # (Bt, T, 2E + 2GN + H)
        parts = projected.split([width, width, self.bc_width, self.bc_width, heads], dim=-1)
        compartments0, soma0 = (None, None) if state is None else (state["compartments"], state["soma"])
        gated, compartments, soma, dt, spikes = recomputed_in_backward(
            self.gated_soma, *parts, compartments0, soma0, fuse, capture, enabled=self.recompute_parts
        )
        update = self.out_proj(gated)  # (Bt, T, D)
        new_state = {"compartments": compartments, "soma": soma}
        trace = DendriticTrace(dt=dt, A=self.decay(), soma_spikes=spikes) if spikes is not None else None
        return fused(with_update, fuse)(x, update), new_state, trace

    def gated_soma(
        self,
        z: torch.Tensor,
        u: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        dt_raw: torch.Tensor,
        compartments0: torch.Tensor | None,
        soma0: torch.Tensor | None,
        fuse: bool,
        with_spikes: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """in_proj's parts (Bt, T, .) and the carried state -> soma membrane * silu(z) (Bt, T, E) in
        the dtype out_proj runs in, the compartments (Bt, H, N, P), the soma membranes (Bt, E), dt
        (Bt, T, H) and the spikes (None without `with_spikes`: only the probes read them). fuse:
        the stages between the kernels compiled (`fuses_glue`)."""
        config = self.config
        batch, length, _ = u.shape
        heads, head_dim = config.dendritic_heads, config.dendritic_head_dim
        dt, A = fused(scan_steps, fuse)(dt_raw, self)  # (Bt, T, H), (H,)
        u = u.reshape(batch, length, heads, head_dim)
        groups_shape = (batch, length, config.dendritic_groups, config.dendritic_state)
        if length == 1:  # a decoder's step: the recurrence itself, not a chunk padded from one token
            scan = recurrent_step
        elif u.is_cuda and config.scan_kernel and u.dtype != torch.float64 and _kernel_takes(config.chunk_len):
            scan = ssd_scan
        else:
            scan = compiled_chunked_scan() if u.is_cuda and config.compile_scan else chunked_scan
        y, compartments = scan(
            u,
            dt,
            A,
            B.reshape(groups_shape),
            C.reshape(groups_shape),
            config.chunk_len,
            compartments0,
        )  # (Bt, T, H, P), (Bt, H, N, P)
        drive, beta, threshold = fused(soma_drive, fuse)(y, u, self)
        spikes, membrane, soma = self.soma.scan(
            drive, soma0, beta, threshold, with_spikes=with_spikes
        )  # (Bt, T, E) x 2, (Bt, E)
        gated = fused(gated_membrane, fuse)(membrane, z, compute_dtype(z))
        return gated, compartments, soma, dt, spikes


def scan_steps(dt_raw: torch.Tensor, layer: DendriticLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan's elementwise inputs: dt (Bt, T, H) and A (H,) (a stage, `engine.models.ns.glue`)."""
    return layer.steps(dt_raw), layer.decay()


def soma_drive(
    y: torch.Tensor, u: torch.Tensor, layer: DendriticLayer
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The scan's y and the inputs u (Bt, T, H, P) -> the soma's input y + D u (Bt, T, E), float32
    (the membranes' precision), and the soma's leak and threshold (a stage)."""
    batch, length, heads, _ = u.shape
    drive = y + at_least_fp32(layer.skip).view(heads, 1) * u
    return drive.reshape(batch, length, -1), layer.soma.beta(), layer.soma.threshold()


def gated_membrane(membrane: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """membrane * silu(z) (Bt, T, E) in `dtype`, out_proj's (a stage): compiled, the bf16 product
    comes out of the gating's kernel, with no fp32 copy between it and autocast's cast."""
    return (membrane * F.silu(z)).to(dtype)


def _kernel_takes(chunk_len: int) -> bool:
    """Whether `kernels.ssd_scan` runs this chunk length (a power of two of at least 16)."""
    return chunk_len >= 16 and chunk_len & (chunk_len - 1) == 0
