"""Which held-out rows a line's validation reads, and whether its held-out data line has them.

Torch-free (unlike `engine.training.validation`, which reads the rows): a branch asked of a
running line is checked in its trunk's supervisor, which never loads torch, and a branch whose
data line lacks the rows must be refused when it is asked for, not when its trainer starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from engine.config.run import RunConfig
from engine.layout import LineLayout
from engine.ops.lines import resolve_data_path

if TYPE_CHECKING:
    from datalines import DataLine


def heldout_line_path(layout: LineLayout, config: RunConfig) -> Path:
    """The data line whose held-out rows validate the line (`data.heldout`, else `data.line`)."""
    return resolve_data_path(layout, config.data.heldout or config.data.line)


def validation_lengths(config: RunConfig, longest_context: int) -> list[int]:
    """Every row length a validation of the line reads: the stages' and their long lengths (for
    a model whose longest context is `longest_context`)."""
    lengths: set[int] = set()
    for stage in config.plan:
        lengths.add(stage.seq_len)
        long = config.validation.long_seq_len or longest_context
        if long > stage.seq_len:
            lengths.add(long)
    return sorted(lengths)


def missing_rows_problem(heldout: DataLine, lengths: list[int]) -> str | None:
    """One line naming the held-out data line, the lengths whose rows were never built and the
    commands that build them; None when every length has its rows."""
    missing = [length for length in lengths if not (heldout.validation_dir(length) / "index.json").is_file()]
    if not missing:
        return None
    path = heldout.path
    # `--long-seq-len 0`: each command builds its length alone. Without it `data val` also builds
    # its default long length (32768), and on held-out documents too short for that row it said
    # "not built" and exited 1, though the length asked for was built.
    commands = " and ".join(f"`nsconsole data val --work {path} --seq-len {length} --long-seq-len 0`"
                            for length in missing)
    listed = ", ".join(str(length) for length in missing)
    return f"{path}: no held-out rows of length {listed} for this line's validation; build them with {commands}"
