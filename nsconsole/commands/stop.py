"""`nsconsole stop LINE [--at-cycle-end N]: stop a line with a checkpoint at the next update or at the end of a cycle`."""

from __future__ import annotations

import argparse

from nsconsole.commands.pending import not_built

HELP = "LINE [--at-cycle-end N]: stop a line with a checkpoint at the next update or at the end of a cycle"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("stop", help=HELP, description=HELP + " (not built yet)")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    raise not_built("stop", "training core")
