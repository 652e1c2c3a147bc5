"""Data lines: pinned sources, cycles of pre-tokenized shards with permanent manifests, held-out rows.

The trainer uses `open_data_line(path)`; see `datalines.dataline.DataLine` and `datalines.cycle.Cycle`.
"""

from __future__ import annotations

from datalines.cycle import Cycle
from datalines.dataline import DataLine, open_data_line
from datalines.errors import DataLineError, SourceExhausted

__all__ = ["Cycle", "DataLine", "DataLineError", "SourceExhausted", "open_data_line"]
