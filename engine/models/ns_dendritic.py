"""The dendritic layer: a selective SSM of compartments per head feeding a PLIF soma per channel.

    x -> RMSNorm -> in_proj -> (z, u, B, C, dt_raw)
    dt = softplus(dt_raw + b_h)                    per token and head
    A_h = -exp(A_log_h)
    V_t = exp(A_h dt_t) V_{t-1} + dt_t B_t u_t^T    N x P compartments per head (chunked scan)
    y_t = C_t^T V_t + D_h u_t
    soma: PLIF neurons on y (per channel); output = out_proj(soma membrane * silu(z)),
    centred over D (its mean over the width is removed) before it joins the residual stream.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from engine.models.common import RMSNorm
from engine.models.ns_config import NSConfig
from engine.models.ns_neurons import PLIFNeurons, at_least_fp32
from engine.models.ns_scan import chunked_scan


@dataclass
class DendriticTrace:
    """What a dendritic layer's probes read (validation only)."""

    dt: torch.Tensor
    """(Bt, T, H) the heads' steps."""
    A: torch.Tensor
    """(H,) the heads' decays (negative)."""
    soma_spikes: torch.Tensor
    """(Bt, T, H * P) the soma's spikes."""


def centred(update: torch.Tensor) -> torch.Tensor:
    """Residual centering: a layer's update minus its mean over the width (B, T, D)."""
    return update - update.mean(dim=-1, keepdim=True)


class DendriticLayer(nn.Module):
    """See the module docstring. State across windows: compartments and soma membranes."""

    state_names = ("compartments", "soma")

    def __init__(self, config: NSConfig) -> None:
        super().__init__()
        self.config = config
        heads, width = config.dendritic_heads, config.dendritic_width
        self.bc_width = config.dendritic_groups * config.dendritic_state
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
        batch, length, _ = x.shape
        heads, head_dim, width = config.dendritic_heads, config.dendritic_head_dim, config.dendritic_width
        projected = self.in_proj(self.norm(x))  # (Bt, T, 2E + 2GN + H)
        z, u, B, C, dt_raw = projected.split([width, width, self.bc_width, self.bc_width, heads], dim=-1)
        dt = self.steps(dt_raw)  # (Bt, T, H)
        A = self.decay()  # (H,)
        u = u.reshape(batch, length, heads, head_dim)
        groups_shape = (batch, length, config.dendritic_groups, config.dendritic_state)
        y, compartments = chunked_scan(
            u,
            dt,
            A,
            B.reshape(groups_shape),
            C.reshape(groups_shape),
            config.chunk_len,
            None if state is None else state["compartments"],
        )  # (Bt, T, H, P), (Bt, H, N, P)
        y = y + at_least_fp32(self.skip).view(heads, 1) * u
        spikes, membrane, soma = self.soma(
            y.reshape(batch, length, width), None if state is None else state["soma"]
        )  # (Bt, T, E) x 2, (Bt, E)
        update = self.out_proj((membrane * F.silu(z)).to(x.dtype))  # (Bt, T, D)
        new_state = {"compartments": compartments, "soma": soma}
        trace = DendriticTrace(dt=dt, A=A, soma_spikes=spikes) if capture else None
        return x + centred(update), new_state, trace
