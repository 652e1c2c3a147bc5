"""`nsconsole rollback LINE --to UPDATE: continue a line from an earlier checkpoint as a new W&B run`."""

from __future__ import annotations

import argparse

from nsconsole.commands.pending import not_built

HELP = "LINE --to UPDATE: continue a line from an earlier checkpoint as a new W&B run"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("rollback", help=HELP, description=HELP + " (not built yet)")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    raise not_built("rollback", "life of a line")
