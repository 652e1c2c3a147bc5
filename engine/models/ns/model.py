"""NS: a NeuronSpark-style spiking state-space language model.

Token embedding -> layers -> RMSNorm -> the embedding's transpose (tied) -> logits. Most layers
are dendritic (`ns_dendritic`: a selective SSM of compartments per head feeding PLIF somas);
every `hippocampal_every`-th layer is hippocampal (`ns_hippocampal`: a pool read with clocks and
write tags, then a spiking feed-forward block). Every layer's update is centred over the width
before it joins the residual stream.

Across consecutive windows of the same rows the carry holds, per layer, the dendritic
compartments and soma membranes, or the hippocampal pool clocks and neuron membranes: a flat
dict `layerNN.<name>` -> float32 tensor, detached (TBPTT). The pool read itself is within the
window. The trainer carries nothing: every row is one window, read whole.

Decoding (`decode`) carries that recurrent state from token to token, and for each hippocampal
layer a `PoolCache` of the tokens seen. A prompt's prefill runs the training path (the chunked
scan, the PLIF scans) over its tokens; one token steps the recurrences (`recurrent_step`; a PLIF
scan of one step), so a token costs O(1) in the tokens seen in the dendritic layers and the
neurons, and O(tokens seen) in the pool reads (attention over a cache). As the forward reads a
long row whole, the decoder never resets: past `longest_context` its positions run on (RoPE
beyond the trained lengths, as the forward of such a row applies it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from engine.models.base import LanguageModel, chunked_token_losses
from engine.models.common import RMSNorm
from engine.models.ns.config import NSConfig
from engine.models.ns.dendritic import DendriticLayer
from engine.models.ns.hippocampal import HippocampalLayer
from engine.models.ns.neurons import at_least_fp32
from engine.models.ns.pool_read import PoolCache
from engine.models.ns.presets import recomputed_layers
from engine.models.ns.probes import model_probes


@dataclass
class NSDecodeState:
    """What the NS decoder carries from one token to the next."""

    carry: dict[str, torch.Tensor] | None
    """The recurrent state, in `forward`'s carry layout (compartments, somas, pool clocks, neuron
    membranes); None before the first token."""
    pools: dict[int, PoolCache]
    """Each hippocampal layer's pool cache, by layer index."""


class NSLM(LanguageModel):
    """The NS model of a config (see the module docstring)."""

    def __init__(self, config: NSConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        self.longest_context = config.rope_max_seq_len
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(
            HippocampalLayer(config) if config.is_hippocampal(index) else DendriticLayer(config)
            for index in range(config.n_layers)
        )
        self.final_norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self._recompute = "none"
        self._recomputed: frozenset[int] = frozenset()
        self._initialise()

    @property
    def recompute(self) -> str:
        """Which layers recompute their activations in the backward (torch.utils.checkpoint,
        non-reentrant): "none", "all", "dendritic", "hippocampal" or a kind's first K layers,
        e.g. "dendritic:18" (`recomputed_layers`). Set by the trainer."""
        return self._recompute

    @recompute.setter
    def recompute(self, value: str) -> None:
        self._recomputed = recomputed_layers(value, self.config)
        self._recompute = value
        for index, layer in enumerate(self.layers):
            layer.recompute_parts = index not in self._recomputed

    def _initialise(self) -> None:
        std = self.config.init_std
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        # GPT-2: the maps that write into the residual stream shrink with the number of writes
        # (one per dendritic layer, two per hippocampal layer), so the stream's variance does
        # not grow with depth.
        writes = sum(2 if isinstance(layer, HippocampalLayer) else 1 for layer in self.layers)
        residual_std = std / math.sqrt(writes)
        for layer in self.layers:
            if isinstance(layer, HippocampalLayer):
                for linear in (layer.out_proj, layer.ffn_down, layer.ffn_skip):
                    nn.init.normal_(linear.weight, mean=0.0, std=residual_std)
                layer.reset_parameters()
            else:
                nn.init.normal_(layer.out_proj.weight, mean=0.0, std=residual_std)

    @staticmethod
    def layer_name(index: int) -> str:
        return f"layer{index:02d}"

    def layer_state(
        self, carry: dict[str, torch.Tensor] | None, index: int
    ) -> dict[str, torch.Tensor] | None:
        """Layer `index`'s part of a carry (None for a fresh row)."""
        if carry is None:
            return None
        prefix = self.layer_name(index)
        names = self.layers[index].state_names
        missing = [name for name in names if f"{prefix}.{name}" not in carry]
        if missing:
            raise ValueError(f"NS carry lacks {prefix}.{missing[0]} (was it made by another model?)")
        return {name: carry[f"{prefix}.{name}"] for name in names}

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor, carry: dict[str, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(B, T) tokens and targets -> (B, T) float32 loss per token and the detached carry."""
        x, new_carry = self.hidden(tokens, carry)
        return self.losses_from_hidden(x, targets), new_carry

    def losses_from_hidden(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """(B, T, D) last hidden states, (B, T) targets -> (B, T) float32 cross-entropy, the logits
        made and dropped a chunk at a time (`chunked_token_losses`): `logits_from_hidden`'s head."""
        return chunked_token_losses(self.final_norm(x), self.embed.weight, targets)

    def hidden(
        self,
        tokens: torch.Tensor,
        carry: dict[str, torch.Tensor] | None = None,
        pools: dict[int, PoolCache] | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(B, T) tokens -> (B, T, D) last hidden states and the detached carry. With `pools`
        (decoding), the hippocampal layers read over their caches, which the tokens join."""
        x = self.embed(tokens)  # (B, T, D)
        is_eos = tokens == self.config.eos_id  # (B, T)
        new_carry: dict[str, torch.Tensor] = {}
        for index, layer in enumerate(self.layers):
            state = self.layer_state(carry, index)
            if pools is not None and index in pools:
                x, layer_state, _ = layer(x, is_eos, state, pool=pools[index])
            elif index in self._recomputed and torch.is_grad_enabled():
                x, layer_state, _ = checkpoint(layer, x, is_eos, state, use_reentrant=False)
            else:
                x, layer_state, _ = layer(x, is_eos, state)
            prefix = self.layer_name(index)
            new_carry.update({f"{prefix}.{name}": value.detach() for name, value in layer_state.items()})
        return x, new_carry

    def logits_from_hidden(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, D) last hidden states -> (B, T, V) logits through the tied embedding."""
        return self.final_norm(x) @ self.embed.weight.T

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T) tokens of fresh rows -> (B, T, V) logits, float32 (float64 for a float64 model):
        the hidden states and head `forward` takes its loss from."""
        x, _ = self.hidden(tokens)
        return at_least_fp32(self.logits_from_hidden(x))

    def decode_state(self, batch: int, device: torch.device) -> NSDecodeState:
        """No recurrent state yet (zeros, as a fresh row) and empty pools (allocated by the first
        tokens, on their device and in their dtype)."""
        hippocampal = (
            index for index, layer in enumerate(self.layers) if isinstance(layer, HippocampalLayer)
        )
        return NSDecodeState(carry=None, pools={index: PoolCache() for index in hippocampal})

    def decode(self, tokens: torch.Tensor, state: NSDecodeState) -> tuple[torch.Tensor, NSDecodeState]:
        """The tokens after those `state` has seen: their logits and the state after them (module
        docstring: a prefill runs the chunked scans, one token steps the recurrences)."""
        x, carry = self.hidden(tokens, state.carry, state.pools)
        return at_least_fp32(self.logits_from_hidden(x)), NSDecodeState(carry=carry, pools=state.pools)

    def layer_of(self, param_name: str) -> str:
        parts = param_name.split(".")
        if parts[0] == "layers":
            return self.layer_name(int(parts[1]))
        return parts[0]

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 3 x the forward's (matrix maps, the chunked scan, the pool reads)."""
        config = self.config
        dendritic = sum(isinstance(layer, DendriticLayer) for layer in self.layers)
        hippocampal = config.n_layers - dendritic
        matrix_weights = sum(
            module.weight.numel() for module in self.modules() if isinstance(module, nn.Linear)
        ) + config.vocab_size * config.d_model  # the tied output head is a matrix product too
        forward = 2.0 * matrix_weights
        forward += dendritic * _chunked_scan_flops(config, seq_len)
        # q.k and w.v: 2 * 2 * width FLOPs per attended key; a causal row's query sees (T + 1) / 2.
        forward += hippocampal * 4.0 * config.attn_width * (seq_len + 1) / 2
        return 3.0 * forward

    @torch.no_grad()
    def probes(
        self, tokens: torch.Tensor, targets: torch.Tensor, eos_id: int, *, train_len: int | None = None
    ) -> dict[str, float]:
        """Dendritic and hippocampal probes on held-out rows (see `ns_probes`).

        train_len: the training row length (default: these rows' length), for the probes that
        compare against it (rope_ext_*, attn_beyond_train_*, the long-row segments).
        """
        return model_probes(self, tokens, eos_id, train_len=train_len)


def _chunked_scan_flops(config: NSConfig, seq_len: int) -> float:
    """Forward FLOPs per token of one dendritic layer's chunked scan (its matrix products)."""
    L, N, P = config.chunk_len, config.dendritic_state, config.dendritic_head_dim
    H, G = config.dendritic_heads, config.dendritic_groups
    chunks = math.ceil(seq_len / L)
    per_token = (
        2 * L * N * G  # C B^T within a chunk: L x L x N per chunk and group
        + 2 * L * P * H  # the decay-weighted (L x L) mixing applied to the chunk's inputs
        + 2 * N * P * H  # the chunk's contribution to its end state
        + 2 * N * P * H  # the entering state read through C
    )
    between_chunks = 2 * (chunks + 1) ** 2 * N * P * H / (chunks * L)  # state passing, per token
    return float(per_token + between_chunks)


