"""`nsconsole tune LINE [--shared]: the fastest micro-batch rows and recomputation per sequence length that fit the GPU, written into run.json`."""

from __future__ import annotations

import argparse

from nsconsole.commands.pending import not_built

HELP = "LINE [--shared]: the fastest micro-batch rows and recomputation per sequence length that fit the GPU, written into run.json"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("tune", help=HELP, description=HELP + " (not built yet)")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    raise not_built("tune", "life of a line")
