"""`nsconsole run LINE [--foreground] [--stop-at UPDATE]` and `nsconsole --run [LINE]`."""

from __future__ import annotations

import argparse

from nsconsole.commands.pending import not_built

HELP = "LINE [--foreground] [--stop-at UPDATE]: run a line under its supervisor (in the background unless --foreground)"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("run", help=HELP, description=HELP + " (not built yet)")
    parser.add_argument("line", help="the training line's directory")
    parser.add_argument("--foreground", action="store_true", help="train in this terminal")
    parser.add_argument("--stop-at", type=int, default=None, metavar="UPDATE", help="stop cleanly at UPDATE")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    raise not_built("run", "training core")


def run_headless(line: str | None) -> int:
    """`nsconsole --run [LINE]`: the supervisor, detached; no LINE creates the demo line."""
    raise not_built("--run", "supervisor")
