"""Samples at validation: a short generation from the model as it stands, on held-out prompts.

At every validation the trainer adds to the row `samples`: a list of `{"source", "prompt",
"text"}`, the prompt and what the model wrote after it (and `stopped`, why it stopped early, when
the model's logits held NaN or inf), decoded with the held-out data line's
tokenizer (the one the rows were encoded with), so a user sees what the model writes as it trains
(the console's samples tab). run.json `validation.samples` sets how many, how long and how drawn.

- The prompts are the starts of held-out rows at the training length: the sources in turn (sorted
  by name), each one's first rows first. Every validation continues the same prompts, so the
  samples of one line read as the same question answered at each update.
- The weights are the training weights after the update (not the moving average: `nsconsole
  sample --ema` samples that from a checkpoint).
- Each prompt draws from a private CPU generator seeded by `seeds.model`, the update and the
  prompt's index: the text depends on nothing else, so a resumed line writes the same samples as
  an uninterrupted one on the CPU.
- Nothing training depends on changes: the caller holds the GPU arena (eager decoding, outside
  the captured graphs, as validation runs); here the model is in eval mode under no_grad with every
  global RNG stream restored (`untouched_training_state`), and decoding never writes a model's
  non-parameter state (the decoding contract, engine.models.base).
- A family without a stepwise decoder (`decodes()` False) records no samples.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch

from datalines import DataLine
from datalines.tokenizer import PlainTextTokenizer
from engine.config.run import SAMPLES_KEY, SamplesConfig
from engine.errors import NonFiniteLogits
from engine.generation.session import DecodeSession, generation_precision
from engine.generation.settings import SamplingSettings
from engine.models.base import LanguageModel
from engine.training.validation import untouched_training_state
from engine.training.validation_losses import HeldOutRows


def sample_prompts(rows: dict[str, torch.Tensor], count: int, prompt_tokens: int) -> list[tuple[str, list[int]]]:
    """(source, prompt ids) of `count` prompts: the first `prompt_tokens` tokens of the held-out rows
    (source -> (rows, T) ids), the sources in turn by name, each one's first rows first."""
    sources = sorted(source for source in rows if rows[source].shape[0] > 0)
    prompts: list[tuple[str, list[int]]] = []
    index = 0
    while len(prompts) < count and any(index < rows[source].shape[0] for source in sources):
        for source in sources:
            if index < rows[source].shape[0] and len(prompts) < count:
                prompts.append((source, rows[source][index, :prompt_tokens].tolist()))
        index += 1
    return prompts


def sample_seed(seed: int, update: int, prompt: int) -> int:
    """The draws' seed of one prompt at one update: a digest, so that nearby seeds, updates and
    prompts give unrelated streams."""
    digest = hashlib.sha256(f"validation samples {seed} {update} {prompt}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # below 2**63: any torch seed


def continuation_text(tokenizer: PlainTextTokenizer, prompt: list[int], generated: list[int]) -> tuple[str, str]:
    """The prompt's text and what follows it. Decoded together, so a character whose bytes the
    prompt's last token and the first generated one share is whole in the continuation."""
    prompt_text = tokenizer.decode(prompt)
    whole = tokenizer.decode(prompt + generated)
    if whole.startswith(prompt_text):
        return prompt_text, whole[len(prompt_text) :]
    return prompt_text, tokenizer.decode(generated)


class ValidationSampler:
    """A line's samples at validation (see the module docstring); one per trainer."""

    def __init__(
        self,
        model: LanguageModel,
        device: torch.device,
        settings: SamplesConfig,
        seed: int,
        heldout: DataLine,
        rows: Callable[[int], HeldOutRows],
    ) -> None:
        self.model = model
        self.device = device
        self.settings = settings
        self.seed = seed
        self.heldout = heldout
        self.rows = rows
        """The held-out rows of a length (the validator's, read once)."""

    @property
    def unavailable(self) -> str | None:
        """Why samples were asked for and cannot be made (a family without a decoder); None otherwise."""
        if self.settings.prompts > 0 and not type(self.model).decodes():
            return f"{type(self.model).__name__} has no stepwise decoder yet: validations record no samples"
        return None

    def run(self, seq_len: int, update: int) -> dict[str, Any]:
        """`{"samples": [...]}` at update `update` from the held-out rows of `seq_len`; {} when off."""
        settings = self.settings
        if settings.prompts == 0 or self.unavailable is not None:
            return {}
        prompts = sample_prompts(self.rows(seq_len).rows, settings.prompts, settings.prompt_tokens)
        tokenizer = self.heldout.tokenizer
        samples = []
        with untouched_training_state(self.model, self.device), generation_precision(self.device):
            for index, (source, prompt) in enumerate(prompts):
                draws = SamplingSettings(settings.temperature, settings.top_p, sample_seed(self.seed, update, index))
                session = DecodeSession(self.model, self.device, draws)
                session.feed(prompt)
                generated: list[int] = []
                sample: dict[str, Any] = {"source": source}
                try:
                    generated.extend(session.generate(settings.new_tokens, stop=self.heldout.eos_id))
                except NonFiniteLogits as error:  # a diverged model: its rows say so, training goes on
                    sample["stopped"] = f"{error} after {len(generated)} tokens"
                sample["prompt"], sample["text"] = continuation_text(tokenizer, prompt, generated)
                samples.append(sample)
        return {SAMPLES_KEY: samples}
