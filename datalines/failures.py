"""What the operator does about a preparer failure that does not pass by itself.

A failure that may pass (the hub down, a dropped download: `SourceUnavailable`; a full disk, or
anything unexpected) is retried with backoff. Any other `DataLineError` (a source used up in
`error` mode, a pinned file changed or gone, a dataline.json that no longer parses, a damaged
manifest) fails the same way at every retry: the preparer stops and records its reason and fix in
preparer.json (state `failed`), and its supervisor does not restart it until its operator has
acted (`datalines.service.stops_for_good`).
"""

from __future__ import annotations

from datalines.errors import DataLineError, InputChanged, ManifestDamaged, SourceExhausted

EXHAUSTED_FIX = (
    "the data line's data is used up (max epochs 1; files added to a source after `data init` are not read): "
    "stop the line once it has trained the cycles already prepared, or go on from a data line with more data "
    "(`nsconsole branch NEW --from LINE --data DIR ...`)"
)
GENERIC_FIX = "correct what it names"


def reason_and_fix(error: DataLineError) -> tuple[str, str]:
    """The failure's reason (one line, naming the file) and what to do about it (one clause)."""
    if isinstance(error, InputChanged):
        return str(error), error.fix
    if isinstance(error, ManifestDamaged):  # its message ends with its remedy already
        return error.problem, error.remedy
    if isinstance(error, SourceExhausted):
        return str(error), EXHAUSTED_FIX
    return str(error), GENERIC_FIX
