"""`nsconsole branch NEW --from LINE --at-cycle N --plan PLAN --data DIR: fork a branch line from a trunk cycle end`."""

from __future__ import annotations

import argparse

from nsconsole.commands.pending import not_built

HELP = "NEW --from LINE --at-cycle N --plan PLAN --data DIR: fork a branch line from a trunk cycle end"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("branch", help=HELP, description=HELP + " (not built yet)")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    raise not_built("branch", "life of a line")
