"""Construct the model a preset names (imports every family's model, hence torch)."""

from __future__ import annotations

from typing import Any

from engine.models.base import LanguageModel
from engine.models.ns.model import NSLM
from engine.models.presets import family_of, preset_config
from engine.models.pssa.model import PSSALM
from engine.models.transformer.model import TransformerLM

_BUILDERS = {"ns": NSLM, "pssa": PSSALM, "transformer": TransformerLM}
"""Each family's model class, by the prefix of its preset names."""


def build_model(name: str, overrides: dict[str, Any] | None = None) -> LanguageModel:
    """Construct a preset's model (parameters initialised from the current torch RNG)."""
    config = preset_config(name, overrides)
    return _BUILDERS[family_of(name)](config)
