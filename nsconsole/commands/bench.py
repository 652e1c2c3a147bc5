"""`nsconsole bench --model P --seq-len T --rows R --accum A: throughput and MFU of one training shape`."""

from __future__ import annotations

import argparse

from nsconsole.commands.pending import not_built

HELP = "--model P --seq-len T --rows R --accum A: throughput and MFU of one training shape"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help=HELP, description=HELP + " (not built yet)")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    raise not_built("bench", "training core")
