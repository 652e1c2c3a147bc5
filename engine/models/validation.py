"""Checks of a model config before anything is built (torch-free: `new` and `check` run them too).

Each family's dataclass has its own `validate()` for the shape rules only it knows (heads divide
the width, RoPE's even head width); this module adds what every family needs and the article's
PSSA rules, and is called wherever a preset's config becomes a model (`build_model`) or a line's
run.json is checked:

- every field has the type its default has (an int field refuses 256.5 and true; a float field
  refuses a string), and every float is finite: JSON reads `NaN` and `Infinity`, which pass a
  `<= 0` test and would train a line of NaNs;
- PSSA (the article's `validate` and `validate_loops_config`): depth in 1..32, loops in
  1..MAX_LOOPS, every size positive, tau_mem, norm_eps, tau_min and tau_max finite and positive,
  ema_alpha in [0, 1], at most mem_capacity slots read (mem_top_k).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from engine.errors import ConfigError
from engine.models.pssa.config import PSSAConfig

PSSA_MAX_DEPTH = 32
"""The article's bound on PSSA blocks (`depth must be in 1..=32`)."""
MAX_LOOPS = 16
"""The most Ouro passes a PSSA model may run. Each pass keeps its own carry (loops x depth x rows x
d x N) and its own activations, so memory grows linearly in it; the Ouro papers use up to 4 and
the article's tape sizes its loop slots the same way. 16 leaves room to try more, and stops a
typo (loops 100) before it allocates a hundredfold activations."""

KEY = "model.overrides"


def check_field_types(config: Any) -> None:
    """Every field of a config dataclass has its default's type, and every float is finite."""
    defaults = type(config)()
    for field in dataclasses.fields(config):
        value, default = getattr(config, field.name), getattr(defaults, field.name)
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise ConfigError(f"{KEY}: {field.name} must be true or false, got {value!r}")
        elif isinstance(default, int):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{KEY}: {field.name} must be an integer, got {value!r}")
        elif isinstance(default, float):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{KEY}: {field.name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ConfigError(f"{KEY}: {field.name} must be finite, got {value!r}")


def _pssa_rules(config: Any) -> None:
    if not 1 <= config.depth <= PSSA_MAX_DEPTH:
        raise ConfigError(f"{KEY}: depth must be in 1..{PSSA_MAX_DEPTH}, got {config.depth}")
    if not 1 <= config.loops <= MAX_LOOPS:
        raise ConfigError(f"{KEY}: loops must be in 1..{MAX_LOOPS}, got {config.loops}")
    for name in ("norm_eps", "tau_min", "tau_max", "tau_mem"):
        if not getattr(config, name) > 0:
            raise ConfigError(f"{KEY}: {name} must be finite and positive, got {getattr(config, name)}")
    if config.mem_top_k > config.mem_capacity:
        raise ConfigError(
            f"{KEY}: mem_top_k ({config.mem_top_k}) exceeds mem_capacity ({config.mem_capacity}): "
            "a read cannot pick more slots than a bank has"
        )


def validate_model_config(config: Any) -> None:
    """Raise ConfigError (one line, `model.overrides: <field> ...`) on a config that cannot be built."""
    check_field_types(config)
    config.validate()  # the family's own shape rules
    if isinstance(config, PSSAConfig):
        _pssa_rules(config)
