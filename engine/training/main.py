"""The trainer as the supervisor launches it: `python -m engine.training.main LINE --parent PID`.

It differs from `nsconsole run LINE --foreground` in two ways only:

- it stops when its supervisor dies: the kernel sends it SIGTERM then (`PR_SET_PDEATHSIG`), and
  the trainer answers a SIGTERM by stopping at the next update boundary with a checkpoint; if
  the supervisor is already gone when this starts, it does not start;
- a line error (bad run.json, too many non-finite updates, a refused resume) is printed as one
  line `nsconsole: <message>` and exits with `TrainerExitCode.LINE_ERROR`, which the supervisor reads as
  "relaunching will not help"; a trainer that left the GPU to other processes (`GpuBusy`) exits
  with `TrainerExitCode.GPU_BUSY`, which it reads as "relaunch once the GPU is free"; one that
  stopped for a full disk (`DiskFull`) with `TrainerExitCode.DISK_FULL` (the line stops for the
  operator, since a relaunch would stop again at once).

Its stdout and stderr are the line's run.log (the supervisor opens it); the GPU lease's
descriptor, when there is one, was handed over by the supervisor and is held until this exits.

At `parallel.degree` > 1 it is one rank of a torchrun group (engine.training.distributed): it stops
when torchrun dies (torchrun stops when the supervisor does), and it leaves its exit status in
`<line>/ranks/` (engine.supervisor.child), since torchrun's own status is 1 whatever its ranks said.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from engine.protocol.facts import ENGINE_CHOICES, Engine, TrainerExitCode
from engine.supervisor.child import die_with_group, die_with_parent, record_exit


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.training.main")
    parser.add_argument("line")
    parser.add_argument("--parent", type=int, required=True, help="the supervisor's pid")
    parser.add_argument("--stop-at", type=int, default=None)
    parser.add_argument("--engine", choices=ENGINE_CHOICES, default=Engine.AUTO.value)
    args = parser.parse_args(argv)
    rank = os.environ.get("RANK")  # set by torchrun
    with_supervisor = die_with_parent(args.parent) if rank is None else die_with_group(args.parent)
    if not with_supervisor:
        print("nsconsole: the supervisor exited before the trainer started", file=sys.stderr)
        return 128 + signal.SIGTERM
    code = train(args)
    if rank is not None:
        record_exit(Path(args.line), int(rank), code)
    return code


def train(args: argparse.Namespace) -> int:
    """Run the trainer; its exit status (see the module docstring)."""
    # Imported after the check: torch takes seconds to import.
    import logging

    import psutil

    from datalines.errors import DataLineError
    from engine.errors import DiskFull, LineError, disk_full_error
    from engine.gpu.sharing import GpuBusy
    from engine.training.disk_full import report_disk_full, say
    from engine.training.trainer import Trainer

    # A library's log handler that cannot write (W&B's, to run.log on a full disk) must not print a
    # traceback into run.log: the trainer reports the full disk in one line itself.
    logging.raiseExceptions = False
    try:
        # The start-up's breakdown (run.log, startup.jsonl) counts from the process's start: the
        # interpreter and torch's import are a relaunch's first seconds too.
        began = psutil.Process().create_time()
        trainer = Trainer(args.line, stop_at=args.stop_at, echo=None, engine=args.engine, process_began=began,
                          owns_process=True)
        return trainer.run()
    except DiskFull as error:
        say(f"nsconsole: {error}")  # the disk is full: a print could fail in turn
        return TrainerExitCode.DISK_FULL
    except GpuBusy as error:
        print(f"nsconsole: {error}", file=sys.stderr, flush=True)
        return TrainerExitCode.GPU_BUSY
    except (LineError, DataLineError) as error:
        print(f"nsconsole: {error}", file=sys.stderr, flush=True)
        return TrainerExitCode.LINE_ERROR
    except OSError as error:
        full = disk_full_error(error)
        if full is None:
            raise
        return report_disk_full(args.line, full)  # between checkpoints: a rows.jsonl append, a beat, run.log


if __name__ == "__main__":
    raise SystemExit(main())
