"""Validation probes of the NS model's dendritic and hippocampal layers, named as the spec names them.

Every reading comes from a forward over the held-out rows with each layer's trace captured
(one layer's trace alive at a time). A document boundary is an EOS followed by the next
document's first token within the row; its two tokens are the EOS and that first token.

Dendritic (`dendritic/...` over every dendritic head of the model, `dendritic/layerNN/...` per
layer). A head's mean step m_h is its dt averaged over the rows' tokens; with A_h its decay:
  retention       exp(A_h m_h T): what is left of a compartment's potential at a row's first
                  token after its last (T the row length); _p50, _max, _frac_gt_0.9, _frac_gt_0.5
  retention32k_frac_gt_0.5   the share of heads with exp(A_h m_h 32768) > 0.5
  tau             1 / (-A_h m_h): the e-fold length in tokens; _p50, _p90, _max
  firing          the somas' mean spike rate
  boundaries      the number of boundaries in the rows; when not 0:
  boundary_retention          exp(A_h (dt_e + dt_e+1)) averaged over boundaries; _p50, _max
  boundary_step_ratio         a head's mean step over boundary tokens over its mean step on the
                              other tokens; _p50, _max
  retention_seg<k>_p50/_max, firing_seg<k>   on rows longer than the training length: the
                  retention from the row's first token to the end of segment k (segments of
                  the training length) and the firing rate within segment k

Hippocampal (`hippocampal/...` over the model, `hippocampal/layerNN/...` per layer):
  clock_tau_head<h>, clock_tau_p50/_max   1 / (lambda_h * mean clock increment): the tokens
                  over which a head's read bias falls by one e-fold
  clock_boundary_step_ratio   the clocks' mean increment over boundary tokens over their mean
                  increment elsewhere (mean over heads; when there are boundaries)
  write_head<h>, write_p50/_max   a head's mean write tag
  gate_firing, ffn_gate_firing, ffn_up_firing   spike rates of the write gates and FFN neurons
  rope_ext_q_head<h>, rope_ext_k_head<h>, rope_ext_q_p50/_max, rope_ext_k_p50/_max   the share of
                  a head's query / key energy in the RoPE pairs whose wavelength exceeds the
                  training length; rope_ext_pairs_frac: the share of all pairs that are such
  attn_dist_bin<k>   the read's weight by distance for the queries of each row's last training-
                  length positions: bin 0 the query itself, bin k distances 2^(k-1) .. 2^k - 1
  attn_beyond_train_head<h>, _p50, _max   the weight on keys the training length or more back
  attn_mean_log2_head<h>, _p50, _max      the weight-mean of log2(1 + distance)
  attn_entropy_head<h>, _p50, _max        the entropy of the weights (nats)
The read weights are recomputed from the heads' queries, keys, clocks and tags as
`ns_pool_read.read_weights` defines them, in blocks of queries so long rows fit in memory.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import TYPE_CHECKING

import torch

from engine.models.ns.dendritic import DendriticTrace
from engine.models.ns.hippocampal import HippocampalLayer, HippocampalTrace
from engine.models.ns.pool_read import read_weights

if TYPE_CHECKING:
    from engine.models.ns.model import NSLM

LONG_CONTEXT = 32768
"""The horizon of `retention32k_frac_gt_0.5`."""
ATTENTION_BLOCK_ELEMENTS = 1 << 25
"""Read weights materialised at once by the attention probes (128 MiB in float32)."""


def quantile(values: torch.Tensor, q: float) -> float:
    """The q-quantile (linear interpolation) of a 1-D tensor."""
    return float(torch.quantile(values.double(), q))


def boundary_mask(tokens: torch.Tensor, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) tokens -> (B, T) bool masks of the EOS tokens that open a boundary and of both
    tokens of every boundary (the EOS and the next document's first token)."""
    opens = tokens == eos_id
    opens[:, -1] = False  # an EOS at the row's end has no next document within the row
    both = opens.clone()
    both[:, 1:] |= opens[:, :-1]
    return opens, both


def head_stats(prefix: str, name: str, values: torch.Tensor, quantiles: tuple[float, ...] = (0.5,)) -> dict:
    """`<prefix><name>_p50` (and other quantiles) and `_max` of per-head values."""
    out = {f"{prefix}{name}_p{round(q * 100)}": quantile(values, q) for q in quantiles}
    out[f"{prefix}{name}_max"] = float(values.max())
    return out


class DendriticProbe:
    """Accumulates the dendritic layers' readings; `results()` gives model- and layer-level keys."""

    def __init__(self, boundary_open: torch.Tensor, boundary_tokens: torch.Tensor, train_len: int) -> None:
        self.boundary_open, self.boundary_tokens, self.train_len = boundary_open, boundary_tokens, train_len
        self.out: dict[str, float] = {}
        self.per_head: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.firing: list[float] = []
        self.segment_firing: dict[int, list[float]] = defaultdict(list)

    def add(self, layer: str, trace: DendriticTrace) -> None:
        dt = trace.dt.double()  # (B, T, H)
        rate = -trace.A.double()  # (H,)
        length = dt.shape[1]
        mean_step = dt.mean(dim=(0, 1))  # (H,)
        per_head = {
            "retention": torch.exp(-rate * mean_step * length),
            "tau": 1.0 / (rate * mean_step),
            "retention32k": torch.exp(-rate * mean_step * LONG_CONTEXT),
        }
        firing = float(trace.soma_spikes.double().mean())
        boundaries = int(self.boundary_open.sum())
        if boundaries:
            # dt_e + dt_e+1 of every boundary: (n, H)
            across = dt[:, :-1][self.boundary_open[:, :-1]] + dt[:, 1:][self.boundary_open[:, :-1]]
            per_head["boundary_retention"] = torch.exp(-rate * across).mean(dim=0)
            inside = ~self.boundary_tokens
            if inside.any():
                per_head["boundary_step_ratio"] = dt[self.boundary_tokens].mean(0) / dt[inside].mean(0)
        prefix = f"dendritic/{layer}/"
        self.out.update(self._summary(prefix, per_head, firing))
        for name, values in per_head.items():
            self.per_head[name].append(values)
        self.firing.append(firing)
        if length > self.train_len:
            self._segments(prefix, dt, rate, trace.soma_spikes)

    def _segments(self, prefix: str, dt: torch.Tensor, rate: torch.Tensor, spikes: torch.Tensor) -> None:
        """Retention from the row's start to each segment's end, and firing within each segment."""
        exponent = rate * dt.mean(dim=0).cumsum(dim=0)  # (T, H): -A sum_{s<=t} dt_s, mean row
        for segment, start in enumerate(range(0, dt.shape[1], self.train_len)):
            end = min(start + self.train_len, dt.shape[1])
            retention = torch.exp(-exponent[end - 1])  # (H,)
            self.out.update(head_stats(prefix, f"retention_seg{segment}", retention))
            self.per_head[f"retention_seg{segment}"].append(retention)
            firing = float(spikes[:, start:end].double().mean())
            self.out[f"{prefix}firing_seg{segment}"] = firing
            self.segment_firing[segment].append(firing)

    def _summary(self, prefix: str, per_head: dict[str, torch.Tensor], firing: float) -> dict[str, float]:
        out = {}
        retention = per_head["retention"]
        out.update(head_stats(prefix, "retention", retention))
        out[f"{prefix}retention_frac_gt_0.9"] = float((retention > 0.9).double().mean())
        out[f"{prefix}retention_frac_gt_0.5"] = float((retention > 0.5).double().mean())
        out[f"{prefix}retention32k_frac_gt_0.5"] = float((per_head["retention32k"] > 0.5).double().mean())
        out.update(head_stats(prefix, "tau", per_head["tau"], (0.5, 0.9)))
        out[f"{prefix}firing"] = firing
        out[f"{prefix}boundaries"] = float(self.boundary_open.sum())
        for name in ("boundary_retention", "boundary_step_ratio"):
            if name in per_head:
                out.update(head_stats(prefix, name, per_head[name]))
        return out

    def results(self) -> dict[str, float]:
        if not self.firing:
            return {}
        heads = {name: torch.cat(values) for name, values in self.per_head.items()}
        out = self._summary("dendritic/", heads, sum(self.firing) / len(self.firing))
        for name, values in heads.items():
            if name.startswith("retention_seg"):
                out.update(head_stats("dendritic/", name, values))
        for segment, rates in self.segment_firing.items():
            out[f"dendritic/firing_seg{segment}"] = sum(rates) / len(rates)
        return {**out, **self.out}


class HippocampalProbe:
    """Accumulates the hippocampal layers' readings; `results()` gives model- and layer-level keys."""

    def __init__(
        self, boundary_tokens: torch.Tensor, train_len: int, inv_freq: torch.Tensor, has_boundaries: bool
    ) -> None:
        self.boundary_tokens, self.train_len = boundary_tokens, train_len
        self.has_boundaries = has_boundaries
        # RoPE pair i turns by inv_freq_i per token: its wavelength is 2 pi / inv_freq_i tokens.
        self.extended_pairs = (2 * math.pi / inv_freq.double()) > train_len  # (d/2,)
        self.out: dict[str, float] = {}
        self.per_head: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.scalars: dict[str, list[float]] = defaultdict(list)
        self.distance_bins: list[torch.Tensor] = []

    def add(self, layer: str, trace: HippocampalTrace) -> None:
        prefix = f"hippocampal/{layer}/"
        step = trace.clock_step.double()  # (B, Ha, T)
        per_head = {
            "clock_tau": 1.0 / (trace.rate.double() * step.mean(dim=(0, 2))),
            "write": trace.log_tag.double().exp().mean(dim=(0, 2)),
            "rope_ext_q": self._extended_energy(trace.q),
            "rope_ext_k": self._extended_energy(trace.k),
        }
        scalars = {
            "gate_firing": float(trace.gate_spikes.double().mean()),
            "ffn_gate_firing": float(trace.ffn_gate_spikes.double().mean()),
            "ffn_up_firing": float(trace.ffn_up_spikes.double().mean()),
        }
        inside = ~self.boundary_tokens
        if self.has_boundaries and inside.any():
            by_token = step.transpose(1, 2)  # (B, T, Ha)
            ratio = by_token[self.boundary_tokens].mean(0) / by_token[inside].mean(0)  # (Ha,)
            scalars["clock_boundary_step_ratio"] = float(ratio.mean())
        bins, attention_heads = self._attention(trace)
        per_head.update(attention_heads)
        for name, values in per_head.items():
            for head, value in enumerate(values.tolist()):
                self.out[f"{prefix}{name}_head{head}"] = value
            self.out.update(head_stats(prefix, name, values))
            self.per_head[name].append(values)
        for name, value in scalars.items():
            self.out[f"{prefix}{name}"] = value
            self.scalars[name].append(value)
        for k, weight in enumerate(bins.tolist()):
            self.out[f"{prefix}attn_dist_bin{k}"] = weight
        self.distance_bins.append(bins)

    def _extended_energy(self, x: torch.Tensor) -> torch.Tensor:
        """(B, Ha, T, d) -> (Ha,) share of each head's energy in the extended RoPE pairs."""
        half = x.shape[-1] // 2
        x = x.double()
        pair_energy = (x[..., :half] ** 2 + x[..., half:] ** 2).sum(dim=(0, 2))  # (Ha, d/2), NeoX pairs
        total = pair_energy.sum(dim=-1).clamp_min(torch.finfo(torch.float64).tiny)
        return pair_energy[:, self.extended_pairs.to(x.device)].sum(dim=-1) / total

    def _attention(self, trace: HippocampalTrace) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Distance bins (K + 1,) and per-head read statistics over the last train_len queries."""
        batch, heads, length, _ = trace.q.shape
        first_query = max(0, length - self.train_len)
        bins = torch.zeros(max(1, (length - 1).bit_length()) + 1, dtype=torch.float64, device=trace.q.device)
        sums = {name: torch.zeros(heads, dtype=torch.float64, device=trace.q.device)
                for name in ("attn_beyond_train", "attn_mean_log2", "attn_entropy")}  # fmt: skip
        block = max(1, ATTENTION_BLOCK_ELEMENTS // (batch * heads * length))
        keys = torch.arange(length, device=trace.q.device)
        for start in range(first_query, length, block):
            stop = min(start + block, length)
            weights = read_weights(
                trace.q[:, :, start:stop], trace.k, trace.log_tag, trace.clock, trace.rate, query_start=start
            ).double()  # (B, Ha, Tq, T)
            query_positions = torch.arange(start, stop, device=keys.device)
            distance = (query_positions.unsqueeze(-1) - keys).clamp_min(0)  # (Tq, T), 0 above the diagonal
            by_head = weights.sum(dim=0)  # (Ha, Tq, T), summed over rows
            bin_of = torch.where(distance > 0, torch.floor(torch.log2(distance.double().clamp_min(1))) + 1, 0)
            bins.index_add_(0, bin_of.long().flatten(), by_head.sum(dim=0).flatten())
            sums["attn_beyond_train"] += (by_head * (distance >= self.train_len)).sum(dim=(1, 2))
            sums["attn_mean_log2"] += (by_head * torch.log2(1.0 + distance.double())).sum(dim=(1, 2))
            sums["attn_entropy"] -= torch.special.xlogy(weights, weights).sum(dim=(0, 2, 3))
        queries = batch * (length - first_query)
        return bins / (queries * heads), {name: value / queries for name, value in sums.items()}

    def results(self) -> dict[str, float]:
        if not self.scalars:
            return {}
        out = {}
        for name, values in self.per_head.items():
            out.update(head_stats("hippocampal/", name, torch.cat(values)))
        for name, values in self.scalars.items():
            out[f"hippocampal/{name}"] = sum(values) / len(values)
        for k, weight in enumerate(torch.stack(self.distance_bins).mean(dim=0).tolist()):
            out[f"hippocampal/attn_dist_bin{k}"] = weight
        out["hippocampal/rope_ext_pairs_frac"] = float(self.extended_pairs.double().mean())
        return {**out, **self.out}


@torch.no_grad()
def model_probes(
    model: NSLM, tokens: torch.Tensor, eos_id: int, *, train_len: int | None = None
) -> dict[str, float]:
    """Every probe of `model` on the rows `tokens` (B, T) with document ends `eos_id`."""
    length = tokens.shape[1]
    train_len = length if train_len is None else train_len
    boundary_open, boundary_tokens = boundary_mask(tokens, eos_id)
    dendritic = DendriticProbe(boundary_open, boundary_tokens, train_len)
    hippocampal_layers = [layer for layer in model.layers if isinstance(layer, HippocampalLayer)]
    hippocampal = (
        HippocampalProbe(
            boundary_tokens, train_len, hippocampal_layers[0].rotary.inv_freq, bool(boundary_open.any())
        )
        if hippocampal_layers
        else None
    )
    x = model.embed(tokens)
    is_eos = tokens == model.config.eos_id
    for index, layer in enumerate(model.layers):
        x, _, trace = layer(x, is_eos, None, capture=True)
        if isinstance(trace, HippocampalTrace) and hippocampal is not None:
            hippocampal.add(model.layer_name(index), trace)
        elif isinstance(trace, DendriticTrace):
            dendritic.add(model.layer_name(index), trace)
        del trace  # one layer's trace alive at a time (long rows)
    return {**dendritic.results(), **(hippocampal.results() if hippocampal else {})}
