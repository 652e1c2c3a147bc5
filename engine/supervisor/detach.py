"""Start a process that outlives the login: its own session, no terminal, output to a file.

`spawn_detached` starts the command with `setsid` (a new session and process group, so the
terminal's hangup and the shell's job control never reach it), stdin from /dev/null and stdout
and stderr appended to a file (the line's supervisor.out). Nothing else from the parent is
inherited: Python's own descriptors are close-on-exec, and those the parent was given inheritable
(`nsconsole run` under a shell's `3>file`, an ssh or CI runner's pipes) are closed in the child, or a
supervisor of weeks would hold them open, and whatever waits for their end with it.

A new session is not enough where systemd-logind ends the login's processes itself: with
`KillUserProcesses=yes` it kills the session's whole cgroup at logout, with `StopIdleSessionSec`
it stops idle sessions, and a process started inside the user's service manager dies with it at
logout unless the user lingers. `logind_refusal()` recognises those cases and says instead how
to start the line as a service (`systemd-run --user ...`).
"""

from __future__ import annotations

import configparser
import getpass
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.errors import LineError

LOGIND_CONF_FILES = (Path("/etc/systemd/logind.conf"),)
LOGIND_CONF_DIRS = (
    Path("/usr/lib/systemd/logind.conf.d"),
    Path("/usr/local/lib/systemd/logind.conf.d"),
    Path("/run/systemd/logind.conf.d"),
    Path("/etc/systemd/logind.conf.d"),
)


def spawn_detached(
    argv: Sequence[str],
    output: Path | str,
    env: dict[str, str] | None = None,
) -> int:
    """Start `argv` in a new session without a terminal, output appended to `output`; its pid.

    The child is not waited for: once this process exits it belongs to init (or the subreaper).
    """
    executable = argv[0] if os.sep in argv[0] else _which(argv[0])
    file_actions = [
        (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
        (os.POSIX_SPAWN_OPEN, 1, str(output), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644),
        (os.POSIX_SPAWN_DUP2, 1, 2),
        *((os.POSIX_SPAWN_CLOSE, fd) for fd in _inheritable_descriptors()),
    ]
    environment = dict(os.environ if env is None else env)
    return os.posix_spawn(executable, list(argv), environment, file_actions=file_actions, setsid=True)


def _inheritable_descriptors() -> list[int]:
    """This process's open descriptors past stderr that an exec would pass on."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2:
            try:
                if os.get_inheritable(fd):
                    found.append(fd)
            except OSError:
                continue  # the listing's own descriptor, closed by now
    return found


def _which(name: str) -> str:
    for directory in os.environ.get("PATH", os.defpath).split(os.pathsep):
        candidate = os.path.join(directory, name)
        if os.access(candidate, os.X_OK) and not os.path.isdir(candidate):
            return candidate
    raise LineError(f"{name}: command not found on PATH")


@dataclass(frozen=True)
class LogindFacts:
    """What decides whether systemd-logind would end a process started from this login."""

    systemd: bool
    """systemd is the init system (/run/systemd/system exists)."""
    cgroup: str
    """This process's unified cgroup path (from /proc/self/cgroup)."""
    linger: bool | None
    """`loginctl show-user -p Linger`; None when loginctl could not say."""
    kill_user_processes: bool
    """logind.conf's KillUserProcesses (systemd's default: no)."""
    kill_exclude_users: tuple[str, ...]
    """logind.conf's KillExcludeUsers (root by default)."""
    kill_only_users: tuple[str, ...]
    """logind.conf's KillOnlyUsers (empty: everyone)."""
    stop_idle_session: bool
    """logind.conf sets StopIdleSessionSec to a finite time."""
    user: str
    """The user name."""


def gather_logind_facts() -> LogindFacts:
    """Read the facts from this machine."""
    user = getpass.getuser()
    settings = _logind_settings()
    return LogindFacts(
        systemd=Path("/run/systemd/system").is_dir(),
        cgroup=_own_cgroup(),
        linger=_linger(user),
        kill_user_processes=_is_yes(settings.get("killuserprocesses", "no")),
        kill_exclude_users=tuple(settings.get("killexcludeusers", "root").split()),
        kill_only_users=tuple(settings.get("killonlyusers", "").split()),
        stop_idle_session=settings.get("stopidlesessionsec", "infinity").strip() not in ("", "infinity", "0"),
        user=user,
    )


def logind_refusal(facts: LogindFacts, line: Path | str, argv: Sequence[str]) -> str | None:
    """Why a detached start from here would not survive the login, with the command that would;
    None when it would survive."""
    if not facts.systemd:
        return None
    in_session = re.search(r"/session-[^/]+\.scope(/|$)", facts.cgroup) is not None
    in_user_manager = re.search(r"/user@\d+\.service(/|$)", facts.cgroup) is not None
    killed_by_policy = (
        facts.kill_user_processes
        and facts.user not in facts.kill_exclude_users
        and (not facts.kill_only_users or facts.user in facts.kill_only_users)
    )
    if in_session and killed_by_policy:
        reason = "systemd-logind kills this login's processes at logout (KillUserProcesses=yes)"
    elif in_session and facts.stop_idle_session:
        reason = "systemd-logind stops this login's session when it is idle (StopIdleSessionSec)"
    elif in_user_manager and facts.linger is False:
        reason = f"this runs inside {facts.user}'s service manager, which stops at logout (Linger=no)"
    else:
        return None
    command = service_command(facts, line, argv)
    return f"refusing to start in the background: {reason}; start it as a service instead: {command}"


def service_command(facts: LogindFacts, line: Path | str, argv: Sequence[str]) -> str:
    """The exact command that runs `argv` as a user service that survives logout."""
    unit = "nsconsole-" + re.sub(r"[^A-Za-z0-9_.-]", "_", Path(os.path.realpath(line)).name)
    run = [
        "systemd-run", "--user", f"--unit={unit}", "--same-dir", "--collect",
        # The supervisor gets the SIGTERM (and stops the trainer with a checkpoint); the rest of
        # the unit is killed only after the stop timeout.
        "--property=KillMode=mixed", "--property=TimeoutStopSec=900",
        f"--setenv=PATH={os.environ.get('PATH', os.defpath)}",
        *argv,
    ]
    command = shlex.join(run)
    if facts.linger is not True:
        # Without linger the user's service manager (and the unit) stops at logout too.
        command = f"loginctl enable-linger {shlex.quote(facts.user)} && {command}"
    return command


def foreground_argv(line: Path | str) -> list[str]:
    """The command a service runs: this Python, the supervisor in the foreground."""
    return [sys.executable, "-m", "engine.supervisor.supervisor", os.path.realpath(line), "--foreground"]


def _own_cgroup() -> str:
    try:
        for entry in Path("/proc/self/cgroup").read_text().splitlines():
            if entry.startswith("0::"):
                return entry[3:]
    except OSError:
        pass
    return ""


def _linger(user: str) -> bool | None:
    try:
        completed = subprocess.run(
            ["loginctl", "show-user", user, "-p", "Linger", "--value"],
            capture_output=True, text=True, timeout=10, check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    value = completed.stdout.strip()
    return _is_yes(value) if completed.returncode == 0 and value else None


def _logind_settings() -> dict[str, str]:
    """logind.conf's [Login] settings after its drop-ins (later files win), keys lower-cased."""
    files = [path for path in LOGIND_CONF_FILES if path.is_file()]
    drop_ins: dict[str, Path] = {}
    for directory in LOGIND_CONF_DIRS:
        if directory.is_dir():
            for path in directory.glob("*.conf"):
                drop_ins[path.name] = path  # a later directory overrides a same-named drop-in
    files += [drop_ins[name] for name in sorted(drop_ins)]
    settings: dict[str, str] = {}
    for path in files:
        parser = configparser.ConfigParser(strict=False, interpolation=None)
        try:
            parser.read(path, encoding="utf-8")
        except (configparser.Error, OSError, UnicodeDecodeError):
            continue
        if parser.has_section("Login"):
            settings.update({key.lower(): value for key, value in parser.items("Login")})
    return settings


def _is_yes(value: str) -> bool:
    return value.strip().lower() in ("1", "yes", "true", "on")
