"""`nsconsole stop LINE [--at-cycle-end N]`: ask a running line to stop with a checkpoint."""

from __future__ import annotations

import argparse

from nsconsole.commands.parser import add_command

HELP = "LINE [--at-cycle-end N]: stop a line with a checkpoint at the next update or at the end of a cycle"
DESCRIPTION = """\
Write the line's STOP file (atomically). The trainer stops with a checkpoint at its next update,
or exactly at the end of data cycle N with --at-cycle-end N, and removes the file. A second
request replaces the first. Refused, writing nothing, when neither the line's supervisor nor a
trainer of its own runs (a STOP left in a stopped line would stop its next start at once).
"""
EXAMPLES = """\
examples:
  nsconsole stop runs/trunk
  nsconsole stop runs/trunk --at-cycle-end 1
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(subparsers, "stop", summary=HELP, description=DESCRIPTION, examples=EXAMPLES)
    parser.add_argument("line", metavar="LINE", help="the training line directory")
    parser.add_argument(
        "--at-cycle-end", type=int, default=None, metavar="N", help="stop exactly at the end of data cycle N"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine.ops.stop import stop_line

    line = args.host_settings.resolve_line(args.line)
    request = stop_line(line, args.at_cycle_end)
    print(f"stop requested for {line} {request.when()} ({request.requested})")
    return 0
