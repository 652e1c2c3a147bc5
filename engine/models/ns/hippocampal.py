"""The hippocampal layer: a pool read over the row, then a spiking feed-forward block.

Pool read, per head h (after RMSNorm):
    q, k, v                       linear maps, RoPE on q and k
    c_t = sum_{s<=t} softplus(w_c x_s + b_h) + [x_s is EOS] softplus(e_h)
                                  the pool clock: monotone, with a learnable extra increment
                                  at end-of-document tokens (a head may jump at boundaries)
    g_s = sigmoid(alpha (V_s - V_th))
                                  write tag in (0, 1) of a PLIF gate neuron per head (V its
                                  membrane); the neuron's spikes are the hard version of g
    read: softmax_s(q_t k_s / sqrt(d) + log g_s - lambda_h (c_t - c_s)) over s <= t (see
    `ns_pool_read`), then out_proj, centred over D.
Spiking FFN (after RMSNorm): down(V_gate * V_up) + skip(x) with PLIF gate and up neurons
(their membranes), centred over D.

The read is within the window; what crosses windows is the clock's reading and the neurons'
membranes. Inside a window the clock is used relative to the window's start, so the carried
offset never enters the read's arithmetic (it only continues the clock's reading). A decoder's
window is everything it has seen: its `PoolCache` keeps those tokens' keys, values, tags and
clocks, and the carried clock (counted from the first of them) places new tokens on their scale.

Memory (`bench/ns_memory.py`: an ns-1p3b layer under bf16 autocast kept 194 KB per token, 91 KB
now): the FFN's two neuron populations and their product, and the two RMSNorms, run under a
non-reentrant `torch.utils.checkpoint` (`recomputed_in_backward`). The backward keeps ffn_in's
bf16 output and the stream, and recomputes the PLIF scans and the norms (cheap, elementwise)
instead of keeping the neurons' inputs and membranes (bf16, plus the fp32 copies the PLIF kernel
keeps for bf16 inputs) and the normalised streams; the recomputation gives the same values.
Each normalised stream comes out of its norm in the maps' dtype (bf16 under autocast) and goes
through the maps that read it as one product in training (`maps_of`, `stacked_linear`: q, k, v,
the clock and the write gate; the FFN's gate, up and skip), so it is kept once and gets one gradient.

Speed on CUDA: the elementwise work between the matrix products and the kernels runs as compiled
stages (`engine.models.ns.glue`, config `compile_glue`): the norms, RoPE on q and k (`rotated`), the
clocks' increments, the write tags and the rates (`pool_terms`), the centred residual adds. The pool
read's output and the FFN's product go to their maps in the maps' dtype, without an fp32 round trip.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from engine.models.base import compute_dtype
from engine.models.common import RMSNorm, RotaryEmbedding, apply_rotary, maps_of
from engine.models.ns.config import NSConfig
from engine.models.ns.dendritic import recomputed_in_backward
from engine.models.ns.glue import fused, fuses_glue, normalised, with_update, with_updates
from engine.models.ns.neurons import PLIFNeurons, at_least_fp32, softplus_inverse
from engine.models.ns.pool_read import PoolCache, pool_read


@dataclass
class HippocampalTrace:
    """What a hippocampal layer's probes read (validation only)."""

    q: torch.Tensor
    """(Bt, Ha, T, d) queries after RoPE."""
    k: torch.Tensor
    """(Bt, Ha, T, d) keys after RoPE."""
    clock: torch.Tensor
    """(Bt, Ha, T) pool clocks relative to the window's start."""
    clock_step: torch.Tensor
    """(Bt, Ha, T) the clocks' increments."""
    rate: torch.Tensor
    """(Ha,) clock rates lambda_h."""
    log_tag: torch.Tensor
    """(Bt, Ha, T) log write tags."""
    gate_spikes: torch.Tensor
    """(Bt, T, Ha) spikes of the write-gate neurons."""
    ffn_gate_spikes: torch.Tensor
    """(Bt, T, F) spikes of the FFN's gate neurons."""
    ffn_up_spikes: torch.Tensor
    """(Bt, T, F) spikes of the FFN's up neurons."""


class HippocampalLayer(nn.Module):
    """See the module docstring. State across windows: the clocks and three neuron populations."""

    state_names = ("clock", "write_gate", "ffn_gate", "ffn_up")

    def __init__(self, config: NSConfig) -> None:
        super().__init__()
        self.config = config
        heads, width = config.attn_heads, config.attn_width
        self.recompute_parts = True
        """Whether the layer's parts recompute their intermediates in the backward (see
        `recomputed_in_backward`); False while the model recomputes the whole layer."""

        def neurons(channels: int) -> PLIFNeurons:
            return PLIFNeurons(
                channels,
                beta_max=config.beta_max,
                alpha=config.surrogate_alpha,
                threshold_init=config.initial_threshold,
                tau_min=config.neuron_tau_min,
                tau_max=config.neuron_tau_max,
            )

        self.attn_norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self.qkv = nn.Linear(config.d_model, 3 * width, bias=False)
        self.rotary = RotaryEmbedding(config.attn_head_dim, config.rope_base)
        self.clock_proj = nn.Linear(config.d_model, heads)  # w_c, b
        self.clock_eos_raw = nn.Parameter(torch.empty(heads))  # e_h
        self.clock_log_rate = nn.Parameter(torch.empty(heads))  # log lambda_h
        self.write_proj = nn.Linear(config.d_model, heads)
        self.write_gate = neurons(heads)
        self.out_proj = nn.Linear(width, config.d_model, bias=False)

        self.ffn_norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self.ffn_in = nn.Linear(config.d_model, 2 * config.ffn_dim, bias=False)  # gate and up
        self.ffn_gate = neurons(config.ffn_dim)
        self.ffn_up = neurons(config.ffn_dim)
        self.ffn_down = nn.Linear(config.ffn_dim, config.d_model, bias=False)
        self.ffn_skip = nn.Linear(config.d_model, config.d_model, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Clocks tick 1 per token with rates log-spaced like ALiBi slopes; every tag starts equal.

        Called again by the model after its generic initialisation of the matrices: the clock
        and write maps start at zero so the first reads are plain ALiBi-style attention.
        """
        config, device = self.config, self.clock_log_rate.device
        nn.init.zeros_(self.clock_proj.weight)
        self.clock_proj.bias.fill_(softplus_inverse(1.0))
        self.clock_eos_raw.fill_(softplus_inverse(0.1))
        self.clock_log_rate.copy_(
            torch.linspace(
                math.log(config.clock_rate_max),
                math.log(config.clock_rate_min),
                config.attn_heads,
                device=device,
            )
        )
        nn.init.zeros_(self.write_proj.weight)
        nn.init.zeros_(self.write_proj.bias)

    def rate(self) -> torch.Tensor:
        """(Ha,) clock rates lambda_h > 0."""
        return torch.exp(at_least_fp32(self.clock_log_rate))

    def forward(
        self,
        x: torch.Tensor,
        is_eos: torch.Tensor,
        state: dict[str, torch.Tensor] | None,
        capture: bool = False,
        pool: PoolCache | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], HippocampalTrace | None]:
        """x (Bt, T, D), is_eos (Bt, T) bool -> x + updates, the new state, a trace when `capture`.

        With a `pool` (decoding), x follows the tokens the pool holds, which `state` has seen since
        it was fresh: their positions continue from the pool's length, their clocks from the
        state's, and the read runs over the pool, which they join."""
        config = self.config
        batch, length, _ = x.shape
        heads, head_dim = config.attn_heads, config.attn_head_dim
        position = 0 if pool is None else pool.length
        fuse = fuses_glue(config, x)
        h = recomputed_in_backward(
            fused(normalised, fuse), x, self.attn_norm, compute_dtype(x), enabled=self.recompute_parts
        )
        qkv, clock_raw, write_in = maps_of(h, (self.qkv, self.clock_proj, self.write_proj))
        q, k, v = qkv.view(batch, length, 3, heads, head_dim).permute(2, 0, 3, 1, 4)  # (Bt, Ha, T, d)
        cos, sin = self.rotary.tables(length, position, q.device, q.dtype)
        q, k = fused(rotated, fuse)(q, k, cos, sin)

        gate_spikes, gate_membrane, gate_last = self.write_gate(
            write_in, None if state is None else state["write_gate"], with_spikes=capture
        )  # (Bt, T, Ha) x 2, (Bt, Ha)
        clock_step_bh, log_tag_bh, rate = fused(pool_terms, fuse)(clock_raw, is_eos, gate_membrane, self)
        clock_bh = clock_step_bh.cumsum(dim=-1)  # relative to the window's start
        clock_offset = (
            clock_bh.new_zeros(batch, heads) if state is None else state["clock"].to(clock_bh.dtype)
        )  # (Bt, Ha)
        if pool is None:
            read = pool_read(q, k, v, log_tag_bh, clock_bh, rate)  # (Bt, Ha, T, d)
        else:
            read = pool.read(q, k, v, log_tag_bh, clock_offset.unsqueeze(-1) + clock_bh, rate)
        # In v's dtype, as out_proj reads it (bf16 under autocast): no fp32 copy in between.
        read = read.transpose(1, 2).reshape(batch, length, heads * head_dim)
        x = fused(with_update, fuse)(x, self.out_proj(read))

        f = recomputed_in_backward(
            fused(normalised, fuse), x, self.ffn_norm, compute_dtype(x), enabled=self.recompute_parts
        )
        ffn_in, skip = maps_of(f, (self.ffn_in, self.ffn_skip))
        gate_in, up_in = ffn_in.chunk(2, dim=-1)  # (Bt, T, F) each
        gate_v0, up_v0 = (None, None) if state is None else (state["ffn_gate"], state["ffn_up"])
        hidden, ffn_gate_spikes, ffn_up_spikes, ffn_gate_last, ffn_up_last = recomputed_in_backward(
            self.ffn_hidden, gate_in, up_in, gate_v0, up_v0, capture, enabled=self.recompute_parts
        )
        x = fused(with_updates, fuse)(x, self.ffn_down(hidden), skip)

        new_state = {
            "clock": clock_offset + clock_bh[..., -1],
            "write_gate": gate_last,
            "ffn_gate": ffn_gate_last,
            "ffn_up": ffn_up_last,
        }
        trace = None
        if capture:
            trace = HippocampalTrace(
                q=q,
                k=k,
                clock=clock_bh,
                clock_step=clock_step_bh,
                rate=rate,
                log_tag=log_tag_bh,
                gate_spikes=gate_spikes,
                ffn_gate_spikes=ffn_gate_spikes,
                ffn_up_spikes=ffn_up_spikes,
            )
        return x, new_state, trace

    def ffn_hidden(
        self,
        gate_in: torch.Tensor,
        up_in: torch.Tensor,
        gate_v0: torch.Tensor | None,
        up_v0: torch.Tensor | None,
        with_spikes: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """The FFN's inputs (Bt, T, F) and carried membranes (Bt, F) -> V_gate * V_up (Bt, T, F) in
        the inputs' dtype (ffn_down's: bf16 under autocast), the gate and up spikes (Bt, T, F; None
        without `with_spikes`: only the probes read them) and the last membranes (Bt, F)."""
        gate_spikes, gate_v, gate_last = self.ffn_gate(gate_in, gate_v0, with_spikes=with_spikes)
        up_spikes, up_v, up_last = self.ffn_up(up_in, up_v0, with_spikes=with_spikes)
        return gate_v * up_v, gate_spikes, up_spikes, gate_last, up_last


def rotated(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k (Bt, Ha, T, d) rotated by RoPE tables (T, d) (a stage, `engine.models.ns.glue`)."""
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def pool_terms(
    clock_raw: torch.Tensor, is_eos: torch.Tensor, gate_membrane: torch.Tensor, layer: HippocampalLayer
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """clock_proj's output and the write gates' membranes (Bt, T, Ha), is_eos (Bt, T) -> the clocks'
    increments and the log write tags (Bt, Ha, T), and the clock rates (Ha,) (a stage)."""
    clock_step = F.softplus(at_least_fp32(clock_raw)) + is_eos.unsqueeze(-1) * F.softplus(
        at_least_fp32(layer.clock_eos_raw)
    )  # (Bt, T, Ha)
    log_tag = F.logsigmoid(
        layer.config.surrogate_alpha * (at_least_fp32(gate_membrane) - layer.write_gate.threshold())
    )  # (Bt, T, Ha)
    # The clocks run along the last axis of a (Bt, Ha, T) copy: CUDA's cumsum along the middle
    # axis of (Bt, T, Ha) walks T one step at a time (0.62 against 0.03 ms at T 4096, 20 heads on
    # the H200), and so does its backward, a reversed cumsum.
    return clock_step.transpose(1, 2).contiguous(), log_tag.transpose(1, 2), layer.rate()
