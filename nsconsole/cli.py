"""The `nsconsole` command line: a thin entry point.

`nsconsole` alone opens the console; `nsconsole --run [LINE]` starts a line's supervisor
headless; every other command is a module in `nsconsole/commands/` that registers its own
subparser. User errors (`LineError`, `DataLineError`) print one line and exit with status 2. A
command that reports also says by its exit status what it found, each in its --help: 1 for a
failed check, a damaged data cycle or an invalid run.json (`check`, `data status`, `status`), and
`status` 3 for a line that needs its operator (engine.protocol.facts.StatusExitCode). A reader of
stdout that closes early (`nsconsole status LINE | head -2`) ends the command quietly with status
141, as a command killed by SIGPIPE ends in a shell (128 + 13).

Nothing heavy loads before a command runs: `--help`, `status`, `stop` and the console start in a
fraction of a second without torch (or numpy); a command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
from collections.abc import Sequence
from typing import IO, NoReturn

from engine.config.host import load_and_apply
from engine.errors import LineError
from engine.protocol.facts import ENGINE_CHOICES, SupervisorExitCode
from nsconsole.commands import COMMAND_MODULES

EXAMPLES = """\
examples:
  nsconsole                       # the console: every line on this host, live
  nsconsole --run                 # create (or resume) the demo line and run it in the background
  nsconsole --run runs/trunk --stop-at 1000
  nsconsole new runs/trunk --model ns-2b --data /data/lines/trunk
  nsconsole run runs/trunk
  nsconsole COMMAND --help        # each command's description and examples
"""


class CommandParser(argparse.ArgumentParser):
    """argparse's parser whose help meets a reader that is gone as every command's output does
    (`main` ends with status 141): argparse's own printing swallows the BrokenPipeError, so under
    PYTHONUNBUFFERED `nsconsole --help | true` ended 0. Subcommands' parsers are of this class too."""

    def print_help(self, file: IO[str] | None = None) -> None:
        (file or sys.stdout).write(self.format_help())

    def error(self, message: str) -> NoReturn:
        """A bad or missing option as one line on stderr and exit status 2, as every other refusal:
        argparse put its whole usage block (five lines for `new`) before the line that says what is
        wrong. `--help` shows the usage."""
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="nsconsole",
        description=(
            "Pre-training for spiking and state-space language models. With no command, opens "
            "the console that attaches to every running line's supervisor on this host."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--run",
        nargs="?",
        const="",
        metavar="LINE",
        help="start LINE's supervisor headless and detached (no LINE: create and run the embedded demo line)",
    )
    add_run_options(parser)
    parser.add_argument("--readonly", action="store_true", help="console: disable every mutating key")
    parser.add_argument("--theme", default=None, help="console: colour theme (dark, light, colorblind)")
    parser.add_argument(
        "--bell", default=None, metavar="SEVERITIES",
        help="console: ring the terminal bell for new events of these severities, comma-separated "
        "(error, warning, info; none: never); default: error",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMAND_MODULES:
        module.register(subparsers)
    return parser


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """The options of `nsconsole run` that `--run` takes too: it is that command's headless form, so
    `nsconsole --run LINE --stop-at 43` means `nsconsole run LINE --stop-at 43`. Their dests are
    their own (`run_stop_at`, ...): a command's options of the same names are that command's.
    --foreground and --no-supervisor are taken only to refuse them in one line naming the command
    that does it (`--run` detaches), instead of argparse's `invalid choice`."""
    group = parser.add_argument_group("with --run (as `nsconsole run LINE`)")
    group.add_argument(
        "--stop-at", type=int, dest="run_stop_at", metavar="UPDATE",
        help="stop cleanly at UPDATE (after the line's latest checkpoint; refused otherwise)",
    )
    group.add_argument(
        "--engine", choices=ENGINE_CHOICES, dest="run_engine",
        help="step engine (default auto: CUDA graphs on a GPU, eager on the CPU)",
    )
    for flag in ATTACHED_RUN_FLAGS:
        group.add_argument(flag, action="append_const", const=flag, dest="run_attached", help=argparse.SUPPRESS)


ATTACHED_RUN_FLAGS = ("--foreground", "--no-supervisor")
"""`nsconsole run`'s flags that keep the line in the terminal: refused with `--run`, which detaches."""


def refuse_stray_run_options(args: argparse.Namespace) -> None:
    """`LineError` (one line) for a `--run` option nothing would honour: one of ATTACHED_RUN_FLAGS
    (`--run` detaches), or one given without `--run` alone (with the console, or before a command,
    whose own options come after its name); each names the command that does what was asked."""
    line = args.run or getattr(args, "line", None) or "LINE"
    attached = args.run_attached or []
    if args.run is not None and args.command is None:
        if attached:
            raise LineError(
                f"{attached[0]}: --run starts the line detached; to keep it in this terminal: "
                f"nsconsole run {line} {attached[0]}"
            )
        return
    given = [f"--stop-at {args.run_stop_at}"] if args.run_stop_at is not None else []
    given += [f"--engine {args.run_engine}"] if args.run_engine is not None else []
    if given or attached:
        options = " ".join(given + attached)
        forms = ([f"`nsconsole --run {line} {options}`"] if not attached else []) + [f"`nsconsole run {line} {options}`"]
        raise LineError(
            f"{options}: an option of --run alone (a command takes its options after its name); "
            f"write {' or '.join(forms)}"
        )


READER_GONE = 128 + 13
"""The exit status when stdout's reader closed early: a shell's status of a command killed by SIGPIPE."""
STDOUT_FAILED = 1
"""The exit status when stdout cannot be written (a full disk), after one line on stderr."""


def main(argv: Sequence[str] | None = None) -> int:
    _buffer_an_unbuffered_stdout()
    try:
        try:
            return run_command(build_parser().parse_args(argv))
        finally:
            sys.stdout.flush()  # a reader gone is met here (after --help too), not in the interpreter's exit
    except BrokenPipeError:
        # Python's recipe (the `signal` module's note on SIGPIPE): stdout's reader is gone, so
        # what is left for it goes to /dev/null, where the interpreter's exit flushes it quietly.
        _drop_stdout()
        return READER_GONE
    except OSError as error:
        if not _stdout_fails():
            raise
        # stdout cannot take the output (a full disk, `> /dev/full`, an I/O error): one line, not a traceback.
        _drop_stdout()
        print(f"nsconsole: stdout: {error.strerror or error}", file=sys.stderr)
        return STDOUT_FAILED


def _buffer_an_unbuffered_stdout() -> None:
    """Under PYTHONUNBUFFERED (or `python -u`) stdout writes straight to its file, so a failed write
    leaves nothing behind to tell stdout's failure from any other OSError (`_stdout_fails`). A
    line-buffered stdout over the same descriptor shows every line, and every explicit flush, as
    promptly, and keeps what a failed write could not take. A terminal is left as it is (the
    console draws on it, and a terminal does not fill up)."""
    stream = sys.stdout
    if not isinstance(getattr(stream, "buffer", None), io.RawIOBase) or stream.isatty():
        return
    raw = io.FileIO(stream.fileno(), "w", closefd=False)  # the descriptor stays the interpreter's
    sys.stdout = io.TextIOWrapper(
        io.BufferedWriter(raw), encoding=stream.encoding, errors=stream.errors, line_buffering=True
    )


def _stdout_fails() -> bool:
    """Whether stdout's writes fail: what a failed write left in its buffer fails again (an OSError
    raised elsewhere, a file the command itself wrote, leaves stdout flushing fine)."""
    try:
        sys.stdout.flush()
    except OSError:
        return True
    return False


def _drop_stdout() -> None:
    """What is left for stdout goes to /dev/null, where the interpreter's exit flushes it quietly."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def run_command(args: argparse.Namespace) -> int:
    """The command `args` names (the console without one): its exit status, or 2 after a user
    error's one line."""
    try:
        # Host settings first: their environment (e.g. TRITON_PTXAS_PATH) must precede everything.
        args.host_settings = load_and_apply()
        refuse_stray_run_options(args)
        if args.command is not None:
            return int(args.func(args) or 0)
        if args.run is not None:
            from nsconsole.commands.run import run_headless

            line = args.run or None
            engine = args.run_engine or "auto"
            return int(run_headless(line, args.host_settings, stop_at=args.run_stop_at, engine=engine) or 0)
        from nsconsole.commands.console import open_console

        return int(open_console(readonly=args.readonly, theme=args.theme, bell=args.bell) or 0)
    except Exception as error:
        if not isinstance(error, user_errors()):
            raise
        print(f"nsconsole: {error}", file=sys.stderr)
        return SupervisorExitCode.USER_ERROR
    except KeyboardInterrupt:
        return 130


def user_errors() -> tuple[type[Exception], ...]:
    """The errors printed as one line: `LineError`, and `DataLineError` once datalines is loaded
    (a command that never loaded it cannot have raised it, and loading it costs numpy and pyarrow)."""
    data_errors = sys.modules.get("datalines.errors")
    return (LineError,) if data_errors is None else (LineError, data_errors.DataLineError)


if __name__ == "__main__":
    raise SystemExit(main())
