"""What the supervisor reads of its line's files (run.json, `latest`, the heartbeat, STOP, run.log), and its lock.

Every reader tolerates a file being rewritten under it (the trainer writes them atomically, but a
read may still find one missing or, for logs, cut): it returns None or the previous value rather
than raising, except where the supervisor must refuse to run (run.json, a second supervisor).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from engine.config.json_fields import parse_json_text
from engine.config.run import RunConfig
from engine.errors import ConfigError, LineError
from engine.layout import LineLayout, checkpoint_update
from engine.ops.stop import StopRequest, read_stop
from engine.process_start import recorded_process_alive
from engine.protocol.facts import Stage


def supervisor_config(layout: LineLayout) -> RunConfig:
    """run.json, type-checked: what the supervisor reads of it (device, guards) has its types.

    Its values are the trainer's to validate: that imports the model code, and torch, for seconds.
    """
    try:
        text = layout.run_json.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{layout.run_json}: cannot be read ({error})") from None
    # The trainer's own parser: malformed JSON, a repeated key or a nesting too deep is one ConfigError.
    return RunConfig.from_dict(parse_json_text(text, str(layout.run_json)), source=str(layout.run_json))


def reload_config(layout: LineLayout, previous: RunConfig | None) -> RunConfig | None:
    # run.json may have been edited between launches; the trainer refuses what is wrong with it.
    try:
        return supervisor_config(layout)
    except LineError:
        return previous


def latest_update(layout: LineLayout) -> int | None:
    """The update of the checkpoint `latest` names (None: none yet, or unreadable)."""
    try:
        return checkpoint_update(layout.latest.read_text(encoding="utf-8").strip())
    except (OSError, UnicodeDecodeError):
        return None


def beat_time(heartbeat: dict[str, Any]) -> float:
    """When a heartbeat was written (0 when its time is unreadable: it counts as old)."""
    beat = heartbeat.get("time")
    return float(beat) if isinstance(beat, (int, float)) and not isinstance(beat, bool) else 0.0


def running_supervisor_pid(supervisor: dict[str, Any]) -> int | None:
    """The pid supervisor.json names while that very process runs (not a younger one that reused
    the pid, after a reboot say); None: no supervisor of this record runs."""
    pid = supervisor.get("pid")
    return pid if recorded_process_alive(pid, supervisor.get("boot_start"), supervisor.get("started")) else None


def running_trainer_pid(heartbeat: dict[str, Any] | None) -> int | None:
    """The pid of the trainer a heartbeat names while that very process runs and has not said it
    stopped (an orphan finishing its checkpoint counts); None otherwise."""
    if heartbeat is None or heartbeat.get("stage") == Stage.STOPPED:
        return None
    pid = heartbeat.get("pid")
    # A beat without a readable time (none of the trainer's) leaves the pid alone to say it.
    return pid if recorded_process_alive(pid, heartbeat.get("pid_boot_start"), heartbeat.get("time")) else None


def heartbeat_update(layout: LineLayout) -> int | None:
    heartbeat = read_json(layout.heartbeat)
    return None if heartbeat is None else heartbeat.get("update")


def pending_stop(layout: LineLayout) -> StopRequest | None:
    try:
        return read_stop(layout)
    except LineError:
        return None


def pending_stop_now(layout: LineLayout) -> bool:
    request = pending_stop(layout)
    return request is not None and request.at_cycle_end is None


def discard_served_stop(layout: LineLayout) -> None:
    """The line has stopped: a stop-at-the-next-update request still there (one that came as it
    stopped) is served, and must not stop the next run at once. One for a cycle end is kept."""
    if pending_stop_now(layout):
        layout.stop.unlink(missing_ok=True)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return parse_json(path.read_bytes())
    except OSError:
        return None


def parse_json(raw: bytes) -> dict[str, Any] | None:
    try:
        document = json.loads(raw)
    except ValueError:
        return None
    return document if isinstance(document, dict) else None


def file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def last_error_line(run_log: Path) -> str | None:
    """The trainer's one-line error (`nsconsole: ...`) near the end of run.log."""
    try:
        with open(run_log, "rb") as handle:
            handle.seek(max(0, file_size(run_log) - 16384))
            tail = handle.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    errors = [line[len("nsconsole: "):] for line in tail.splitlines() if line.startswith("nsconsole: ")]
    return errors[-1] if errors else None


def read_log_chunk(run_log: Path, offset: int, length: int) -> dict[str, Any]:
    """The `log {offset, length}` reply: run.log's bytes from `offset` (at most `length`, whole UTF-8
    characters only, so the next read starts with the cut one whole), `next` and the file's `size`.

    The supervisor answers it on its socket; the console reads a line at rest (no supervisor) the same way.
    """
    try:
        with open(run_log, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            # Past the end reads nothing (a seek past the filesystem's largest offset would fail).
            handle.seek(min(offset, size))
            chunk = handle.read(min(length, max(0, size - offset)))
    except FileNotFoundError:
        size, chunk = 0, b""
    chunk = whole_characters(chunk)
    text = chunk.decode("utf-8", errors="replace")
    return {"offset": offset, "text": text, "next": offset + len(chunk), "size": size}


def whole_characters(chunk: bytes) -> bytes:
    """`chunk` without a UTF-8 character cut at its end (the next read starts with it whole)."""
    for back in range(1, min(4, len(chunk)) + 1):
        byte = chunk[-back]
        if byte < 0x80:
            return chunk
        if byte >= 0xC0:  # a lead byte: is its character complete?
            needed = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return chunk if back >= needed else chunk[:-back]
    return chunk
