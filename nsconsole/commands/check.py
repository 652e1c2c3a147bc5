"""`nsconsole check LINE`: every start check that needs no GPU."""

from __future__ import annotations

import argparse

from engine.ops.check import check_line

HELP = "LINE: every start check that needs no GPU (run.json, data line, lifelong keys, metrics, disk)"
DESCRIPTION = """\
Run every start check that needs no GPU: run.json valid, the data line present and matching the
model's vocabulary, lifelong keys unchanged since accepted_run.json (or listed in allow_changes),
the metric set's version, GPU-sharing shapes, free disk, checkpoints. Prints `ok: ...` for each
pass and `FAIL: ...` for each failure. Exit status 0 when all pass, 1 when one fails, 2 when
run.json itself is missing or invalid.

example:
  nsconsole check runs/trunk
"""

EXIT_CHECK_FAILED = 1


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "check", help=HELP, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("line", metavar="LINE", help="the training line directory")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    _config, results = check_line(args.host_settings.resolve_line(args.line))
    for result in results:
        print(f"{'ok' if result.ok else 'FAIL'}: {result.message}")
    return 0 if all(result.ok for result in results) else EXIT_CHECK_FAILED
