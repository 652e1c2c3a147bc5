"""`nsconsole data val`: build a data line's validation rows, at the lengths given or a line's."""

from __future__ import annotations

import argparse

from nsconsole.commands.data.paths import data_line_path


def run_val(args: argparse.Namespace) -> int:
    from datalines import open_data_line
    from datalines.errors import DataLineError
    from datalines.validation import build_validation
    from engine.config.run import DEFAULT_SEQ_LEN
    from engine.ops.val_lengths import default_long_seq_len, line_lengths

    if args.for_line is not None:
        if args.seq_len is not None or args.long_seq_len is not None:
            raise DataLineError("data val: give --line or --seq-len / --long-seq-len, not both")
        lengths = line_lengths(args.host_settings.resolve_line(args.for_line))
    else:
        seq_len = DEFAULT_SEQ_LEN if args.seq_len is None else args.seq_len
        if args.long_seq_len is not None and args.long_seq_len < 0:  # else taken as 0 without a word
            raise DataLineError(f"--long-seq-len must be >= 0 (0: none), got {args.long_seq_len}")
        long_seq_len = default_long_seq_len() if args.long_seq_len is None else args.long_seq_len
        lengths = [seq_len] + ([long_seq_len] if long_seq_len > 0 and long_seq_len != seq_len else [])
    built = build_validation(open_data_line(data_line_path(args, args.work)), lengths)
    for length in built:
        print(length.describe())
    return 0 if all(length.built for length in built) else 1
