"""The one interface the trainer uses for every model family.

Contract (every model in `engine/models/` implements it; tests hold each model to it):

- Built from a preset plus overrides by `engine.models.build.build_model(name, overrides)`.
- `forward(tokens, targets, carry=None) -> (loss_per_token, carry)`:
  tokens and targets are int64 (B, T); a target of `IGNORE_INDEX` (-100) contributes no loss
  (its entry in loss_per_token is 0). loss_per_token is float32 (B, T): the cross-entropy of
  each target, so the trainer's update loss is `loss.sum() / (targets != IGNORE_INDEX).sum()`
  over all micro-batches of the update. `carry` is the recurrent state across consecutive
  windows of the same rows (None for the transformer and for a fresh row); the returned
  carry is detached (TBPTT). The forward is deterministic on CPU for a fixed input and state.
- `param_groups() -> list[ParamGroup]`: every trainable parameter exactly once, in a fixed
  order; matrices (and embeddings) with weight decay, norms / biases / per-neuron scalars
  without.
- `layer_of(param_name) -> str`: the bucket a parameter's gradient norm is reported under:
  `layer00`, `layer01`, ... for blocks, or a part's name (`embed`, `head`, `final_norm`).
- `flops_per_token(seq_len) -> float`: training FLOPs (forward + backward, 6N-style but
  counted analytically, attention / scans included) per target token, for MFU.
- `probes(tokens, targets, eos_id) -> dict[str, float]`: the model's validation probes on a
  batch of held-out rows, named as the spec names them without the `val_<L>/` prefix (e.g.
  `dendritic/retention_p50`, `hippocampal/clock_tau_p50`, `pssa/memory_occupancy`). Runs
  under `torch.no_grad()`; never changes parameters or state.
- `longest_context` (int): the longest row the model is meant to read (rope_max_seq_len for
  NS presets; the training chunk for models without one).
- `extra_state_dict()` / `load_extra_state_dict(d)`: non-parameter state that a checkpoint
  must carry (PSSA's memory banks); tensors only, empty dict when there is none.
- Lifecycle calls from the trainer (no-ops by default): `on_update(update)` before each update,
  `on_cycle_end(cycle)` after a data cycle's last update, `release_device_caches()` when the
  captured graphs are dropped.

Decoding (what `nsconsole sample` and `chat` use; a family has it when its class overrides
`decode`, which `decodes()` checks, and the commands refuse a model that does not):

- `logits(tokens) -> (B, T, V)`: the full forward's next-token logits of fresh rows (no carry),
  computed by the very code `forward` takes its loss from (so `token_losses(logits(x), y)`
  equals `forward(x, y)[0]` in eval mode), long rows treated as `forward` treats them (the
  transformer's independent windows, PSSA's chunks). It writes nothing (no memory writes,
  whatever the mode). float32 logits (float64 for a float64 model).
- `decode_state(batch, device) -> state`: a fresh state for `batch` rows that have seen no token,
  on `device`: what the family carries from one token to the next (the transformer: a KV cache
  per layer; PSSA: the SSM state of every block and Ouro pass; NS: compartments, somas, clocks,
  and a cache of the pool read's keys, values, write tags and key clocks). Non-parameter model
  state (PSSA's memory banks) is not copied into it: decoding reads it as it stands in the model
  and never changes it (no writes, no update clocks), so decoding leaves the model as it found it.
- `decode(tokens, state) -> (logits, state)`: int64 tokens (B, T >= 1) that follow those `state`
  has seen (a prompt's prefill: T = its length; then T = 1 per generated token) -> the next-token
  logits of every one of the T positions (dtype as `logits`) and the state after them. The state
  passed in may be updated in place or replaced: callers use only the returned one. Runs under
  `torch.no_grad()` (the caller's) and in eval mode.
- The contract the tests hold every decoder to: for any sequence S and any split of S into
  consecutive pieces, the logits of decoding the pieces one after another from `decode_state`
  equal those of one `decode` of S and those of `logits(S)`: in float64 on the CPU to 1e-9
  (not always bitwise: a matrix product over T rows and over one row may add in another order),
  and to bf16 rounding on CUDA under bf16 autocast. Each new token costs O(1) in the tokens seen
  for the recurrent families (attention over a KV cache costs O(tokens in the window)).
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import torch
from torch import nn

from engine.models.memory_budget import LOSS_CHUNK_TOKENS

CompiledT = TypeVar("CompiledT", bound=Callable[..., Any])

IGNORE_INDEX = -100


@dataclass
class ParamGroup:
    """A set of parameters that share optimizer settings."""

    name: str
    """`decay` (matrices, embeddings) or `no_decay` (norms, biases, per-neuron scalars)."""
    params: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    """(qualified name, parameter) pairs in a fixed order."""
    weight_decay: bool = True
    """Whether AdamW's decoupled weight decay applies to this group."""


_SHARED_CACHE_CLEARERS: list[Callable[[], None]] = []


def register_shared_cache(clear: Callable[[], None]) -> None:
    """A module-level cache of device tensors (e.g. attention masks per length) and how to empty it:
    `LanguageModel.release_device_caches` empties it with the models' own caches."""
    _SHARED_CACHE_CLEARERS.append(clear)


class LanguageModel(nn.Module, ABC):
    """Base class of every model family; see the module docstring for the contract."""

    longest_context: int

    @abstractmethod
    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor, carry: Any | None = None
    ) -> tuple[torch.Tensor, Any | None]:
        """(B, T) tokens and targets -> (B, T) float32 loss per token, detached carry."""

    @abstractmethod
    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per target token at this row length."""

    @abstractmethod
    def layer_of(self, param_name: str) -> str:
        """The gradient-norm bucket of a parameter (`layer03`, `embed`, `head`, ...)."""

    def on_update(self, update: int) -> None:
        """The trainer's call before each update, with the updates done so far, outside any captured
        graph. Models with a clock (PSSA's memory write rule) keep it here; the rest ignore it."""

    def on_cycle_end(self, cycle: int) -> None:
        """The trainer's call once the last update of data cycle `cycle` is done, before its kept
        checkpoint (so a resume from that checkpoint sees what it did). PSSA consolidates its fast
        adapter weights here (the article's "after each pass over the data")."""

    def release_device_caches(self) -> None:
        """Drop the tensors kept from one step to the next outside the parameters (position tables,
        masks): the trainer calls this when it drops its captured graphs, since a cached tensor made
        inside the GPU arena's pool would keep that whole pool from going back to the driver. Each
        submodule with a `clear_device_cache()` method and each `register_shared_cache` clearer is
        called; the next step rebuilds what it needs."""
        for module in self.modules():
            clear = getattr(module, "clear_device_cache", None)
            if module is not self and callable(clear):
                clear()
        for clear in _SHARED_CACHE_CLEARERS:
            clear()

    @torch.no_grad()
    def probes(self, tokens: torch.Tensor, targets: torch.Tensor, eos_id: int) -> dict[str, float]:
        """Validation probes on held-out rows; models without probes return {}."""
        return {}

    def param_groups(self) -> list[ParamGroup]:
        """Matrices and embeddings decay; 1-D tensors (norms, biases, scalars) do not."""
        decay = ParamGroup("decay", weight_decay=True)
        no_decay = ParamGroup("no_decay", weight_decay=False)
        for name, param in self.named_parameters():
            if not param.requires_grad:
                continue
            (decay if param.dim() >= 2 else no_decay).params.append((name, param))
        return [group for group in (decay, no_decay) if group.params]

    def extra_state_dict(self) -> dict[str, torch.Tensor]:
        """Non-parameter state a checkpoint carries (e.g. PSSA memory banks)."""
        return {}

    def load_extra_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what `extra_state_dict` returned."""
        if state:
            raise ValueError(f"{type(self).__name__} carries no extra state, got {sorted(state)}")

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @classmethod
    def decodes(cls) -> bool:
        """Whether this family has a stepwise decoder (its class overrides `decode`)."""
        return cls.decode is not LanguageModel.decode

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T) tokens of fresh rows -> (B, T, V) next-token logits of the full forward."""
        raise NotImplementedError(f"{type(self).__name__} has no full-forward logits path yet")

    def decode_state(self, batch: int, device: torch.device) -> Any:
        """A fresh decoding state for `batch` rows that have seen no token."""
        raise NotImplementedError(f"{type(self).__name__} has no stepwise decoder yet")

    def decode(self, tokens: torch.Tensor, state: Any) -> tuple[torch.Tensor, Any]:
        """(B, T) tokens after those `state` has seen -> (B, T, V) next-token logits, the new state."""
        raise NotImplementedError(f"{type(self).__name__} has no stepwise decoder yet")


_RECOMPUTE_OFF_CUDA: list[bool] = [False]


@contextmanager
def recompute_off_cuda(enabled: bool = True) -> Iterator[None]:
    """The models' selective recomputation (`recompute_saves_memory`) on CPU tensors too (or, with
    False, not), inside: what the memory tests and `bench/ns_memory.py` measure without a GPU."""
    previous = _RECOMPUTE_OFF_CUDA[0]
    _RECOMPUTE_OFF_CUDA[0] = enabled
    try:
        yield
    finally:
        _RECOMPUTE_OFF_CUDA[0] = previous


def recompute_saves_memory(tensor: torch.Tensor) -> bool:
    """Whether work on `tensor` should recompute its cheap intermediates in the backward instead of
    keeping them: under autograd, on CUDA (where memory bounds the rows per micro-batch and the
    recomputed elementwise work is small beside the matrix products). Not on a CPU: the CPU
    presets are small, memory is not what bounds them, and recomputing the scans there cost a
    third of ns-tiny's step (`nsconsole bench --model ns-tiny --seq-len 256 --rows 16 --device
    cpu`: 3,700 against 5,900 tokens/s)."""
    return torch.is_grad_enabled() and (tensor.is_cuda or _RECOMPUTE_OFF_CUDA[0])




def compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype a matrix product of `tensor` runs in here: autocast's where autocast is on for the
    tensor's device, else the tensor's own."""
    device = tensor.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else tensor.dtype


def linear_logits(hidden: torch.Tensor, weight: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """(..., D) hidden states, a (V, D) output matrix -> (..., V) logits `hidden @ weight.T`
    (times `scale` where given): the head every family's loss and `logits` share.

    The scale goes on the hidden states, D numbers a token rather than V (PSSA's head does the
    same): at transformer-1.5m's 8 x 64 update that is 128 K multiplications instead of 1 M, and a
    power-of-two scale (1/16 at width 256) gives the same bits either way."""
    return (hidden if scale is None else hidden * scale) @ weight.T


def chunked_token_losses(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    scale: float | None = None,
    chunk_tokens: int = LOSS_CHUNK_TOKENS,
) -> torch.Tensor:
    """`token_losses(linear_logits(hidden, weight, scale), targets)` without the logits of every
    token at once: (B, T, D) hidden states, (V, D) output matrix, (B, T) targets -> (B, T) loss.

    On CUDA (and on the CPU inside `recompute_off_cuda`) the loss is taken `chunk_tokens` tokens at
    a time by `_ChunkedLinearCrossEntropy`: each piece's logits are made, reduced to a loss and a
    log-sum-exp, and dropped; the backward makes them again a piece at a time and turns them into
    the piece's logit gradients in one fused pass. At vocab 65,536 the whole logits and their fp32
    softmax would be 384 KB a token, the largest activation of a 2B model (8 rows of 4K: 12 GiB,
    twice over with their gradient); here the hidden states, the output matrix in the products'
    dtype and one float per token are kept. The output matrix runs once more in the backward
    (about 3 % more of a 2B model's FLOPs). The loss is float32 (float64 for float64 inputs). On a
    CPU outside `recompute_off_cuda` the loss is taken in one piece by `token_losses`: the CPU
    presets are small and this is their exact reference (`forward` equals
    `token_losses(logits(x), y)` bit for bit there).
    """
    if not (hidden.is_cuda or _RECOMPUTE_OFF_CUDA[0]):
        return token_losses(linear_logits(hidden, weight, scale), targets)
    if chunk_tokens <= 0:
        raise ValueError(f"chunked_token_losses: chunk_tokens must be positive, got {chunk_tokens}")
    batch, length, width = hidden.shape
    losses = _ChunkedLinearCrossEntropy.apply(
        hidden.reshape(batch * length, width), weight, targets.reshape(batch * length), scale, chunk_tokens
    )
    return losses.view(batch, length)


def _wide(logits: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Logits in at least float32, scaled."""
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return wide if scale is None else wide * scale


def _piece_losses(
    logits: torch.Tensor, targets: torch.Tensor, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, V) logits, (n,) targets -> (n,) cross-entropy (0 where ignored) and (n,) log-sum-exp."""
    wide = _wide(logits, scale)
    lse = torch.logsumexp(wide, dim=-1)
    picked = wide.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(targets == IGNORE_INDEX, torch.zeros_like(lse), lse - picked), lse


def _piece_logit_grads(
    logits: torch.Tensor,
    lse: torch.Tensor,
    targets: torch.Tensor,
    grad_losses: torch.Tensor,
    scale: float | None,
) -> torch.Tensor:
    """d loss / d logits of a piece, in the logits' dtype: `(softmax - onehot) * grad * scale`,
    zero on ignored rows (their loss is a constant 0)."""
    wide = _wide(logits, scale)
    classes = torch.arange(wide.shape[-1], device=wide.device)
    onehot = (classes == targets.unsqueeze(-1)).to(wide.dtype)
    row_grad = torch.where(targets == IGNORE_INDEX, torch.zeros_like(grad_losses), grad_losses).to(wide.dtype)
    grads = (torch.exp(wide - lse.unsqueeze(-1)) - onehot) * row_grad.unsqueeze(-1)
    return (grads if scale is None else grads * scale).to(logits.dtype)


RECOMPILE_LIMIT = 64
"""Compilations torch._dynamo keeps per compiled function (its default is 8): see `compile_static`."""


@functools.cache
def compile_static(function: CompiledT) -> CompiledT:
    """`function` through torch.compile, the one way every family compiles (the chunked loss's
    pieces, the transformer's layers, the NS glue stages and scan). Static shapes: one compilation
    per shape and argument dtype, made at the step engine's warm-up before any CUDA-graph capture.
    Inductor's deterministic mode, where this torch has it, keeps it from choosing a kernel by
    timing it, so that a resumed line compiles the kernels the uninterrupted one did. Cached: a
    function is compiled once per process.

    The process's recompile limit is raised to RECOMPILE_LIMIT. At Dynamo's default of 8 a
    long-lived trainer reaches it (each length's own and shared micro-batch shapes, times the dtypes
    a stage is called with), and past it Dynamo decides between compiled and eager code per call:
    a function called inside a non-reentrant checkpoint could then run compiled in the forward and
    eagerly in its recomputation, which saves other tensors, and the backward fails ("Recomputed
    values ... have different metadata", seen on the GPU with torch 2.11 once a process had compiled
    an NS glue stage 8 ways). Past the raised limit a new shape runs eagerly, forward and
    recomputation alike."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
    dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 4 * RECOMPILE_LIMIT)
    options = {"deterministic": True} if hasattr(inductor_config, "deterministic") else {}
    return cast(CompiledT, torch.compile(function, dynamic=False, options=options))


def _on(device: torch.device, function: Callable[..., Any]) -> Callable[..., Any]:
    # On CUDA each piece is one fused pass over its logits (eagerly the casts, exp, subtraction and
    # products are a pass each over 2048 x 65,536 values).
    return compile_static(function) if device.type == "cuda" else function


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """(N, D) hidden, (V, D) weight, (N,) targets -> (N,) cross-entropy, a piece of tokens at a time,
    the logits recomputed in the backward (see `chunked_token_losses`). The products run in the
    dtype autocast gives them (the inputs are cast once, not once per piece); the weight's gradient
    is summed over the pieces in at least float32."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        scale: float | None,
        chunk_tokens: int,
    ) -> torch.Tensor:
        dtype = compute_dtype(hidden)
        piece_losses = _on(hidden.device, _piece_losses)
        with torch.autocast(hidden.device.type, enabled=False):
            low_hidden, low_weight = hidden.to(dtype), weight.to(dtype)
            losses, lses = [], []
            for piece, piece_targets in zip(low_hidden.split(chunk_tokens), targets.split(chunk_tokens)):
                loss, lse = piece_losses(piece @ low_weight.T, piece_targets, scale)
                losses.append(loss)
                lses.append(lse)
        ctx.save_for_backward(low_hidden, low_weight, targets, torch.cat(lses))
        ctx.scale, ctx.chunk_tokens = scale, chunk_tokens
        ctx.hidden_dtype, ctx.weight_dtype = hidden.dtype, weight.dtype
        return torch.cat(losses)

    @staticmethod
    def backward(ctx: Any, grad_losses: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        low_hidden, low_weight, targets, lse = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        logit_grads = _on(low_hidden.device, _piece_logit_grads)
        grad_hidden = torch.empty_like(low_hidden) if want_hidden else None
        grad_weight: torch.Tensor | None = None
        size = ctx.chunk_tokens
        with torch.autocast(low_hidden.device.type, enabled=False):
            for start in range(0, low_hidden.shape[0], size):
                piece = low_hidden[start : start + size]
                grads = logit_grads(piece @ low_weight.T, lse[start : start + size], targets[start : start + size],
                                    grad_losses[start : start + size], ctx.scale)  # fmt: skip
                if grad_hidden is not None:
                    torch.mm(grads, low_weight, out=grad_hidden[start : start + size])
                if want_weight:
                    part = grads.T @ piece  # (V, D)
                    if grad_weight is None:
                        grad_weight = part.to(torch.promote_types(part.dtype, torch.float32))
                    else:
                        grad_weight += part
        return (
            None if grad_hidden is None else grad_hidden.to(ctx.hidden_dtype),
            None if grad_weight is None else grad_weight.to(ctx.weight_dtype),
            None,
            None,
            None,
        )


def token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(B, T, V) logits, (B, T) targets -> (B, T) float32 cross-entropy, 0 where ignored."""
    batch, length, vocab = logits.shape
    loss = nn.functional.cross_entropy(
        logits.reshape(batch * length, vocab).float(),
        targets.reshape(batch * length),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    )
    return loss.view(batch, length)
