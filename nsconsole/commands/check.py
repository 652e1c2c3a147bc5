"""`nsconsole check LINE`: every start check that needs no GPU."""

from __future__ import annotations

import argparse

from nsconsole.commands.parser import add_command

HELP = "LINE: every start check that needs no GPU (run.json, data line, lifelong keys, metrics, disk)"
DESCRIPTION = """\
Run every start check that needs no GPU: run.json valid, the data line present and matching the
model's vocabulary, held-out rows, lifelong keys unchanged since accepted_run.json (or listed in
allow_changes; a line never started has none yet), the metric set's version, GPU-sharing shapes,
free disk (room for the next checkpoint, and what the checkpoints retention keeps take over the
line's life), the learning-rate warmup against the line's length (until its first start: the plan's
tokens, the data line's), checkpoints. Prints `ok: ...` for each pass, `warn: ...` for a pass with
something to act on (the kept checkpoints outgrow the disk; the line would end inside its warmup)
and `FAIL: ...` for each failure. Exit status 0 when all pass, 1 when one fails, 2 when run.json
itself is missing or invalid.
`nsconsole run` runs the same checks (all but the checkpoints') before it starts a line.
"""
EXAMPLES = """\
examples:
  nsconsole check runs/trunk
"""

EXIT_CHECK_FAILED = 1


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(subparsers, "check", summary=HELP, description=DESCRIPTION, examples=EXAMPLES)
    parser.add_argument("line", metavar="LINE", help="the training line directory")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine.ops.check import check_line  # torch: the checks size the line's model

    _config, results = check_line(args.host_settings.resolve_line(args.line))
    for result in results:
        print(f"{'FAIL' if not result.ok else 'warn' if result.warning else 'ok'}: {result.message}")
    return 0 if all(result.ok for result in results) else EXIT_CHECK_FAILED
