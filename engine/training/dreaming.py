"""The trainer's dreaming phase (run.json `dreaming`, PSSA lines only).

After every `every_updates`-th update the trainer lets the model rehearse (engine.models.pssa.dream):
the cached high-loss chunks, sequences it dreams from its memory values, or both, with guarded SGD
steps on the output-head rows. The guard's fresh task is the update's own latest data: the first
chunk of its last row, which the model read from a fresh row's zero carry, the same live carry
every rehearsed sequence starts from.

Everything a dream reads is in a checkpoint (the weights, the memory banks, the dreaming cache) or
derived from the update (its rows, its number): the dreamt tokens are drawn from a CPU generator
seeded by `seeds.model` and the update. So a line resumed across a dream dreams the same dream,
and on the CPU it reproduces the uninterrupted line bit for bit.

The outcome goes into the update's row: `dream/sequences`, `dream/generated_tokens`,
`dream/steps`, `dream/kept` and the fresh task's `dream/fresh_loss_before` and `_after` (after is
never above before by more than 1e-6).
"""

from __future__ import annotations

import hashlib

import torch

from engine.config.run import DreamingConfig, RunConfig
from engine.models.base import LanguageModel
from engine.models.pssa.dream import DreamSources, dream
from engine.models.pssa.model import PSSALM

MODE_SOURCES = {"memory": (True, False), "generate": (False, True), "both": (True, True)}
"""`dreaming.mode` -> (rehearse the cached chunks, rehearse sequences dreamt from memory values)."""


def dream_seed(seed: int, update: int) -> int:
    """The dreamt tokens' seed at one update: a digest, so that nearby seeds and updates draw
    unrelated tokens."""
    digest = hashlib.sha256(f"dreaming {seed} {update}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # below 2**63: any torch seed


class Dreamer:
    """Runs a PSSA line's dreams (see the module docstring)."""

    def __init__(self, settings: DreamingConfig, model: PSSALM, seed: int) -> None:
        cached, generated = MODE_SOURCES[settings.mode]
        self.settings = settings
        self.model = model
        self.seed = seed
        self.sources = DreamSources(
            sequences=settings.sequences,
            cached=cached,
            generated=generated,
            repeats=settings.repeats,
            length=settings.length,
            temperature=settings.temperature,
        )

    @classmethod
    def for_line(cls, config: RunConfig, model: LanguageModel) -> Dreamer | None:
        """The line's dreamer; None when run.json sets no `dreaming`."""
        if config.dreaming is None:
            return None
        assert isinstance(model, PSSALM), "run.json's checks allow dreaming on pssa-* presets only"
        return cls(config.dreaming, model, config.seeds.model)

    def due(self, update: int) -> bool:
        """Whether the update just done (`update` counted from 1) is followed by a dream."""
        return update % self.settings.every_updates == 0

    def run(self, windows: torch.Tensor, update: int) -> dict[str, float]:
        """Dream after update `update`, whose (rows, seq_len + 1) windows it trained; the row's
        `dream/...` fields."""
        fresh = windows[-1]
        length = min(self.model.config.chunk_len, fresh.shape[0] - 1)
        generator = torch.Generator().manual_seed(dream_seed(self.seed, update))
        report = dream(
            self.model,
            fresh[:length],
            fresh[1 : length + 1],
            lr=self.settings.lr,
            steps=self.settings.steps,
            sources=self.sources,
            generator=generator,
        )
        return {
            "dream/sequences": report.sequences,
            "dream/generated_tokens": report.generated_tokens,
            "dream/steps": report.steps_tried,
            "dream/kept": report.steps_kept,
            "dream/fresh_loss_before": report.fresh_loss_before,
            "dream/fresh_loss_after": report.fresh_loss_after,
        }


def format_dream(update: int, fields: dict[str, float]) -> str:
    """The run.log line of a dream (`Dreamer.run`'s row fields): what it rehearsed, the steps its
    guard kept, and the fresh task's loss before and after (never higher by more than 1e-6)."""
    return (
        f"dream after update {update}: {fields['dream/sequences']:g} sequences, "
        f"{fields['dream/generated_tokens']:g} tokens generated, {fields['dream/kept']:g} of "
        f"{fields['dream/steps']:g} steps kept, fresh loss {fields['dream/fresh_loss_before']:.6f} -> "
        f"{fields['dream/fresh_loss_after']:.6f}"
    )
