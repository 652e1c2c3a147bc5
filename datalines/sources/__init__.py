"""Sources of documents: a Hugging Face dataset repo, a local directory, Python's standard library."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from datalines.recipe import SourceSpec
from datalines.sources.base import Source, SourceFile
from datalines.sources.embedded import EmbeddedSource
from datalines.sources.hub import HubSource
from datalines.sources.local import LocalSource

__all__ = ["Source", "SourceFile", "open_source"]


def open_source(spec: SourceSpec, work: Path, pins: dict[str, Any] | None) -> Source:
    """The source a spec declares; `pins` (from dataline.json) fixes its files, None lists them afresh."""
    if spec.kind == "hub":
        return HubSource(spec, work, pins)
    if spec.kind == "local":
        return LocalSource(spec, work, pins)
    return EmbeddedSource(spec, work, pins)
