"""`nsconsole status`."""

from __future__ import annotations

import argparse

from nsconsole.commands.pending import not_built


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("status", help="(not built yet)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    raise not_built("status", "foundation")
