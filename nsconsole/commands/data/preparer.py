"""`nsconsole data run-preparer`: keep a data line's next cycles ready, and what it shows meanwhile."""

from __future__ import annotations

import argparse
import signal
import sys
from types import TracebackType
from typing import TYPE_CHECKING

from engine.protocol.facts import PreparerExitCode
from engine.units import gib_bytes
from nsconsole.commands.data.paths import data_line_path

# rich and the preparer's modules load only when run-preparer runs: `nsconsole --help` and the
# other commands start without them.
if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress, TaskID

    from datalines.status import PreparerStatus


def run_preparer_command(args: argparse.Namespace) -> int:
    """Prepare until done: exit 0; a failure that does not pass by itself: its reason and fix in
    one line, exit `PreparerExitCode.STOPPED_FOR_GOOD` (78: not a refusal, 2, which a supervisor
    retries); any other user error: one line, exit 2."""
    from datalines.errors import DataLineError
    from datalines.failures import reason_and_fix
    from datalines.service import run_preparer_at, stops_for_good

    path = data_line_path(args, args.work)
    min_free = None if args.min_free_gb is None else gib_bytes(args.min_free_gb)
    # A SIGTERM stops it like Ctrl-C, so the status file says `stopped` rather than a stale state.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        with PreparerView(interactive=sys.stdout.isatty()) as view:
            run_preparer_at(path, ahead=args.ahead, min_free_bytes=min_free, once=args.once,
                            on_status=view.update, on_warning=view.warn)  # fmt: skip
    except DataLineError as error:
        if not stops_for_good(error):
            raise
        reason, fix = reason_and_fix(error)
        print(f"nsconsole: {reason}; {fix}", file=sys.stderr)
        return PreparerExitCode.STOPPED_FOR_GOOD
    finally:
        signal.signal(signal.SIGTERM, previous)
    return PreparerExitCode.OK


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


class PreparerView:
    """What run-preparer shows: a rich progress bar on a terminal, one line per change otherwise."""

    def __init__(self, interactive: bool, console: Console | None = None) -> None:
        from rich.console import Console

        self.interactive = interactive
        self.console = console or Console()
        self.progress: Progress | None = None
        self.task: TaskID | None = None
        self.last_line = ""
        from datalines.service import StatusLines  # the preparer's modules load only for run-preparer

        self.plain = StatusLines()

    def __enter__(self) -> PreparerView:
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

        if self.interactive:
            self.progress = Progress(
                TextColumn("[bold]{task.fields[state]}[/]"),
                BarColumn(),
                TaskProgressColumn(),
                TextColumn("{task.description}"),
                TimeElapsedColumn(),
                console=self.console,
            )
            self.progress.start()
            self.task = self.progress.add_task("starting", total=1.0, state="starting")
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self.progress is not None:
            self.progress.stop()

    def update(self, status: PreparerStatus) -> None:
        line = f"{status.state}: {status.waiting_reason or status.message}"
        if self.progress is not None and self.task is not None:
            self.progress.update(
                self.task, completed=status.progress, description=line, state=status.state, refresh=True
            )
            if status.state in ("waiting", "retrying", "failed") and line != self.last_line:
                self.progress.console.print(f"[yellow]{line}[/]")
        else:
            self.plain(status)
        self.last_line = line

    def warn(self, message: str) -> None:
        """A warning of the preparer's (a file with bytes that are not UTF-8): one line, kept in view."""
        if self.progress is not None:
            self.progress.console.print(f"warning: {message}", style="yellow", markup=False, highlight=False)
        else:
            self.plain.warn(message)
