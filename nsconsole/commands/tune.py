"""`nsconsole tune LINE [--shared] [--budget-gb X]`: per length, the fastest micro-batch shape that fits."""

from __future__ import annotations

import argparse
import math

from nsconsole.commands.parser import add_command, positive_int

HELP = (
    "LINE [--shared] [--budget-gb X]: the fastest micro-batch shape of every length that fits, into run.json"
)
DESCRIPTION = """\
For every sequence length of the plan, run real updates of the line's model at micro-batch rows
1, 2, 4, ... (on a CPU up to 8, or --max-rows) and at the line's current rows, and each
recomputation setting, measure tokens/s and peak memory, and write the fastest setting whose peak
fits into run.json's `lengths` (atomically). The budget is the GPU's free memory less a 4 GiB
margin (on a CPU line: half the available memory), or --budget-gb; with --shared, less
guards.share_reserve_gb too, written as each length's `shared` shape (used while other processes
share the GPU). A setting that ran out of memory is never chosen. Refused while the line's trainer
or supervisor runs (a running line is tuned from the console, t).
"""
EXAMPLES = """\
examples:
  nsconsole tune runs/trunk
  nsconsole tune runs/trunk --shared
  nsconsole tune runs/demo --budget-gb 4
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(subparsers, "tune", summary=HELP, description=DESCRIPTION, examples=EXAMPLES)
    parser.add_argument("line", metavar="LINE", help="the training line directory")
    parser.add_argument(
        "--shared", action="store_true", help="measure the shapes used beside other GPU processes"
    )
    parser.add_argument("--budget-gb", type=budget_gib, default=None, metavar="X", help="the memory budget in GiB")
    parser.add_argument(
        "--max-rows",
        type=positive_int,
        default=None,
        metavar="N",
        help="the largest of rows 1, 2, 4, ... tried (default: the update's rows; 8 on a CPU); the "
        "line's current rows are tried as well",
    )
    parser.set_defaults(func=run)


def budget_gib(text: str) -> float:
    """An argparse type: a budget in GiB, finite and above 0 (`nan` and `inf` parse as floats, and
    reached the bytes conversion as a traceback; 0 or less left nothing to measure in)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number of GiB above 0, got {text}")
    return value


def run(args: argparse.Namespace) -> int:
    from engine.ops.lines import open_line
    from engine.training.line_lock import held_at_rest

    line = args.host_settings.resolve_line(args.line)
    layout = open_line(line)
    # Held for the measurement (minutes on a GPU): a supervisor runs a trainer beside it otherwise,
    # one started meanwhile or one between two launches (its relaunch backoff, a wait for the GPU).
    with held_at_rest(layout, "tune it from the console (t)"):
        from engine.ops.tune import format_table, tune_line  # torch: it measures real updates

        result = tune_line(line, shared=args.shared, budget_gb=args.budget_gb, max_rows=args.max_rows)
    for text in format_table(result):
        print(text)
    print(f"written to {line / 'run.json'}")
    return 0
