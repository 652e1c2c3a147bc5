"""The programs a supervisor starts beside the trainer, and their command lines.

    python -m engine.supervisor.children preparer --parent PID --work DATA
    python -m engine.supervisor.children tune --parent PID LINE [--shared]

`preparer` keeps the data line's next cycles ready (`datalines.service.run_preparer`), printing
one line per status change (its output is the data line's preparer log); a SIGTERM stops it with
its status saying `stopped`, and a failure that does not pass by itself ends it with
`PreparerExitCode.STOPPED_FOR_GOOD`, which its supervisor does not restart. `tune` measures the
line's micro-batch shapes into run.json (`engine.ops.tune.tune_line`) in its own process, so that
no CUDA context stays in the supervisor; its table goes to stdout (run.log) and a refusal is one
line on stderr, exit 2.
Each dies with its supervisor (`die_with_parent`: the kernel sends SIGTERM when the parent
dies) and does not start when the supervisor is already gone. The trainer has its own entry
point, `engine.training.main`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from engine.protocol.facts import SIGNAL_EXIT_BASE, PreparerExitCode, SupervisorExitCode
from engine.supervisor.child import die_with_parent

_MODULE = "engine.supervisor.children"


def preparer_command() -> list[str]:
    """The preparer's command line before its `--work DATA`, for a child of this process."""
    return [sys.executable, "-m", _MODULE, "preparer", "--parent", str(os.getpid())]


def tune_command(line: Path, shared: bool) -> list[str]:
    """The tune child's command line, for a child of this process."""
    return [sys.executable, "-m", _MODULE, "tune", "--parent", str(os.getpid()), str(line),
            *(["--shared"] if shared else [])]


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _run_preparer(args: argparse.Namespace) -> int:
    from datalines.errors import DataLineError
    from datalines.service import StatusLines, run_preparer_at, stops_for_good

    # A SIGTERM stops it like Ctrl-C, so the status file says `stopped` rather than a stale state.
    signal.signal(signal.SIGTERM, _interrupt)
    lines = StatusLines()
    try:
        run_preparer_at(args.work, on_status=lines, on_warning=lines.warn)
    except DataLineError as error:
        if not stops_for_good(error):
            raise
        # preparer.json says why and what to do: the supervisor reads it, and restarts it no more.
        print(f"nsconsole: {error}", file=sys.stderr, flush=True)
        return PreparerExitCode.STOPPED_FOR_GOOD
    return PreparerExitCode.OK


def _run_tune(args: argparse.Namespace) -> int:
    from engine.ops.tune import format_table, tune_line

    result = tune_line(args.line, shared=args.shared)
    for text in format_table(result):
        print(text)
    print(f"written to {args.line / 'run.json'}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {_MODULE}")
    kinds = parser.add_subparsers(dest="kind", required=True)
    preparer = kinds.add_parser("preparer")
    preparer.add_argument("--parent", type=int, required=True, help="the supervisor's pid")
    preparer.add_argument("--work", type=Path, required=True, help="the data line")
    preparer.set_defaults(run=_run_preparer)
    tune = kinds.add_parser("tune")
    tune.add_argument("--parent", type=int, required=True, help="the supervisor's pid")
    tune.add_argument("line", type=Path)
    tune.add_argument("--shared", action="store_true")
    tune.set_defaults(run=_run_tune)
    args = parser.parse_args(argv)
    if not die_with_parent(args.parent):
        print("nsconsole: the supervisor exited before this child started", file=sys.stderr)
        return SIGNAL_EXIT_BASE + signal.SIGTERM

    from datalines.errors import DataLineError
    from engine.errors import LineError

    try:
        return args.run(args)
    except (LineError, DataLineError) as error:
        print(f"nsconsole: {error}", file=sys.stderr, flush=True)
        return SupervisorExitCode.USER_ERROR
    except KeyboardInterrupt:
        return SIGNAL_EXIT_BASE + signal.SIGINT


if __name__ == "__main__":
    raise SystemExit(main())
