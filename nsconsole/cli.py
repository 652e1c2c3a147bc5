"""The `nsconsole` command line: a thin entry point.

`nsconsole` alone opens the console; `nsconsole --run [LINE]` starts a line's supervisor
headless; every other command is a module in `nsconsole/commands/` that registers its own
subparser. User errors (`LineError`, `DataLineError`) print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from datalines.errors import DataLineError
from engine.config.host import load_and_apply
from engine.errors import LineError
from engine.protocol.facts import SupervisorExitCode
from nsconsole.commands import COMMAND_MODULES


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nsconsole",
        description=(
            "Pre-training for spiking and state-space language models. With no command, opens "
            "the console that attaches to every running line's supervisor on this host."
        ),
    )
    parser.add_argument(
        "--run",
        nargs="?",
        const="",
        metavar="LINE",
        help="start LINE's supervisor headless and detached (no LINE: create and run the embedded demo line)",
    )
    parser.add_argument("--readonly", action="store_true", help="console: disable every mutating key")
    parser.add_argument("--theme", default=None, help="console: colour theme (dark, light, colorblind)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMAND_MODULES:
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        # Host settings first: their environment (e.g. TRITON_PTXAS_PATH) must precede everything.
        args.host_settings = load_and_apply()
        if args.command is not None:
            return int(args.func(args) or 0)
        if args.run is not None:
            from nsconsole.commands.run import run_headless

            return int(run_headless(args.run or None, args.host_settings) or 0)
        from nsconsole.commands.console import open_console

        return int(open_console(readonly=args.readonly, theme=args.theme) or 0)
    except (LineError, DataLineError) as error:
        print(f"nsconsole: {error}", file=sys.stderr)
        return SupervisorExitCode.USER_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
