"""Errors a user can act on, raised by the data lines.

The command line prints a `DataLineError` as one line naming the file and the problem and exits
with status 2; nothing already written (cycles, manifests, the recipe) is touched by a failure.
"""

from __future__ import annotations


class DataLineError(Exception):
    """A data line, source, recipe, tokenizer or shard is missing, malformed or inconsistent."""


class ManifestDamaged(DataLineError):
    """A cycle's permanent manifest is unreadable or not a manifest (truncated, garbled): `problem`
    says what is wrong with the file; the message adds how to recover it."""

    def __init__(self, problem: str, remedy: str) -> None:
        super().__init__(f"{problem}; {remedy}")
        self.problem = problem
        self.remedy = remedy


class InputChanged(DataLineError):
    """A file the data line pinned or wrote at init (a source file, its tokenizer, dataline.json)
    changed, is gone or no longer parses: nothing is prepared from it until it is restored, so a
    preparer that meets it stops rather than retries. `fix` says how to restore it (one clause)."""

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(message)
        self.fix = fix


class SourceUnavailable(DataLineError):
    """A source could not be read for a reason that may pass (the hub down, a dropped or garbled
    download): the preparer retries it with backoff, the same cycle with the same files; a command
    (init, val, rebuild) says it in one line like any other `DataLineError`."""


class SourceExhausted(DataLineError):
    """A source has no untrained documents left (max epochs 1: never a silent second pass)."""


class ShardChanged(DataLineError):
    """A shard of an open cycle changed on disk after it was verified (overwritten in place, or
    replaced): samples read from it may not be the manifest's, so none of them may be trained on."""
