"""A decoding session: a model's decoding state carried from call to call, and the draws.

The session feeds tokens through `LanguageModel.decode` and keeps the logits of the last position
fed; each generated token is fed with the next call that needs it (the next draw, or the next
`feed`), so a session never decodes a token nobody asks about. Over several calls (a chat's
turns) the state runs on: the logits after the last token equal those of one decode of
everything fed so far.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch

from engine.generation.sampling import choose_token
from engine.generation.settings import SamplingSettings
from engine.models.base import LanguageModel


def generation_precision(device: torch.device) -> AbstractContextManager[object]:
    """bf16 autocast on CUDA (as training computes), none on the CPU. Unlike the training step's
    autocast this one keeps its cast cache: the weights do not change while a command generates,
    so entered once around the whole generation they are cast to bf16 once, not every token."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


PREFILL_TOKENS = 1024
"""The longest piece of a prompt one decode reads. Fed whole, a long prompt's memory grows with the
square of its length (NS's pool read is a (tokens x tokens) matrix per head: 9 GB for a prompt of
15,000 tokens to ns-tiny, 1 GB in pieces of 1,024, and faster) and its logits, one row of the
vocabulary per token, with its length (8.6 GB for 32,768 tokens of ns-2b)."""


class DecodeSession:
    """One row of decoding on a model (see the module docstring)."""

    def __init__(
        self, model: LanguageModel, device: torch.device, settings: SamplingSettings,
        between_steps: Callable[[], None] | None = None,
    ) -> None:
        self.model = model
        self.device = device
        self.settings = settings
        self.between_steps = between_steps
        """Called before each decode: a command's `GenerationModel.share_cpu` (a trainer's samples
        share the cores through the trainer's own seat)."""
        self.state = model.decode_state(1, device)
        self.generator = torch.Generator().manual_seed(settings.seed)
        self.fed: list[int] = []
        """Tokens the state has seen, in order."""
        self.pending: list[int] = []
        """Generated tokens not fed yet (fed first by the next call that needs the state)."""
        self.next_logits: torch.Tensor | None = None
        """(V,) logits after the last token fed: what the next token is drawn from."""

    @property
    def tokens(self) -> list[int]:
        """Every token of the session so far, the generated ones included."""
        return self.fed + self.pending

    def feed(self, token_ids: Sequence[int]) -> None:
        """Decode the pending tokens and then `token_ids`: a prompt as a prefill, in pieces of at
        most PREFILL_TOKENS (same logits for any split: the decode contract in engine/models/base.py)."""
        ids = self.pending + list(token_ids)
        self.pending = []
        for start in range(0, len(ids), PREFILL_TOKENS):
            piece = ids[start : start + PREFILL_TOKENS]
            if self.between_steps is not None:
                self.between_steps()
            tokens = torch.tensor([piece], dtype=torch.long, device=self.device)
            with torch.no_grad():
                logits, self.state = self.model.decode(tokens, self.state)
            self.fed += piece
            self.next_logits = logits[0, -1]

    def generate(self, count: int, stop: int | None = None) -> Iterator[int]:
        """Draw up to `count` tokens one at a time, ending after `stop` when it is drawn."""
        for _ in range(count):
            self.feed([])
            if self.next_logits is None:
                raise ValueError("a session generates after a prompt: feed at least one token first")
            token = choose_token(self.next_logits, self.settings, self.generator)
            self.pending.append(token)
            yield token
            if token == stop:
                return
