"""A population of PLIF neurons: learnable leak and threshold per channel, run by `kernels.plif`."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from kernels.plif import plif_membrane, plif_scan


def at_least_fp32(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor in float32, or unchanged when it is float64 (gradient checks run in float64)."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def _logit(p: torch.Tensor) -> torch.Tensor:
    return torch.log(p) - torch.log1p(-p)


def softplus_inverse(y: float) -> float:
    """x with softplus(x) = y (y > 0)."""
    return y + math.log(-math.expm1(-y))


class PLIFNeurons(nn.Module):
    """`channels` PLIF neurons: V = beta V + (1 - beta) x, spike H(V - V_th), soft reset V -= V_th s.

    beta = beta_max * sigmoid(beta_logit) stays below beta_max everywhere with a gradient
    everywhere (a hard clamp would stop the gradient at the bound); V_th = softplus(raw) > 0.
    Initial time constants tau = -1 / log(beta) are log-spaced over the channels between
    tau_min and tau_max, so a population starts with fast and slow neurons.
    """

    def __init__(
        self,
        channels: int,
        *,
        beta_max: float,
        alpha: float,
        threshold_init: float,
        tau_min: float,
        tau_max: float,
    ) -> None:
        super().__init__()
        self.beta_max = beta_max
        self.alpha = alpha
        self.tau_min, self.tau_max, self.threshold_init = tau_min, tau_max, threshold_init
        self.beta_logit = nn.Parameter(torch.empty(channels))
        self.threshold_raw = nn.Parameter(torch.empty(channels))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        channels = self.beta_logit.numel()
        device = self.beta_logit.device
        log_tau = torch.linspace(math.log(self.tau_min), math.log(self.tau_max), channels, device=device)
        beta = torch.exp(-torch.exp(-log_tau))  # (C,) = exp(-1 / tau)
        # Keep the initial leak strictly inside (0, beta_max) so the logit is finite.
        share = (beta / self.beta_max).clamp(1e-4, 1 - 1e-4)
        self.beta_logit.copy_(_logit(share))
        self.threshold_raw.fill_(softplus_inverse(self.threshold_init))

    def beta(self) -> torch.Tensor:
        """(C,) leak in (0, beta_max), float32 (float64 for a float64 model)."""
        return self.beta_max * torch.sigmoid(at_least_fp32(self.beta_logit))

    def threshold(self) -> torch.Tensor:
        """(C,) firing threshold > 0, float32 (float64 for a float64 model)."""
        return F.softplus(at_least_fp32(self.threshold_raw))

    def forward(
        self, x: torch.Tensor, v0: torch.Tensor | None, *, with_spikes: bool = True
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """x (B, T, C), v0 (B, C) float32 or None -> spikes, membrane (B, T, C), v_last (B, C) float32.

        The membrane returned is the potential before the reset (what the layers read, so the
        gradient reaches beta and x without passing the surrogate). Without `with_spikes` the
        spikes are None and never made: the layers read them only for their probes.
        """
        return self.scan(x, v0, self.beta(), self.threshold(), with_spikes=with_spikes)

    def scan(
        self,
        x: torch.Tensor,
        v0: torch.Tensor | None,
        beta: torch.Tensor,
        threshold: torch.Tensor,
        *,
        with_spikes: bool = True,
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """`forward` with this population's `beta()` and `threshold()` computed by the caller: in a
        compiled stage (`engine.models.ns.glue`), fused with the elementwise work that feeds x."""
        if with_spikes:
            return plif_scan(x, beta, threshold, v0, self.alpha)
        membrane, v_last = plif_membrane(x, beta, threshold, v0, self.alpha)
        return None, membrane, v_last

    def extra_repr(self) -> str:
        return f"channels={self.beta_logit.numel()}, beta_max={self.beta_max}, alpha={self.alpha}"
