"""Data lines: pinned sources, cycles of pre-tokenized shards with permanent manifests, held-out rows.

The trainer uses `open_data_line(path)`; see `datalines.dataline.DataLine` and `datalines.cycle.Cycle`.

The names below are loaded on first use (PEP 562): the console, the supervisor and the light CLI
commands import `datalines.errors` and the status readers, which must not pull in numpy and
pyarrow (a second of the console's first paint).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from datalines.cycle import Cycle
    from datalines.dataline import DataLine, open_data_line
    from datalines.errors import DataLineError, SourceExhausted

_HOMES = {
    "Cycle": "datalines.cycle",
    "DataLine": "datalines.dataline",
    "open_data_line": "datalines.dataline",
    "DataLineError": "datalines.errors",
    "SourceExhausted": "datalines.errors",
}

__all__ = ["Cycle", "DataLine", "DataLineError", "SourceExhausted", "open_data_line"]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'datalines' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
