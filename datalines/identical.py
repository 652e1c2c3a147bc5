"""`data init --like DATA`: a new data line identical to DATA, for a second training line.

A data line is consumed by the line that trains on it (datalines.consumption), so two models
compared on the same data, or a line started again from nothing, each need their own. This one
takes DATA's recipe, pins (hub commits, every file's sha256), tokenizer, EOS id, cycle size and
calibration as they are, so its cycles' plans, shards and manifests and its held-out rows come
out byte for byte the same (nothing is measured again). The cycles DATA has planned are planned
here too and compared with DATA's: a source that changed since DATA was made (a local file
edited) is refused rather than giving a line that only looks identical.
"""

from __future__ import annotations

from pathlib import Path

from datalines.creation import check_new_work, nothing_left_on_failure
from datalines.dataline import CONFIG_NAME, TOKENIZER_NAME, DataLine, open_data_line
from datalines.errors import DataLineError
from datalines.files import write_bytes_atomic, write_json_atomic
from datalines.planning import ensure_plan

_COPIED_KEYS = ("format", "eos_id", "cycle_tokens", "tokenizer", "recipe", "pins", "calibration", "calibration_from")
"""The dataline.json keys that define a data line's data (all of them, today)."""


def init_like_line(work: Path, like: Path) -> DataLine:
    """Create at `work` a data line identical to the one at `like` (see the module docstring)."""
    check_new_work(work)
    other = open_data_line(like)
    # A refusal below (DATA's sources changed since it was made) leaves no half-made line at
    # `work`: its dataline.json would refuse the retry with "a data line already exists here".
    with nothing_left_on_failure(work):
        return _copy_line(work, other)


def _copy_line(work: Path, other: DataLine) -> DataLine:
    config = {key: other.config[key] for key in _COPIED_KEYS if key in other.config}
    work.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(work / TOKENIZER_NAME, other.tokenizer_json.encode("utf-8"))
    write_json_atomic(work / CONFIG_NAME, config)  # last: its presence marks a finished init
    line = open_data_line(work)
    planned = sorted(int(path.stem[1:]) for path in (other.path / "plans").glob("c[0-9][0-9][0-9][0-9].json"))
    for index in planned:
        ensure_plan(line, index)
        ours, theirs = _plan_bytes(line, index), _plan_bytes(other, index)
        if ours != theirs:
            raise DataLineError(
                f"{other.path / 'plans' / f'c{index:04d}.json'}: cycle {index} plans differently from its "
                f"sources now (they changed since {other.path} was made); {work} would not be identical to it"
            )
    return line


def _plan_bytes(line: DataLine, index: int) -> bytes:
    return (line.path / "plans" / f"c{index:04d}.json").read_bytes()
