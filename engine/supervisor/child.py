"""A child of the supervisor that ends with it, alone or as a torchrun group.

`die_with_parent(PID)` sets `PR_SET_PDEATHSIG` to SIGTERM (the kernel sends it when the parent
dies, however it dies) and checks that `PID` is still the parent (one that died before the prctl
would otherwise go unnoticed). The trainer (`engine/training/main.py`) and the supervisor's other
children (`engine/supervisor/children.py`) call it first. A SIGTERM stops each cleanly: the
trainer at its next update with a checkpoint, the preparer with its status saying `stopped`.

A line at `parallel.degree` > 1 is a group: the supervisor starts torchrun through this module
(`python -m engine.supervisor.child PID -- torchrun ...`, which sets the death signal and execs
torchrun, so torchrun gets SIGTERM when the supervisor dies and forwards it to its ranks), and
each rank, torchrun's child, calls `die_with_group(PID)`: SIGTERM when torchrun dies.

torchrun exits 1 whatever status its ranks ended with, so each rank leaves its status in
`<line>/ranks/rank<r>.exit` (`record_exit`), and the supervisor reads the group's (`group_exit`).

torchrun also gives every rank `OMP_NUM_THREADS=1` where the environment names none (and prints a
banner into run.log saying so): a CPU line's ranks would each train on one thread whatever the
host's cores. The group's environment (`group_environment`) names the host's cores instead, and
each CPU rank, holding a seat among the host's CPU trainers as any CPU trainer does
(engine.training.cpu_share), runs its share of them; a GPU line's ranks keep torchrun's 1.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import psutil

PR_SET_PDEATHSIG = 1

RANKS_DIR = "ranks"
"""The line's directory of its ranks' own files (exit statuses; the other ranks' logs and heartbeats)."""


def rank_file(line: Path, rank: int, name: str) -> Path:
    """`<line>/ranks/rank<r>.<name>` (the directory made when missing)."""
    directory = line / RANKS_DIR
    directory.mkdir(exist_ok=True)
    return directory / f"rank{rank}.{name}"


def _set_death_signal() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def die_with_parent(parent_pid: int) -> bool:
    """Ask for SIGTERM when the parent dies; False when it already has (we were reparented)."""
    _set_death_signal()
    # Checked after the prctl: a parent that died before it would otherwise go unnoticed.
    return os.getppid() == parent_pid


def _parent_of(pid: int) -> int | None:
    """A process's parent pid from /proc (None when it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # `pid (comm) state ppid ...`; comm may hold spaces and parentheses: split after the last one.
    return int(stat.rsplit(")", 1)[1].split()[1])


def die_with_group(supervisor_pid: int) -> bool:
    """A rank of a torchrun group: SIGTERM when torchrun (the parent) dies; False when torchrun is
    no longer the child of `supervisor_pid` (the supervisor died before this started)."""
    _set_death_signal()
    return _parent_of(os.getppid()) == supervisor_pid


def record_exit(line: Path, rank: int, code: int) -> None:
    """Leave this rank's exit status for the supervisor (torchrun's own status does not carry it)."""
    rank_file(line, rank, "exit").write_text(f"{code}\n")


def clear_exits(line: Path) -> None:
    """Before a launch: no status of an earlier group may be read as this one's."""
    directory = line / RANKS_DIR
    if directory.is_dir():
        for path in directory.glob("rank*.exit"):
            path.unlink(missing_ok=True)


def group_exit(line: Path) -> int | None:
    """The group's status: rank 0's when it recorded one, else the lowest rank's that did; None
    when no rank recorded one (each crashed, or was killed)."""
    directory = line / RANKS_DIR
    recorded: dict[int, int] = {}
    for path in directory.glob("rank*.exit") if directory.is_dir() else ():
        try:
            recorded[int(path.name[len("rank") : -len(".exit")])] = int(path.read_text().strip())
        except (OSError, ValueError):
            continue  # half-written by a rank killed meanwhile: not a status
    return recorded[min(recorded)] if recorded else None


THREADS_VARIABLE = "OMP_NUM_THREADS"


def host_cores() -> int:
    """The cores this process may run on: the physical cores (the team torch takes in a process of
    its own), no more than the CPUs of its affinity mask."""
    allowed = len(os.sched_getaffinity(0))
    return max(1, min(psutil.cpu_count(logical=False) or allowed, allowed))


def group_environment(environ: Mapping[str, str] | None, on_cpu: bool) -> dict[str, str]:
    """The environment of a line's torchrun group (`environ`, default this process's): where it sets
    no OMP_NUM_THREADS, the host's cores on a CPU line (its ranks share them out through their
    seats), 1 on a GPU line (torchrun's own default, without its banner in run.log)."""
    child = dict(os.environ if environ is None else environ)
    if THREADS_VARIABLE not in child:
        child[THREADS_VARIABLE] = str(host_cores()) if on_cpu else "1"
    return child


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m engine.supervisor.child PID -- PROGRAM ARGS...`: exec PROGRAM so that it gets
    SIGTERM when process PID (its parent, the supervisor) dies; 143 if PID is already gone."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3 or args[1] != "--":
        print("usage: python -m engine.supervisor.child PID -- PROGRAM [ARGS...]", file=sys.stderr)
        return 2
    if not die_with_parent(int(args[0])):
        print("nsconsole: the supervisor exited before the trainer started", file=sys.stderr)
        return 128 + signal.SIGTERM
    os.execvp(args[2], args[2:])  # the death signal stays set across exec


if __name__ == "__main__":
    raise SystemExit(main())
