"""`nsconsole data val`: build a data line's validation rows, at the lengths given or a line's."""

from __future__ import annotations

import argparse

from nsconsole.commands.data.paths import data_line_path


def run_val(args: argparse.Namespace) -> int:
    from datalines import open_data_line
    from datalines.errors import DataLineError
    from datalines.validation import build_validation
    from engine.config.run import DEFAULT_SEQ_LEN
    from engine.ops.val_lengths import line_lengths

    if args.for_line is not None:
        if args.seq_len is not None or args.long_seq_len is not None:
            raise DataLineError("data val: give --line or --seq-len / --long-seq-len, not both")
        lengths = line_lengths(args.host_settings.resolve_line(args.for_line))
    else:
        seq_len = DEFAULT_SEQ_LEN if args.seq_len is None else args.seq_len
        lengths = [seq_len] + long_lengths(seq_len, args.long_seq_len)
    built = build_validation(open_data_line(data_line_path(args, args.work)), lengths)
    for length in built:
        print(length.describe())
    return 0 if all(length.built for length in built) else 1


def long_lengths(seq_len: int, long_seq_len: int | None) -> list[int]:
    """The long length to build beside `seq_len`, as a list (empty: none). The long rows are for
    long-context probes, so one the user gives at or below `seq_len` is a mistake, refused rather
    than built (or dropped, when equal) as if meant. The default, which the user did not choose,
    gives none there, as a training line at that length validates (validation_lengths)."""
    from datalines.errors import DataLineError
    from engine.ops.val_lengths import default_long_seq_len

    if long_seq_len is None:
        default = default_long_seq_len()
        if default > seq_len:
            return [default]
        print(
            f"val: no long rows: the default --long-seq-len {default} is not above --seq-len {seq_len} "
            "(give a longer --long-seq-len for them)"
        )
        return []
    if long_seq_len < 0:  # else taken as 0 without a word
        raise DataLineError(f"--long-seq-len must be >= 0 (0: none), got {long_seq_len}")
    if 0 < long_seq_len <= seq_len:
        raise DataLineError(f"--long-seq-len {long_seq_len} must be above --seq-len {seq_len} (0: none)")
    return [long_seq_len] if long_seq_len else []
