"""`nsconsole stop LINE [--at-cycle-end N]`: ask a line to stop with a checkpoint."""

from __future__ import annotations

import argparse

from engine.ops.stop import request_stop

HELP = "LINE [--at-cycle-end N]: stop a line with a checkpoint at the next update or at the end of a cycle"
DESCRIPTION = """\
Write the line's STOP file (atomically). The trainer stops with a checkpoint at its next update,
or exactly at the end of data cycle N with --at-cycle-end N, and removes the file. A second
request replaces the first.

examples:
  nsconsole stop runs/trunk
  nsconsole stop runs/trunk --at-cycle-end 1
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "stop", help=HELP, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("line", metavar="LINE", help="the training line directory")
    parser.add_argument(
        "--at-cycle-end", type=int, default=None, metavar="N", help="stop exactly at the end of data cycle N"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    line = args.host_settings.resolve_line(args.line)
    request = request_stop(line, args.at_cycle_end)
    print(f"stop requested for {line} {request.when()} ({request.requested})")
    return 0
