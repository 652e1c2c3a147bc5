"""`nsconsole run LINE [--foreground] [--stop-at UPDATE]` and `nsconsole --run [LINE]`."""

from __future__ import annotations

import argparse

from nsconsole.commands.pending import not_built

HELP = (
    "LINE [--foreground] [--stop-at UPDATE]: run a line under its supervisor "
    "(in the background unless --foreground)"
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run",
        help=HELP,
        description=(
            HELP + ". --foreground trains in this terminal (a row every print_every updates), "
            "checkpoints at exit and exits 0 at --stop-at, on a STOP request or when the data line ends."
        ),
    )
    parser.add_argument("line", help="the training line's directory")
    parser.add_argument("--foreground", action="store_true", help="train in this terminal")
    parser.add_argument("--stop-at", type=int, default=None, metavar="UPDATE", help="stop cleanly at UPDATE")
    parser.add_argument(
        "--engine",
        choices=("auto", "eager", "graph"),
        default="auto",
        help="step engine: auto is CUDA graphs on a GPU and eager on the CPU",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not args.foreground:
        raise not_built("run (in the background, under the supervisor)", "supervisor")
    from engine.trainer import Trainer

    return Trainer(args.line, stop_at=args.stop_at, engine=args.engine).run()


def run_headless(line: str | None) -> int:
    """`nsconsole --run [LINE]`: the supervisor, detached; no LINE creates the demo line."""
    raise not_built("--run", "supervisor")
