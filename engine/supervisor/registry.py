"""Discovery: every running supervisor on this host registers itself where the console looks.

An entry is `<run dir>/<id>.json` with the line's path, its socket, the supervisor's pid and that
process's start time; `<id>` is derived from the line's real path, so a line has one entry at
most. The GPU lease's lock files live in the same directory (`engine/gpu/devices.py`).

The run dir is `<base>/<host name>`, the base being `$NSCONSOLE_RUN`, else `~/.nsconsole/run` in
the user's home as the password database names it (not `$HOME`, which a `sudo` or a service may
change): every process of the user on this host must agree on it, or two lines could flock
different files for the same GPU. It is not `$XDG_RUNTIME_DIR`: systemd-logind removes that at
the user's last logout, and with it every entry (the console would list nothing) and every lock
file (a second line would lock a new file and take a GPU in use). The host name keeps hosts that
share a home over NFS apart: another host's pids mean nothing here. Both directories are the
user's own, mode 0700, and are refused if someone else owns them (a planted directory would
otherwise redirect the console). Entries written by older versions under `$XDG_RUNTIME_DIR` are
not read: their supervisors hold their GPU leases there, which no newer line would see anyway;
restart such lines after upgrading.

`list_supervisors()` drops stale entries: the pid is gone, or it now belongs to another process
(its start time differs: the pid was reused). Start times are compared as seconds since boot where
psutil gives them: the wall-clock start time psutil derives moves with every step of the clock, and
a 0.05 s step once made a live supervisor's entry look stale, and the console removed it.

An entry goes once its supervisor exits, so each supervisor also remembers its line in a history
that lasts: `<history dir>/<id>.json`, the history dir being `$NSCONSOLE_HISTORY`, else
`~/.nsconsole/history`. The console lists the lines there that have ended, to open and resume them.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import socket
import stat
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from engine.atomic import write_text_atomic
from engine.errors import LineError
from engine.process_start import SAME_START_TOLERANCE_S, started_as_recorded, started_since_boot

RUN_ENV_VARIABLE = "NSCONSOLE_RUN"
"""Names the run directory's base in place of the home's `DEFAULT_RUN_SUBDIR` (tests point it at their own)."""
DEFAULT_RUN_SUBDIR = Path(".nsconsole/run")
HISTORY_ENV_VARIABLE = "NSCONSOLE_HISTORY"
"""Names the history directory in place of `DEFAULT_HISTORY_DIR` (tests point it at their own)."""
DEFAULT_HISTORY_DIR = Path("~/.nsconsole/history")


def runtime_dir() -> Path:
    """`<run base>/<host name>`, created 0700 if missing; `LineError` if it is not safely ours."""
    base_env = os.environ.get(RUN_ENV_VARIABLE)
    base = Path(base_env) if base_env else Path(pwd.getpwuid(os.getuid()).pw_dir) / DEFAULT_RUN_SUBDIR
    host = "".join(c if c.isalnum() or c in "-_." else "_" for c in socket.gethostname()) or "localhost"
    directory = base / host
    for path in (base, directory):
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            info = os.lstat(path)
        except OSError as error:
            raise LineError(f"{path}: cannot create the run directory ({error})") from None
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            raise LineError(f"{path}: not a directory owned by uid {os.getuid()}; refusing to use it")
        if info.st_mode & 0o077:
            os.chmod(path, 0o700)
    return directory


def line_id(line: Path | str) -> str:
    """The registry id of a line: a digest of its real path, plus its name for the reader."""
    real = os.path.realpath(line)
    digest = hashlib.blake2b(real.encode(), digest_size=8).hexdigest()
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(real).name)[:40]
    return f"{name}-{digest}"


@dataclass(frozen=True)
class SupervisorEntry:
    """One registered supervisor."""

    id: str
    """The entry's file name without `.json` (`line_id` of the line)."""
    line: str
    """The training line's directory (real path)."""
    socket: str
    """Its supervisor socket."""
    pid: int
    """The supervisor's pid."""
    create_time: float
    """The supervisor process's start time as psutil reports it (detects a reused pid)."""
    started: float
    """When the supervisor registered (Unix time)."""
    boot_start: float | None = None
    """The supervisor process's start in seconds since boot, which no wall-clock step moves:
    `create_time` is the boot time plus this, and the boot time read after an NTP step or a resumed
    VM moves by the step. None in an entry of an older version: `create_time` decides then."""

    def is_alive(self) -> bool:
        try:
            process = psutil.Process(self.pid)
            if self.boot_start is not None:
                return started_as_recorded(process, self.boot_start)
            return abs(process.create_time() - self.create_time) <= SAME_START_TOLERANCE_S
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            return False
        except psutil.AccessDenied:
            return True  # it exists; another user's process would not be in our directory anyway


def register(line: Path | str, socket_path: Path | str, pid: int | None = None) -> SupervisorEntry:
    """Announce this process (or `pid`) as `line`'s supervisor; returns the entry written."""
    pid = os.getpid() if pid is None else pid
    process = psutil.Process(pid)
    entry = SupervisorEntry(
        id=line_id(line),
        line=os.path.realpath(line),
        socket=os.path.realpath(socket_path),
        pid=pid,
        create_time=process.create_time(),
        started=time.time(),
        boot_start=started_since_boot(process),
    )
    write_text_atomic(runtime_dir() / f"{entry.id}.json", json.dumps(asdict(entry), indent=1) + "\n")
    return entry


def unregister(entry: SupervisorEntry) -> None:
    """Remove `entry` if it is still the one registered (a newer supervisor's is left alone)."""
    path = runtime_dir() / f"{entry.id}.json"
    current = _read_entry(path)
    if current is not None and (current.pid, current.create_time) == (entry.pid, entry.create_time):
        path.unlink(missing_ok=True)


def list_supervisors() -> list[SupervisorEntry]:
    """Every live registered supervisor, sorted by line; stale and unreadable entries are removed."""
    directory = runtime_dir()
    alive = []
    for path in sorted(directory.glob("*.json")):
        entry = _read_entry(path)
        if entry is not None and entry.is_alive():
            alive.append(entry)
            continue
        # Re-read before removing: a supervisor may have re-registered this line meanwhile.
        if _read_entry(path) == entry:
            path.unlink(missing_ok=True)
    return sorted(alive, key=lambda entry: entry.line)


def find_supervisor(line: Path | str) -> SupervisorEntry | None:
    """The live supervisor of `line`, if one is registered."""
    entry = _read_entry(runtime_dir() / f"{line_id(line)}.json")
    return entry if entry is not None and entry.is_alive() else None


def history_dir() -> Path:
    """Where lines are remembered: `$NSCONSOLE_HISTORY`, else `~/.nsconsole/history`."""
    return Path(os.environ.get(HISTORY_ENV_VARIABLE) or DEFAULT_HISTORY_DIR).expanduser()


def remember_line(line: Path | str) -> Path:
    """Record `line` in the history (once per line: its entry is rewritten); the entry's path.

    `LineError` naming the file when it cannot be written (the supervisor says so and runs on).
    """
    real = os.path.realpath(line)
    path = history_dir() / f"{line_id(real)}.json"
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps({"line": real, "registered": time.time()}, indent=1) + "\n")
    except OSError as error:
        raise LineError(f"{path}: cannot record the line in the history ({error})") from None
    return path


def remembered_lines() -> list[str]:
    """Every line in the history (real paths, sorted); unreadable entries are left out."""
    lines = set()
    try:
        paths = sorted(history_dir().glob("*.json"))
    except OSError:
        return []
    for path in paths:
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
            lines.add(str(record["line"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(lines)


def _read_entry(path: Path) -> SupervisorEntry | None:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        return SupervisorEntry(
            id=str(record["id"]),
            line=str(record["line"]),
            socket=str(record["socket"]),
            pid=int(record["pid"]),
            create_time=float(record["create_time"]),
            started=float(record["started"]),
            boot_start=None if record.get("boot_start") is None else float(record["boot_start"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
