"""The held-out row lengths `nsconsole data val` builds: those a training line validates at, or the
defaults a line gets from `nsconsole new` -- the training length 4096 and, for the long-row probe,
the longest context of the presets (32768: the full-size models'). Torch-free: the model's
longest context is read from its preset, not from a model built to ask it.
"""

from __future__ import annotations

from pathlib import Path

from engine.config.run import RunConfig
from engine.models import presets
from engine.ops.lines import open_line
from engine.training.heldout_rows import validation_lengths

LONGEST_CONTEXT_FIELDS = ("rope_max_seq_len", "context_len", "chunk_len")
"""The preset fields each family's model takes its `longest_context` from (NS, transformer, PSSA)."""


def preset_longest_context(preset: str, overrides: dict | None = None) -> int | None:
    """The longest row a preset's model is meant to read; None when its config names none."""
    config = presets.preset_config(preset, overrides)
    for name in LONGEST_CONTEXT_FIELDS:
        if hasattr(config, name):
            return int(getattr(config, name))
    return None


def default_long_seq_len() -> int:
    """The longest context of any preset: the long rows every preset's probe can read."""
    return max(preset_longest_context(name) or 0 for name in presets.preset_names())


def line_lengths(line: Path | str) -> list[int]:
    """Every row length the training line's validation reads (its stages' and their long lengths)."""
    config = RunConfig.load(open_line(line).run_json)
    longest = preset_longest_context(config.model.preset, config.model.overrides) or 0
    return validation_lengths(config, longest)
