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
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence

from engine.protocol.facts import ENGINE_CHOICES, Engine, TrainerExitCode
from engine.supervisor.child import die_with_parent


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.training.main")
    parser.add_argument("line")
    parser.add_argument("--parent", type=int, required=True, help="the supervisor's pid")
    parser.add_argument("--stop-at", type=int, default=None)
    parser.add_argument("--engine", choices=ENGINE_CHOICES, default=Engine.AUTO.value)
    args = parser.parse_args(argv)
    if not die_with_parent(args.parent):
        print("nsconsole: the supervisor exited before the trainer started", file=sys.stderr)
        return 128 + signal.SIGTERM

    # Imported after the check: torch takes seconds to import.
    from datalines.errors import DataLineError
    from engine.errors import DiskFull, LineError
    from engine.gpu.sharing import GpuBusy
    from engine.training.trainer import Trainer

    try:
        return Trainer(args.line, stop_at=args.stop_at, echo=None, engine=args.engine).run()
    except DiskFull as error:
        print(f"nsconsole: {error}", file=sys.stderr, flush=True)
        return TrainerExitCode.DISK_FULL
    except GpuBusy as error:
        print(f"nsconsole: {error}", file=sys.stderr, flush=True)
        return TrainerExitCode.GPU_BUSY
    except (LineError, DataLineError) as error:
        print(f"nsconsole: {error}", file=sys.stderr, flush=True)
        return TrainerExitCode.LINE_ERROR


if __name__ == "__main__":
    raise SystemExit(main())
