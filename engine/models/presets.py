"""Model presets: a name -> (family builder, config) registry.

Each family module defines `PRESETS: dict[str, <Family>Config]` (config dataclasses whose
fields may be overridden by name from run.json's `model.overrides`) and a model class whose
constructor takes that config. This module only gathers them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from engine.errors import ConfigError
from engine.models.base import LanguageModel


def _families() -> dict[str, tuple[dict[str, Any], Callable[[Any], LanguageModel]]]:
    from engine.models import transformer
    from engine.models.ns import model as ns
    from engine.models.pssa import model as pssa

    return {
        "transformer": (transformer.PRESETS, transformer.TransformerLM),
        "pssa": (pssa.PRESETS, pssa.PSSALM),
        "ns": (ns.PRESETS, ns.NSLM),
    }


def preset_names() -> list[str]:
    return sorted(name for presets, _ in _families().values() for name in presets)


def preset_config(name: str, overrides: dict[str, Any] | None = None) -> Any:
    """The config dataclass of a preset with overrides applied (unknown keys refused)."""
    for presets, _builder in _families().values():
        if name in presets:
            base = presets[name]
            fields = {f.name for f in dataclasses.fields(base)}
            unknown = sorted(set(overrides or {}) - fields)
            if unknown:
                raise ConfigError(
                    f"model.overrides: unknown key {unknown[0]!r} for preset {name!r} "
                    f"(known: {', '.join(sorted(fields))})"
                )
            return dataclasses.replace(base, **(overrides or {}))
    raise ConfigError(f"model.preset: unknown preset {name!r} (known: {', '.join(preset_names())})")


def build_model(name: str, overrides: dict[str, Any] | None = None) -> LanguageModel:
    """Construct a preset's model (parameters initialised from the current torch RNG)."""
    config = preset_config(name, overrides)
    for presets, builder in _families().values():
        if name in presets:
            return builder(config)
    raise AssertionError("unreachable")
