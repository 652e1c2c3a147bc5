"""The transformer baseline: a pre-norm GPT with causal SDPA attention.

Two shapes share this module. `transformer-1.5m` is the PSSA article's peer exactly (fixed
sinusoidal positions added to the embedding, RMSNorms with scale and offset, a two-matrix SiLU
FFN, no final norm, untied embedding and head, logits scaled by 1/sqrt(width)); the large presets
are Llama-style (RMSNorm without offset, RoPE, SwiGLU, a final norm), parameter-matched to the
NS presets of the same size.

Rows longer than `context_len` are cut into independent windows of that length: attention is
causal within a window and nothing is carried across (the article's peer trained that way).

Speed on CUDA (the large presets are the yardstick of the NS models, so they must be as fast as a
plain compiled GPT: `bench/gpu_peers.py`): each layer's training forward runs through
`torch.compile` (`compile_layers`; the RoPE tables are computed outside and passed in, so the
identical layers share one compiled graph), and the loss is taken by `chunked_token_losses`, which
never holds the (tokens, 65,536) logits of the whole micro-batch. On a CPU both stay eager and
whole: the small presets' exact reference.

Decoding keeps a KV cache per layer (`KVCache`) and adds each new token's position at the
cache's offset (sinusoidal table row or RoPE angle). It follows the windows as training cut them:
when a window is full the caches are dropped and the next token opens a new window at position 0,
so generation past `context_len` sees what training saw at every position (the decoder's logits
equal the full forward's over the same tokens, windows included).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from engine.models.base import (
    LanguageModel,
    chunked_token_losses,
    compile_static,
    compute_dtype,
    linear_logits,
)
from engine.models.common import RMSNorm, RotaryEmbedding, SwiGLU, apply_rotary, sinusoidal_positions
from engine.models.transformer.config import TransformerConfig


class FeedForward(nn.Module):
    """`W2 silu(W1 x)` without biases (the article's peer: two matrices, no gate)."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.up(x)))


Rope = tuple[torch.Tensor, torch.Tensor]
"""The (T, head_dim) cos and sin tables of a window's positions (`RotaryEmbedding.tables`)."""


class KVCache:
    """One layer's keys and values of the tokens of the current window, (B, H, length, hd) each.

    The buffers double when full (never past the window), so a decoded token writes its key and
    value in place instead of copying the whole cache; they take the dtype of the first keys
    (bf16 under autocast).
    """

    def __init__(self, window: int) -> None:
        self.window = window
        self.length = 0
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add (B, H, T, hd) keys and values; returns every cached key and value, these included."""
        end = self.length + keys.shape[2]
        if end > self.window:
            raise ValueError(f"KV cache: {end} tokens do not fit a window of {self.window}")
        if self._keys is None or self._values is None or end > self._keys.shape[2]:
            capacity = min(self.window, max(end, 2 * self.length))
            grown_keys = keys.new_empty(*keys.shape[:2], capacity, keys.shape[3])
            grown_values = values.new_empty(*values.shape[:2], capacity, values.shape[3])
            if self._keys is not None and self._values is not None:
                grown_keys[:, :, : self.length] = self._keys[:, :, : self.length]
                grown_values[:, :, : self.length] = self._values[:, :, : self.length]
            self._keys, self._values = grown_keys, grown_values
        self._keys[:, :, self.length : end] = keys
        self._values[:, :, self.length : end] = values
        self.length = end
        return self._keys[:, :, :end], self._values[:, :, :end]


def _mask_after(cached: int, length: int, device: torch.device) -> torch.Tensor | None:
    """Which of `cached + length` keys each of `length` new queries may read (None: all of them)."""
    if length == 1:
        return None
    return torch.ones(length, cached + length, dtype=torch.bool, device=device).tril(diagonal=cached)


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention through `scaled_dot_product_attention`, no biases."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.head_dim = config.width // config.heads
        self.qkv = nn.Linear(config.width, 3 * config.width, bias=False)
        self.out = nn.Linear(config.width, config.width, bias=False)

    def forward(
        self, x: torch.Tensor, rope: Rope | None = None, cache: KVCache | None = None
    ) -> torch.Tensor:
        """(B, T, d) -> (B, T, d); `rope`: the (T, hd) cos and sin tables of the tokens' positions
        (None: no rotation); with a cache, x follows the cached tokens and joins them."""
        batch, length, width = x.shape
        qkv = self.qkv(x).view(batch, length, 3, self.heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (B, H, T, hd)
        cached = 0 if cache is None else cache.length
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if cache is None or cached == 0:
            if cache is not None:
                cache.append(k, v)
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, hd)
        else:
            keys, values = cache.append(k, v)  # (B, H, cached + T, hd)
            mask = _mask_after(cached, length, x.device)
            attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return self.out(attended.transpose(1, 2).reshape(batch, length, width))


class TransformerLayer(nn.Module):
    """Pre-norm residual layer: `x + attn(norm(x))`, then `x + ffn(norm(x))`."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.width, offset=config.norm_offset)
        self.attn = CausalSelfAttention(config)
        self.ffn_norm = RMSNorm(config.width, offset=config.norm_offset)
        self.ffn: nn.Module = (
            SwiGLU(config.width, config.ffn_hidden)
            if config.swiglu
            else FeedForward(config.width, config.ffn_hidden)
        )

    def forward(
        self, x: torch.Tensor, rope: Rope | None = None, cache: KVCache | None = None
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope, cache)
        return x + self.ffn(self.ffn_norm(x))


def _run_layer(layer: TransformerLayer, x: torch.Tensor, rope: Rope | None) -> torch.Tensor:
    return layer(x, rope)


def _compiled_layer() -> Callable[[TransformerLayer, torch.Tensor, Rope | None], torch.Tensor]:
    """`_run_layer` through `compile_static`. The layer is an argument, not the compiled object, so
    torch._dynamo traces its parameters as inputs and every layer of the same shape reuses one
    graph (forward and backward)."""
    return compile_static(_run_layer)


@dataclass
class TransformerDecodeState:
    """The decoder's state: the current window's KV cache of every layer."""

    caches: list[KVCache]
    """One cache per layer, all holding the same tokens."""

    @property
    def window_tokens(self) -> int:
        """Tokens of the current window seen so far."""
        return self.caches[0].length


class TransformerLM(LanguageModel):
    """Token embedding, `depth` pre-norm layers, optional final norm, output head."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        self.longest_context = config.context_len
        self.embed = nn.Embedding(config.vocab_size, config.width)
        self.rotary = RotaryEmbedding(config.width // config.heads, config.rope_base) if config.rope else None
        self.layers = nn.ModuleList(TransformerLayer(config) for _ in range(config.depth))
        self.final_norm = RMSNorm(config.width, offset=config.norm_offset) if config.final_norm else None
        self.head = None if config.tie_embeddings else nn.Linear(config.width, config.vocab_size, bias=False)
        if not config.rope:
            table = sinusoidal_positions(config.context_len, config.width, config.rope_base)
            self.register_buffer("positions", table, persistent=False)  # (context_len, d)
        self._initialise()

    def _initialise(self) -> None:
        std = self.config.init_std
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
        # GPT-2: the projections that write into the residual stream are scaled down by the
        # number of such writes, so the stream's variance does not grow with depth.
        residual_std = std / math.sqrt(2 * self.config.depth)
        for layer in self.layers:
            nn.init.normal_(layer.attn.out.weight, mean=0.0, std=residual_std)
            nn.init.normal_(layer.ffn.down.weight, mean=0.0, std=residual_std)

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor, carry: Any | None = None
    ) -> tuple[torch.Tensor, None]:
        if carry is not None:
            raise ValueError("the transformer carries no state across windows; pass carry=None")
        return chunked_token_losses(
            self.hidden(tokens), self._head_weight(), targets, self._logit_scale()
        ), None

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T) tokens -> (B, T, V) logits; rows longer than context_len as independent windows."""
        return self._head_logits(self.hidden(tokens))

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T) tokens -> (B, T, d) last hidden states (after the final norm, if any), rows longer
        than context_len as independent windows."""
        batch, length = tokens.shape
        window = self.config.context_len
        if length <= window:
            return self._window_hidden(tokens)
        # Independent windows: fold them into the batch dimension (rows stay in order).
        pad = (-length) % window
        windows = (length + pad) // window
        folded = self._window_hidden(F.pad(tokens, (0, pad), value=0).view(batch * windows, window))
        return folded.view(batch, windows * window, -1)[:, :length]

    def _window_hidden(self, tokens: torch.Tensor, caches: list[KVCache] | None = None) -> torch.Tensor:
        """(B, T) tokens of one window -> (B, T, d) last hidden states; with caches, the tokens
        follow theirs."""
        cached = 0 if caches is None else caches[0].length
        length = tokens.shape[1]
        x = self.embed(tokens)  # (B, T, d)
        rope: Rope | None = None
        if self.rotary is not None:
            # q and k come out of a projection: the tables in the dtype it runs in (bf16 under autocast).
            rope = self.rotary.tables(length, cached, x.device, compute_dtype(x))
        else:
            x = x + self.positions[cached : cached + length].to(x.dtype)
        if caches is not None:
            for layer, cache in zip(self.layers, caches, strict=True):
                x = layer(x, rope, cache)
        else:
            compiled = self.config.compile_layers and x.is_cuda and torch.is_grad_enabled()
            run = _compiled_layer() if compiled else _run_layer
            for layer in self.layers:
                x = run(layer, x, rope)
        return x if self.final_norm is None else self.final_norm(x)

    def _head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.head is None else self.head.weight

    def _logit_scale(self) -> float | None:
        return 1.0 / math.sqrt(self.config.width) if self.config.scale_logits else None

    def _head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., d) last hidden states -> (..., V) logits, at least float32."""
        logits = linear_logits(hidden, self._head_weight(), self._logit_scale())
        return logits.to(torch.promote_types(logits.dtype, torch.float32))

    def decode_state(self, batch: int, device: torch.device) -> TransformerDecodeState:
        """Empty caches (allocated by the first tokens, on their device and in their dtype)."""
        return TransformerDecodeState([KVCache(self.config.context_len) for _ in self.layers])

    def decode(
        self, tokens: torch.Tensor, state: TransformerDecodeState
    ) -> tuple[torch.Tensor, TransformerDecodeState]:
        """The tokens through the caches, a new window opened wherever one fills (module docstring)."""
        window = self.config.context_len
        pieces = []
        start = 0
        while start < tokens.shape[1]:
            if state.window_tokens == window:
                state = self.decode_state(tokens.shape[0], tokens.device)
            end = start + min(window - state.window_tokens, tokens.shape[1] - start)
            pieces.append(self._head_logits(self._window_hidden(tokens[:, start:end], state.caches)))
            start = end
        return torch.cat(pieces, dim=1), state

    def layer_of(self, param_name: str) -> str:
        parts = param_name.split(".")
        if parts[0] == "layers":
            return f"layer{int(parts[1]):02d}"
        return parts[0]

    def flops_per_token(self, seq_len: int) -> float:
        """6 FLOPs per matrix weight (the embedding lookup is free) plus causal attention scores."""
        config = self.config
        window = min(seq_len, config.context_len)
        ffn_matrices = 3 if config.swiglu else 2
        per_layer = 4 * config.width**2 + ffn_matrices * config.width * config.ffn_hidden
        matrix_weights = config.depth * per_layer + config.vocab_size * config.width
        # QK^T and AV: 2 * 2 * width FLOPs per attended key in the forward pass, three times that
        # for forward + backward; a causal window's query attends (window + 1) / 2 keys on average.
        attention = 12 * config.depth * config.width * (window + 1) / 2
        return 6.0 * matrix_weights + attention
