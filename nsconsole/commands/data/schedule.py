"""`nsconsole data schedule`: append a piece of shares to a data line's schedule."""

from __future__ import annotations

import argparse
import json
import math

from nsconsole.commands.data.paths import data_line_path


def run_schedule(args: argparse.Namespace) -> int:
    from datalines import open_data_line
    from datalines.errors import DataLineError
    from datalines.schedule import append_schedule_piece

    try:
        shares = json.loads(args.shares)
    except json.JSONDecodeError as error:
        raise DataLineError(f"--shares: not valid JSON ({error})") from None
    if not math.isfinite(args.from_tokens) or args.from_tokens != int(args.from_tokens):
        raise DataLineError(f"--from-tokens must be a whole number, got {args.from_tokens}")
    line = open_data_line(data_line_path(args, args.work))
    append_schedule_piece(line, int(args.from_tokens), shares)
    print(f"schedule of {line.path}: from token {int(args.from_tokens):,} the shares are {shares}")
    return 0
