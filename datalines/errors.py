"""Errors a user can act on, raised by the data lines.

The command line prints a `DataLineError` as one line naming the file and the problem and exits
with status 2; nothing already written (cycles, manifests, the recipe) is touched by a failure.
"""

from __future__ import annotations


class DataLineError(Exception):
    """A data line, source, recipe, tokenizer or shard is missing, malformed or inconsistent."""


class SourceExhausted(DataLineError):
    """A source has no untrained documents left (max epochs 1: never a silent second pass)."""


class ShardChanged(DataLineError):
    """A shard of an open cycle changed on disk after it was verified (overwritten in place, or
    replaced): samples read from it may not be the manifest's, so none of them may be trained on."""
