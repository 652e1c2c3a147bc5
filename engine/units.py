"""Units of memory and disk: every `*_gb` setting in this project is GiB, 2**30 bytes.

That holds for run.json's `guards.share_reserve_gb` and `guards.min_free_disk_gb`, tune's
`--budget-gb` and whatever reads them: each value is converted to bytes once (the config's
`*_bytes` properties, `gib_bytes` here) and shown in GiB from bytes with `GIB`. Torch-free and
import-free, so the supervisor and the console use the same constant as the trainer.

Not yet the data preparer's `--min-free-gb` / `$NSCONSOLE_DATA_MIN_FREE_GB`: `datalines` sits below
`engine` and cannot import this, and it still counts those in GB (1e9 bytes).
"""

from __future__ import annotations

GIB = 2**30
"""Bytes in a GiB: the unit of every `*_gb` setting."""


def gib_bytes(gib: float) -> int:
    """A `*_gb` setting (GiB) as whole bytes (truncated, as an allocation size is)."""
    return int(gib * GIB)
