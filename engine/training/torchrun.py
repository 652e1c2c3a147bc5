"""torchrun for a line's group, ended by a signal without a traceback.

The supervisor starts a line at `parallel.degree` N > 1 as `python -m engine.training.torchrun
<torchrun's arguments>` (through engine.supervisor.child): torch.distributed.run's own `main`. A
signal to torchrun (the supervisor's SIGTERM for a stop, a rollback or a tune, the terminal's
SIGINT under `nsconsole run --foreground`) makes it stop its ranks, which checkpoint and leave, and
then raise `SignalException` out of its main: uncaught, that printed some forty lines of traceback
into run.log (two, chained, when a SIGTERM followed a Ctrl-C) after every stop, rollback and tune,
reading like a crash where nothing had failed. Here it ends torchrun with 128 + the signal instead;
torchrun's own warnings that it forwards the signal stay. The supervisor reads the group's status
from the ranks' own records (engine.supervisor.child.group_exit), not from torchrun's.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main as torchrun_main


def main(argv: Sequence[str] | None = None) -> int:
    """torchrun with `argv` (default: this process's arguments); 128 + the signal that ended it."""
    try:
        torchrun_main(list(sys.argv[1:] if argv is None else argv))
    except SignalException as stopped:
        return 128 + int(stopped.sigval)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
