"""`nsconsole status` with no LINE, or with a directory of lines: one line of report per line.

A host that runs a trunk, its branches and other experiments for weeks has a dozen lines; the
console shows them all, but over ssh or from cron a user wants them in one command. Each line gets
the state `nsconsole status LINE` prints first (whether its supervisor runs, what a failure said),
where it stands (its trainer's last update) and, for a branch, the line it was forked from; a trunk's
branches follow it. The exit status is the one a cron job needs: 3 when any line needs its operator.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from engine.protocol.facts import StatusExitCode

if TYPE_CHECKING:
    from engine.config.host import HostSettings
    from engine.ops.status import LineStatus


def lines_in(directory: Path) -> list[Path]:
    """The training lines directly under `directory` (each holds a run.json), by name."""
    try:
        children = sorted(directory.iterdir())
    except OSError:
        return []
    return [child for child in children if (child / "run.json").is_file()]


def host_lines(settings: HostSettings) -> list[Path]:
    """Every line of this host: those the console lists (the work roots, the demo's root, every line a
    supervisor ran here, the running ones) and the lines in the work roots never started yet."""
    from engine.supervisor.registry import list_supervisors
    from nsconsole.history import line_candidates, work_roots

    found = {os.path.realpath(entry.line) for entry in list_supervisors()}
    found.update(line_candidates(settings))
    for root in work_roots(settings):
        found.update(os.path.realpath(line) for line in lines_in(root))
    return [Path(line) for line in sorted(found)]


def overview(paths: Iterable[Path]) -> tuple[list[str], StatusExitCode]:
    """The report's lines (one per line, each branch after its trunk, then a count) and its exit status."""
    from engine.errors import LineError
    from engine.ops.status import line_status
    from nsconsole.lines.family import lineage

    statuses: list[LineStatus] = []
    report: list[str] = []
    for path in paths:
        try:
            statuses.append(line_status(path, rows=0))
        except LineError as error:  # removed, or no longer a line, since it was found
            report.append(str(error))
    if not statuses and not report:
        return ["no training line found (looked in host.json's work_root, the demo's root and every line "
                "a supervisor has run on this host)"], StatusExitCode.OK  # fmt: skip
    parents = {str(status.root): status.parent for status in statuses}
    statuses.sort(key=lambda status: lineage(str(status.root), parents))
    report = [overview_line(status) for status in statuses] + report
    running = sum(1 for status in statuses if status.supervisor_pid is not None or status.lone_trainer_pid is not None)
    needing = [status for status in statuses if status.needs_operator]
    invalid = [status for status in statuses if status.config is None]
    count = f"{len(statuses)} line(s): {running} running"
    if needing:
        count += f", {len(needing)} need you"
    if invalid:
        count += f", {len(invalid)} with an invalid run.json"
    report.append(f"{count} (`nsconsole status LINE` gives one line's whole report)")
    if needing:
        return report, StatusExitCode.NEEDS_OPERATOR
    return report, StatusExitCode.INVALID_RUN_JSON if invalid else StatusExitCode.OK


def overview_line(status: LineStatus) -> str:
    """`PATH (update N): STATE; branch of TRUNK; ...`: what a line of many needs said in one line (the
    update its trainer last beat at, else its checkpoint `latest`'s)."""
    from nsconsole.commands.status import state_line

    update = (status.heartbeat or {}).get("update")
    if not isinstance(update, int) or isinstance(update, bool):  # no trainer has beaten: where it would start
        update = int(status.latest[1:]) if status.latest and status.latest[1:].isdigit() else None
    where = "" if update is None else f" (update {update})"
    text = f"{status.root}{where}: {state_line(status).removeprefix('state: ')}"
    if status.parent is not None:
        text += f"; branch of {status.parent}"
    if status.queued_forks:
        text += "; queued branches: " + ", ".join(
            f"{fork['path']} at the end of cycle {fork['at_cycle']}" for fork in status.queued_forks
        )
    if status.data_wait is not None:
        text += f"; {status.data_wait}"
    if status.config is None:
        text += f"; run.json INVALID: {status.config_error}"
    return text
