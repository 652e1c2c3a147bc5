"""`nsconsole status LINE`: a line's state from its files."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.errors import LineError
from engine.protocol.facts import FAULT_LINE_STATES, FINAL_LINE_STATES, LineState, StatusExitCode
from nsconsole.commands.parser import add_command, positive_int

if TYPE_CHECKING:
    from engine.ops.status import LineStatus

HELP = ("[LINE]: state, configuration, newest rows, heartbeat, checkpoints, pending stop and disk use of a "
        "line; every line of the host in one line each")
DESCRIPTION = f"""\
Show a line's state from its files: its supervisor's state (supervisor.json: training, stopped,
finished, failed, disk-full, ...; whether that supervisor runs now) and, for a line not ended, its
last event and how long ago (a preparer failing, a long wait for data, ...), the branches forked from it
and queued on it, the line it was branched from, the configuration in brief, the newest rows of rows.jsonl, the
trainer's heartbeat and its age (while it waits for a data cycle, why the data line's preparer
waits too: free disk, say), the checkpoints present (and the one a start resumes from when
`latest` names one that is gone or damaged: the newest whose files are there at their sizes, not
verified: `nsconsole check` hashes them), a pending STOP, the disk the line uses (its checkpoints' part)
and what its disk has free.

With no LINE, or with a directory of lines, one line each: the state, the update it stands at and
the line a branch was forked from, for every line of this host (those the console lists, and the
lines in host.json's work_root never started) or under that directory; each branch follows its trunk.
Its exit status is the worst of theirs: 3 when any needs you, else 1 when any run.json is invalid.

exit status, for a script or a cron job that reads no report:
  {StatusExitCode.OK:d}  nothing to do: a supervisor (or a trainer run without one) runs the line, whatever it does
     or waits for, or the line rests where it was left: finished, stopped on request, never run
  {StatusExitCode.INVALID_RUN_JSON:d}  run.json is invalid, whatever the state: the line would not start again (the report
     names the problem and shows the rest)
  {StatusExitCode.USER_ERROR:d}  the command was refused: LINE is not a training line (one line on stderr)
  {StatusExitCode.NEEDS_OPERATOR:d}  the line needs you (as `systemctl status` exits 3 for a unit not running): it failed,
     got stuck or filled the disk, or its supervisor is gone without saving a final state (killed,
     the host rebooted: `nsconsole resume` starts it again), or its supervisor.json is damaged
"""
EXAMPLES = """\
examples:
  nsconsole status runs/trunk
  nsconsole status runs/trunk --rows 20
  nsconsole status               # every line of this host, one line each
  nsconsole status runs          # the lines in runs/
"""

ROW_COLUMNS = ("update", "stage", "cycle", "tokens", "loss", "lr", "grad_norm", "tokens_per_s")
"""The row keys shown (as the trainer writes them), in this order."""
FALLBACK_COLUMNS = 6
"""Scalars shown from a row that has none of ROW_COLUMNS."""
CHECKPOINTS_SHOWN = 3
"""Checkpoint names listed, the newest (a line keeps more: every cycle end, its start, ...)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(subparsers, "status", summary=HELP, description=DESCRIPTION, examples=EXAMPLES)
    parser.add_argument("line", metavar="LINE", nargs="?",
                        help="the training line directory (none: every line of this host; a directory of lines: those)")
    # At least 1: with none read, the report would say "rows: none yet" of a line that has rows.
    parser.add_argument("--rows", type=positive_int, default=5, metavar="N", help="newest rows to show (default 5)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine.ops.status import line_status
    from nsconsole.commands.status_overview import host_lines, lines_in, overview

    if args.line is None:
        return _print_overview(overview(host_lines(args.host_settings)))
    path = args.host_settings.resolve_line(args.line)
    if not (path / "run.json").exists() and path.is_dir():
        lines = lines_in(path)
        if not lines:  # neither a line nor a directory of lines: say both, not only "no run.json"
            raise LineError(f"{path}: not a training line (no run.json), and no line directly under it")
        return _print_overview(overview(lines))
    status = line_status(path, rows=args.rows)
    for line in format_status(status):
        print(line)
    return exit_status(status)


def _print_overview(report: tuple[list[str], StatusExitCode]) -> int:
    for line in report[0]:
        print(line)
    return report[1]


def exit_status(status: LineStatus) -> StatusExitCode:
    """What the report says for a script: an invalid run.json first (a line that would not start
    again needs fixing whatever its state), then whether the line needs its operator."""
    if status.config is None:
        return StatusExitCode.INVALID_RUN_JSON
    return StatusExitCode.NEEDS_OPERATOR if status.needs_operator else StatusExitCode.OK


def format_status(status: LineStatus) -> list[str]:
    """The lines `nsconsole status` prints."""
    lines = [f"line: {status.root}", state_line(status)]
    event = last_event_line(status)
    if event is not None:
        lines.append(event)
    if status.parent is not None:
        lines.append(f"branch of: {status.parent}")
    if status.branches:
        lines.append(f"branches: {', '.join(status.branches)}")
    if status.queued_forks:
        queued = (f"{fork['path']} at the end of cycle {fork['at_cycle']}" for fork in status.queued_forks)
        lines.append(f"queued branches: {', '.join(queued)}")
    config = status.config
    if config is None:
        lines.append(f"run.json: INVALID: {status.config_error}")
    else:
        stages = ", ".join(
            f"{stage.name} at {stage.seq_len} for "
            + ("the rest of the data" if stage.tokens is None else f"{stage.tokens:.4g} tokens")
            for stage in config.plan
        )
        ramp = config.tokens_per_update
        if not isinstance(ramp, int):
            ramp = "a ramp of " + ", ".join(str(piece.tokens) for piece in ramp)
        lines.append(f"model: {config.model.preset} {json.dumps(config.model.overrides, sort_keys=True)}")
        lines.append(f"data: {config.data.line}")
        lines.append(f"plan: {stages}")
        parallel = config.parallel
        ranks = "" if parallel.degree == 1 else f"; {parallel.degree} ranks ({parallel.shard}; their logs in ranks/)"
        lines.append(f"tokens per update: {ramp}; peak lr {config.lr.peak:g}; device {config.device}{ranks}")
    if status.gpu is not None:
        lines.append(f"gpu: {status.gpu}")
    lines.append(_heartbeat_line(status))
    if status.data_wait is not None:
        lines.append(f"data: {status.data_wait}")
    if status.last_rows:
        lines.append(f"rows (newest {len(status.last_rows)}):")
        lines += [f"  {_format_row(row)}" for row in status.last_rows]
    else:
        lines.append("rows: none yet")
    if status.torn_last_row:
        lines.append("rows: the last line of rows.jsonl is incomplete (cut short mid-write; left out)")
    if status.checkpoints:
        newest = status.checkpoints[-CHECKPOINTS_SHOWN:]
        shown = ", ".join(newest)
        if len(newest) < len(status.checkpoints):
            shown = f"newest {len(newest)}: {shown}"
        latest = status.latest or "not set"
        if status.latest is not None and status.latest not in status.checkpoints:
            latest += " (missing)"
        if status.resumes_from is not None:
            latest += f"; a start resumes from {status.resumes_from} (not verified)"
            if status.resume_refused:
                latest += ", and is refused there (see the problem)"
        lines.append(f"checkpoints: {len(status.checkpoints)} ({shown}); latest {latest}")
    else:
        lines.append("checkpoints: none yet")
    lines += _validation_lines(status.last_validation)
    lines.append(_wandb_line(status))
    if status.stop is not None:
        lines.append(f"STOP pending: {status.stop.when()} (requested {status.stop.requested})")
    lines.append(disk_line(status))
    lines += [f"problem: {problem}" for problem in status.problems]
    return lines


def disk_line(status: LineStatus) -> str:
    """What the line takes on its disk (its checkpoints' part) and what the disk has left."""
    text = f"disk: {format_bytes(status.disk_bytes)}"
    if status.checkpoints_disk_bytes:
        text += f" (checkpoints {format_bytes(status.checkpoints_disk_bytes)})"
    if status.disk_free is not None:
        text += f"; {format_bytes(status.disk_free)} free on its disk"
    return text


def state_line(status: LineStatus) -> str:
    """supervisor.json's state, whether its supervisor runs, and for a line that failed why."""
    state = status.state
    if status.lone_trainer_pid is not None:
        stage = (status.heartbeat or {}).get("stage", "training")
        return f"state: {stage} with no supervisor (trainer pid {status.lone_trainer_pid})"
    if status.ended_without_supervisor is not None:
        recorded = "no supervisor.json" if state is None else f"supervisor.json says {state}"
        return (f"state: finished ({status.ended_without_supervisor}; by a trainer without a supervisor, "
                f"{recorded})")
    if state is None:
        return "state: no supervisor has run this line (no supervisor.json)"
    if status.supervisor_pid is not None:
        return f"state: {state} (supervisor pid {status.supervisor_pid})"
    if status.lost:
        return f"state: supervisor lost (it was {state}; its process runs no more)"
    details = []
    if state == LineState.FAILED and status.failures_in_a_row:
        count = status.failures_in_a_row
        details.append(f"{count} failure{'s' if count != 1 else ''} in a row")
    message = (status.last_event or {}).get("message")
    if state in FAULT_LINE_STATES and isinstance(message, str):
        details.append(f"last: {message}")
    return f"state: {state}" + (f" ({'; '.join(details)})" if details else "")


def last_event_line(status: LineStatus) -> str | None:
    """The last event of a line not ended (running, or its supervisor lost), with its age: why it waits or
    was restarted (its preparer failing, a long wait for data, the watchdog's kill), which the state
    alone does not say. An ended line's state line says what matters of its end."""
    event = status.last_event
    if status.state in FINAL_LINE_STATES or event is None or not isinstance(event.get("message"), str):
        return None
    when = event.get("time")
    age = ""
    if isinstance(when, (int, float)) and not isinstance(when, bool):
        age = f" {_format_age(max(0.0, time.time() - when))} ago"
    return f"last event: {event.get('event')}{age}: {event['message']}"


def _validation_lines(row: dict[str, Any] | None) -> list[str]:
    """The last validation's losses: every `/mix` and `/mean` (training length, long rows, EMA)."""
    if row is None:
        return ["validation: none yet"]
    losses = (key for key in row if key.endswith(("/mix", "/mean")))
    keys = sorted(key for key in losses if isinstance(row[key], (int, float)))
    metrics = sum(1 for key in row if key.startswith(("val_", "ema/", "opt/")))
    lines = [f"validation (update {row.get('update')}, {metrics} metrics):"]
    lines += [f"  {key} {_format_value(row[key])}" for key in keys]
    return lines


def _wandb_line(status: LineStatus) -> str:
    state = status.wandb
    if status.config is not None and status.config.wandb.mode == "disabled":
        return "W&B: disabled (run.json wandb.mode)"
    if status.wandb_recovery is not None:  # the problem below says what the next start does with which run
        return f"W&B: wandb_run.json {'unreadable' if status.wandb_unreadable else 'missing'} (below)"
    if status.wandb_unreadable:
        return ("W&B: wandb_run.json unreadable (below); the next start sets it aside and starts a new run "
                "with every row")
    if state is None:
        return "W&B: no run yet"
    if state.run_id is None:
        text = "W&B: no run yet"
    else:
        acknowledged = "none" if state.acknowledged_step is None else str(state.acknowledged_step)
        text = f"W&B: run {state.run_id} ({state.start or 'new'}), acknowledged step {acknowledged}"
    if state.pending is not None:
        text += f"; next start: {state.pending.kind} at update {state.pending.at_update}"
    if state.gap is not None:
        text += f"; rows {state.gap.from_update}..{state.gap.to_update} not sent yet"
    from engine.layout import LineLayout
    from engine.wandb.state import synced_after_last_write

    # Offline, the rows reach W&B only through `wandb sync`: say how many directories still wait.
    waiting = [entry for entry in state.local_files if entry.offline and Path(entry.path).is_dir()
               and not synced_after_last_write(Path(entry.path))]  # fmt: skip
    if waiting:
        count = f"{len(waiting)} offline director{'y' if len(waiting) == 1 else 'ies'}"
        text += f"; {count} not uploaded (wandb sync {LineLayout(status.root).wandb_dir}/offline-run-*)"
    return text


def _heartbeat_line(status: LineStatus) -> str:
    heartbeat = status.heartbeat
    if heartbeat is None or status.heartbeat_age_s is None:
        return "heartbeat: none"
    from engine.process_start import recorded_process_alive

    pid = heartbeat.get("pid")
    # The very process that beat, not a younger one that reused its pid (after a reboot) or its zombie.
    running = recorded_process_alive(pid, heartbeat.get("pid_boot_start"), heartbeat.get("time"))
    alive = "alive" if running else "not running"
    return (
        f"heartbeat: {_format_age(status.heartbeat_age_s)} ago, update {heartbeat.get('update')}, "
        f"stage {heartbeat.get('stage')}, pid {pid} ({alive})"
    )


def _format_age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _format_row(row: dict[str, Any]) -> str:
    keys = [key for key in ROW_COLUMNS if key in row]
    if not keys:
        keys = [key for key in sorted(row) if isinstance(row[key], (int, float, str))][:FALLBACK_COLUMNS]
    text = "  ".join(f"{key} {_format_value(row[key])}" for key in keys)
    if row.get("gpu_mode") == "shared":
        text += "  GPU SHARED (shared shapes beside other processes)"
    return text + ("  SKIPPED (non-finite)" if row.get("skipped") is True else "")


def format_bytes(size: float) -> str:
    """A byte count in binary units (`3.2 GiB`)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def _format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return str(value)
