"""`nsconsole stop LINE [--at-cycle-end N]`: ask a running line to stop with a checkpoint."""

from __future__ import annotations

import argparse

from nsconsole.commands.parser import add_command

HELP = "LINE [--at-cycle-end N]: stop a line with a checkpoint at the next update or at the end of a cycle"
DESCRIPTION = """\
Write the line's STOP file (atomically). The trainer stops with a checkpoint at its next update,
or exactly at the end of data cycle N with --at-cycle-end N, and removes the file. A second
request replaces the first, and says so. Refused, writing nothing, when neither the line's
supervisor nor a trainer of its own runs (a STOP left in a stopped line would stop its next start
at once).
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
    from engine.errors import LineError
    from engine.layout import LineLayout
    from engine.ops.stop import read_stop, stop_line

    line = args.host_settings.resolve_line(args.line)
    try:
        pending = read_stop(LineLayout(line))
    except LineError:  # a malformed STOP: the new request replaces it whole
        pending = None
    request = stop_line(line, args.at_cycle_end)
    # Said, not silent: the line no longer stops where the earlier request asked.
    replaced = "" if pending is None else f"; it replaces the stop {pending.when()} requested {pending.requested}"
    print(f"stop requested for {line} {request.when()} ({request.requested}){replaced}")
    return 0
