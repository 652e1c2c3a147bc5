"""`nsconsole resume [--dry-run]`: start again every line whose supervisor was lost (a reboot, a kill)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from nsconsole.commands.parser import add_command

if TYPE_CHECKING:
    from engine.supervisor.lost import LostLine

HELP = "[--dry-run]: start again every line whose supervisor died while it ran (after a reboot)"
DESCRIPTION = """\
Start the supervisor of every line whose last supervisor died while the line ran: the host went
down, or it was killed. Such a line's supervisor.json is left in a state that is not final
(training, waiting-gpu, relaunching, ...) and names a process that runs no more. Each is started
as `nsconsole run LINE` starts it (the same refusals and start checks), with the --engine and
--stop-at its lost supervisor ran it with; its trainer resumes from the newest whole checkpoint.
A line lost while it was stopping on request is named and left alone. Lines are looked for where
the console looks: host.json's work_root, the demo's root and every line a supervisor has run on
this host. Exit status 1 when a line could not be started.

Run it at boot to keep lines training through a reboot, e.g. in `crontab -e`:
  @reboot sleep 60 && /path/to/python -m nsconsole resume >> ~/.nsconsole/resume.log 2>&1
"""
EXAMPLES = """\
examples:
  nsconsole resume --dry-run     # name the lines it would start
  nsconsole resume
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(subparsers, "resume", summary=HELP, description=DESCRIPTION, examples=EXAMPLES)
    parser.add_argument("--dry-run", action="store_true", help="name the lines it would start; start none")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from datalines.errors import DataLineError
    from engine.errors import LineError
    from engine.supervisor.lost import lost_line
    from nsconsole.history import line_candidates

    candidates = line_candidates(args.host_settings)
    lost = [line for line in map(lost_line, candidates) if line is not None]
    if not lost:
        print(f"no line's supervisor was lost ({len(candidates)} line(s) looked at)")
        return 0
    refused = 0
    for line in lost:
        if line.asked_to_stop:
            print(f"{line.path}: left alone, it was stopping on request when its supervisor (pid "
                  f"{line.supervisor_pid}) was lost; `nsconsole run {line.path}` starts it")
            continue
        if args.dry_run:
            print(f"would resume {line.path} ({_lost_words(line)})")
            continue
        print(f"resuming {line.path} ({_lost_words(line)})", flush=True)
        try:
            _resume(line)
        except (LineError, DataLineError, OSError) as error:
            print(f"nsconsole: {error}", file=sys.stderr, flush=True)
            refused += 1
    started = sum(1 for line in lost if not line.asked_to_stop)
    if not args.dry_run and started:
        print(f"{started - refused} of {started} lost line(s) resumed")
    return 1 if refused else 0


def _lost_words(line: LostLine) -> str:
    options = "".join([f"; --engine {line.engine}" if line.engine != "auto" else "",
                       f"; --stop-at {line.stop_at}" if line.stop_at is not None else ""])
    return f"it was {line.state} when its supervisor (pid {line.supervisor_pid}) was lost{options}"


def _resume(line: LostLine) -> None:
    """Start the line's supervisor as `nsconsole run LINE --engine E [--stop-at N]` would."""
    from engine.supervisor.supervisor import run_line
    from nsconsole.commands.run import refuse_a_bad_start

    refuse_a_bad_start(line.path, check_start=True, again=f"nsconsole run {line.path}")
    run_line(line.path, foreground=False, stop_at=line.stop_at, engine=line.engine)
