"""Model presets: a name -> config registry, without torch (run.json is checked by light tools).

Each family defines `PRESETS: dict[str, <Family>Config]` in a torch-free module (config
dataclasses whose fields may be overridden by name from run.json's `model.overrides`);
`engine.models.build.build_model` constructs the model a preset names. This module only gathers
the presets.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.errors import ConfigError
from engine.models.ns import presets as ns
from engine.models.pssa import config as pssa
from engine.models.transformer import config as transformer


def _families() -> dict[str, dict[str, Any]]:
    return {"transformer": transformer.PRESETS, "pssa": pssa.PRESETS, "ns": ns.PRESETS}


def family_of(name: str) -> str:
    """The family (`ns`, `pssa`, `transformer`) of a preset."""
    for family, presets in _families().items():
        if name in presets:
            return family
    raise ConfigError(f"model.preset: unknown preset {name!r} (known: {', '.join(preset_names())})")


def preset_names() -> list[str]:
    return sorted(name for presets in _families().values() for name in presets)


def preset_config(name: str, overrides: dict[str, Any] | None = None) -> Any:
    """The config dataclass of a preset with overrides applied (unknown keys refused)."""
    for presets in _families().values():
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
