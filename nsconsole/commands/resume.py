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
A line lost while it was stopping on request, or with a stop still pending (its STOP file), is
named and left alone. A line its trainer finished (its plan complete, or its data line trained to
the end) before its supervisor could say so is recorded as finished (supervisor.json, and host.json's
notify told), not started. Lines are looked for where the console looks: host.json's work_root, the
demo's root and every line a supervisor has run on this host. A line whose supervisor.json is
damaged (not JSON, say) cannot be judged: it is named, and left alone. Exit status 1 when a line could
not be started, or judged.

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
    from engine.supervisor.lost import damaged_record, lost_line
    from engine.supervisor.registry import list_supervisors
    from nsconsole.history import line_candidates

    list_supervisors()  # drops the registry entries the lost supervisors left (pid gone)
    candidates = line_candidates(args.host_settings)
    # A line whose supervisor.json is damaged may be lost or not: named, never passed over in silence.
    damaged = [problem for problem in map(damaged_record, candidates) if problem is not None]
    for problem in damaged:
        print(f"nsconsole: {problem}: cannot tell whether its line's supervisor was lost; mend it, or restore "
              "it from a backup, and run resume again", file=sys.stderr)
    lost = [line for line in map(lost_line, candidates) if line is not None]
    if not lost:
        unjudged = f", {len(damaged)} of them not judged" if damaged else ""
        print(f"no line's supervisor was lost ({len(candidates)} line(s) looked at{unjudged})")
        return 1 if damaged else 0
    started = refused = 0
    for line in lost:
        if line.asked_to_stop:
            print(f"{line.path}: left alone, {_stop_words(line)} when its supervisor (pid {line.supervisor_pid}) "
                  f"was lost; `nsconsole run {line.path}` starts it")
            continue
        ended = _line_end(line)
        if ended is not None:
            _finished(line, ended, args.host_settings.notify, dry_run=args.dry_run)
            continue
        if args.dry_run:
            print(f"would resume {line.path} ({_lost_words(line)})")
            continue
        print(f"resuming {line.path} ({_lost_words(line)})", flush=True)
        started += 1
        try:
            _resume(line)
        except (LineError, DataLineError, OSError) as error:
            holder = _taken_meanwhile(line, error)
            if holder is not None:
                print(f"{line.path}: left alone, another process started it meanwhile: {holder}", flush=True)
                started -= 1
                continue
            print(f"nsconsole: {error}", file=sys.stderr, flush=True)
            refused += 1
    if started:
        print(f"{started - refused} of {started} lost line(s) resumed")
    return 1 if refused or damaged else 0


def _stop_words(line: LostLine) -> str:
    if line.stop_requested is not None:
        return f"a stop was pending (requested {line.stop_requested})"
    return "it was stopping on request"


def _lost_words(line: LostLine) -> str:
    from engine.supervisor.lost import unrecorded_settings

    unknown = unrecorded_settings(line)
    options = "".join([f"; --engine {line.engine}" if line.engine != "auto" else "",
                       f"; --stop-at {line.stop_at}" if line.stop_at is not None else "",
                       f"; {unknown}" if unknown is not None else ""])
    return f"it was {line.state} when its supervisor (pid {line.supervisor_pid}) was lost{options}"


def _line_end(line: LostLine) -> str | None:
    """Why the line has nothing left to train (`engine.ops.line_end`); None when it has, or when that
    cannot be read (its start then says what is wrong)."""
    from datalines.errors import DataLineError
    from engine.errors import LineError
    from engine.ops.line_end import line_end

    try:
        return line_end(line.path)
    except (LineError, DataLineError, OSError):
        return None


def _finished(line: LostLine, ended: str, notify_command: str | None, dry_run: bool) -> None:
    """A line its trainer finished before its supervisor was lost: recorded as `finished`, not started."""
    from engine.errors import LineError
    from engine.supervisor.lost import record_finished

    words = f"it had finished ({ended}) when its supervisor (pid {line.supervisor_pid}) was lost"
    if dry_run:
        print(f"would record {line.path} as finished ({words})")
        return
    try:
        result = record_finished(line, ended, notify_command)
    except LineError as error:  # another process holds it now: it is that one's
        # The error names the line itself ("LINE: a supervisor already runs this line ..."): said once.
        print(f"left alone: {error}")
        return
    print(f"{line.path}: recorded as finished ({words}); nothing to resume")
    if notify_command and result is not None and not result.delivered:
        # Named as the supervisor names it in run.log: one resume may tell of several lines.
        print(f"nsconsole: {line.path}: notify finished failed: {result.detail}", file=sys.stderr)


def _taken_meanwhile(line: LostLine, error: Exception) -> str | None:
    """Who holds the line now, where its start failed because another process took it after this
    resume judged it lost (a second `resume` at the same boot, a `run`): that process's line, not a
    line this resume failed to start. None when nobody holds it: the start itself failed."""
    from engine.errors import LineError
    from engine.layout import LineLayout
    from engine.supervisor.start import SupervisorSilent
    from engine.training.line_lock import line_holder, refuse_a_held_line

    if isinstance(error, SupervisorSilent):
        return None  # the holder may be this resume's own supervisor, slow to answer
    layout = LineLayout(line.path)
    try:
        refuse_a_held_line(layout)
    except LineError:
        return line_holder(layout)
    except OSError:
        return None  # the directory is gone: the failure stands as it was said
    return None


def _resume(line: LostLine) -> None:
    """Start the line's supervisor as `nsconsole run LINE --engine E [--stop-at N]` would."""
    from engine.supervisor.supervisor import run_line
    from nsconsole.commands.run import refuse_a_bad_start

    refuse_a_bad_start(line.path, check_start=True, again=f"nsconsole run {line.path}")
    run_line(line.path, foreground=False, stop_at=line.stop_at, engine=line.engine)
