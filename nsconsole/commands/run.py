"""`nsconsole run LINE [--foreground] [--stop-at UPDATE]` and its headless form, `nsconsole --run [LINE] [--stop-at UPDATE]`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from engine.config.host import HostSettings
from engine.errors import LineError
from engine.protocol.facts import ENGINE_CHOICES
from nsconsole.commands.parser import add_command

HELP = (
    "LINE [--foreground] [--stop-at UPDATE]: run a line under its supervisor "
    "(in the background unless --foreground)"
)
DESCRIPTION = """\
Run a line under its supervisor. The supervisor launches the trainer and the data preparer,
restarts them after a crash, a hang or a stray SIGTERM, and stops the line with a checkpoint on
request. In the background (the default) the start checks of `nsconsole check` run first (all
but the checkpoints'), so a line its trainer would refuse is refused here, in the terminal, with
a non-zero exit; then the supervisor detaches and this command returns once it answers.
--foreground keeps the supervisor in this terminal and echoes run.log; --no-supervisor trains in
this process alone (no restarts, no data preparer: it refuses a line whose next cycle lacks shards
that no preparer running on the data line rebuilds), a row every print_every updates.
"""
EXAMPLES = """\
examples:
  nsconsole run runs/trunk
  nsconsole run runs/trunk --stop-at 1000 --foreground
  nsconsole run runs/small --no-supervisor --engine eager
  nsconsole --run                 # create (or resume) the demo line and run it in the background
  nsconsole --run runs/trunk --stop-at 1000   # the same as `nsconsole run runs/trunk --stop-at 1000`
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(subparsers, "run", summary=HELP, description=DESCRIPTION, examples=EXAMPLES)
    parser.add_argument("line", metavar="LINE", help="the training line directory")
    parser.add_argument("--foreground", action="store_true", help="supervise in this terminal")
    parser.add_argument(
        "--no-supervisor",
        action="store_true",
        help="train in this process without a supervisor (implies --foreground)",
    )
    parser.add_argument("--stop-at", type=int, default=None, metavar="UPDATE",
                        help="stop cleanly at UPDATE (after the line's latest checkpoint; refused otherwise)")
    parser.add_argument(
        "--engine",
        choices=ENGINE_CHOICES,
        default="auto",
        help="step engine: auto is CUDA graphs on a GPU and eager on the CPU",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    line = args.host_settings.resolve_line(args.line)
    if args.stop_at is not None:
        refuse_a_past_stop_at(line, args.stop_at)
    if args.no_supervisor:
        return train_without_supervisor(line, stop_at=args.stop_at, engine=args.engine)
    from engine.supervisor.supervisor import run_line

    refuse_a_bad_start(line, check_start=not args.foreground)
    return run_line(line, foreground=args.foreground, stop_at=args.stop_at, engine=args.engine)


def refuse_a_bad_start(line: Path, check_start: bool, what: str = "the line", again: str | None = None) -> None:
    """The refusals before a supervisor starts, `run` and `--run` alike: a line directory that takes
    no new file and another holder of the line first, at once (the start checks take seconds:
    torch), then a rows.jsonl or heartbeat that is no file, a finished line, then (`check_start`: a
    detached start, whose checks would otherwise fail unseen) the start checks."""
    from engine.ops.line_end import refuse_a_finished_line
    from engine.ops.lines import open_line, refuse_an_unwritable_line
    from engine.rows import heartbeat_file_problem, rows_file_problem
    from engine.training.line_lock import refuse_a_held_line

    layout = open_line(line)
    refuse_an_unwritable_line(layout, "a run")
    refuse_a_held_line(layout)
    # The files the supervisor itself reads at its start (a foreground start runs no start checks):
    # one that is a directory is refused here in one line, not met as the supervisor's traceback.
    for problem in (rows_file_problem(layout.rows_jsonl), heartbeat_file_problem(layout.heartbeat)):
        if problem is not None:
            raise LineError(problem)
    refuse_a_finished_line(line, what=what, again=again)
    if check_start:
        refuse_a_failing_start(line)


def run_headless(line: str | None, host: HostSettings, *, stop_at: int | None = None, engine: str = "auto") -> int:
    """`nsconsole --run [LINE] [--stop-at UPDATE] [--engine E]`: the supervisor, detached, as
    `nsconsole run LINE` starts it (the same refusals, in the same order); no LINE creates (or
    resumes) the demo line."""
    from engine.supervisor.supervisor import run_line

    if line is not None:
        path = host.resolve_line(line)
        what, again = "the line", f"nsconsole --run {path}"
    else:
        from engine.ops.demo import demo_paths, ensure_demo_line

        path, what, again = ensure_demo_line(demo_paths(host.work_root)), "the demo line", "nsconsole --run"
    if stop_at is not None:
        refuse_a_past_stop_at(path, stop_at)
    refuse_a_bad_start(path, check_start=True, what=what, again=again)
    status = run_line(path, foreground=False, stop_at=stop_at, engine=engine)
    if status == 0 and line is None:
        print(f"watch it: nsconsole        (or: nsconsole status {path}; stop it: nsconsole stop {path})")
    return status


def train_without_supervisor(line: Path, *, stop_at: int | None, engine: str) -> int:
    """`nsconsole run LINE --no-supervisor`: the trainer in this process, holding the line for its life
    (no supervisor starts on it meanwhile, `engine.training.line_lock`). The hold is taken before the
    trainer's modules load torch (seconds): a line someone else holds is refused at once."""
    from engine.ops.lines import open_line, refuse_an_unwritable_line
    from engine.training.line_lock import hold_line

    layout = open_line(line)
    refuse_an_unwritable_line(layout, "a run")  # the lock itself is a file it makes there
    hold = hold_line(layout)
    try:
        from engine.ops.cycle_check import start_without_preparer
        from engine.ops.line_end import refuse_a_finished_line

        # As `run` refuses it: a trainer would load torch, resume, and stop at once with status 0.
        refuse_a_finished_line(line, refused="trainer")
        from engine.training.trainer import Trainer

        warning = start_without_preparer(line)
        if warning is not None:
            print(f"nsconsole: warning: {warning}", file=sys.stderr)
        return Trainer(line, stop_at=stop_at, engine=engine, owns_process=True).run()
    finally:
        os.close(hold)


def refuse_a_past_stop_at(line: Path, stop_at: int) -> None:
    """`LineError` (one line) when --stop-at names an update the line has reached: its trainer would
    resume there, stop at once and the line end as `finished`, which reads as a stop served.

    The update is that of the checkpoint the trainer resumes from, not the name `latest` holds: a
    `latest` naming a checkpoint that is gone (or damaged) falls back to the newest one before it,
    and a --stop-at past that one is a valid request."""
    from engine.checkpoints.format import read_latest, resume_candidate, update_of
    from engine.ops.lines import open_line

    checkpoints = open_line(line).checkpoints
    resume = resume_candidate(checkpoints)
    if resume is None:
        current, where = 0, "it has no checkpoint yet"
    else:
        current = update_of(resume) or 0
        named = resume.name == read_latest(checkpoints)
        where = "its latest checkpoint" if named else f"{resume.name}, the checkpoint a start resumes from"
    if stop_at <= current:
        raise LineError(
            f"--stop-at {stop_at}: the line is at update {current} already ({where}); give a later update"
        )


def refuse_a_failing_start(line: Path) -> None:
    """`LineError` (one line, every failure) when a start check that the trainer would fail on
    fails: said here before the supervisor detaches, not as a success and a failure in
    supervisor.out seconds later. The checkpoints are not verified (hashing them all takes long,
    and the trainer's start skips a bad one itself)."""
    from engine.ops.check import check_line  # torch: the checks size the line's model

    _config, results = check_line(line, verify_checkpoints=False)
    failures = [result.message for result in results if not result.ok]
    if failures:
        raise LineError(
            f"{line}: not started, a start check fails: {'; '.join(failures)} "
            f"(`nsconsole check {line}` lists every check)"
        )
