"""`nsconsole run LINE [--foreground] [--stop-at UPDATE]` and `nsconsole --run [LINE]`."""

from __future__ import annotations

import argparse

from engine.config.host import HostSettings
from engine.protocol.facts import ENGINE_CHOICES

HELP = (
    "LINE [--foreground] [--stop-at UPDATE]: run a line under its supervisor "
    "(in the background unless --foreground)"
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run",
        help=HELP,
        description=(
            HELP + ". The supervisor launches the trainer and the data preparer, restarts them after a "
            "crash, a hang or a stray SIGTERM, and stops the line with a checkpoint on request. "
            "--foreground keeps the supervisor in this terminal and echoes run.log; --no-supervisor "
            "trains in this process alone (no restarts), a row every print_every updates. "
            "Example: nsconsole run runs/trunk"
        ),
    )
    parser.add_argument("line", help="the training line's directory")
    parser.add_argument("--foreground", action="store_true", help="supervise in this terminal")
    parser.add_argument(
        "--no-supervisor",
        action="store_true",
        help="train in this process without a supervisor (implies --foreground)",
    )
    parser.add_argument("--stop-at", type=int, default=None, metavar="UPDATE", help="stop cleanly at UPDATE")
    parser.add_argument(
        "--engine",
        choices=ENGINE_CHOICES,
        default="auto",
        help="step engine: auto is CUDA graphs on a GPU and eager on the CPU",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    line = args.host_settings.resolve_line(args.line)
    if args.no_supervisor:
        from engine.layout import LineLayout
        from engine.training.line_lock import refuse_if_supervised
        from engine.training.trainer import Trainer

        refuse_if_supervised(LineLayout(line))
        return Trainer(line, stop_at=args.stop_at, engine=args.engine).run()
    from engine.supervisor.supervisor import run_line

    return run_line(line, foreground=args.foreground, stop_at=args.stop_at, engine=args.engine)


def run_headless(line: str | None, host: HostSettings) -> int:
    """`nsconsole --run [LINE]`: the supervisor, detached; no LINE creates (or resumes) the demo line."""
    from engine.supervisor.supervisor import run_line

    if line is not None:
        return run_line(host.resolve_line(line), foreground=False)
    from engine.ops.demo import demo_paths, ensure_demo_line

    demo = ensure_demo_line(demo_paths(host.work_root))
    status = run_line(demo, foreground=False)
    if status == 0:
        print(
            "watch it: nsconsole        "
            f"(or: nsconsole status {demo}; stop it: nsconsole stop {demo})"
        )
    return status
