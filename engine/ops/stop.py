"""`nsconsole stop`: a stop request in the line's STOP file, written atomically; the trainer stops
on it with a checkpoint (at its next update, or at a cycle end) and removes it.

`stop_line` (the command) writes it only while the line runs: nothing would remove a STOP left in
a stopped line, and the line's next start would stop at once on it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from engine.atomic import write_text_atomic
from engine.errors import LineError
from engine.layout import LineLayout
from engine.ops.lines import open_line
from engine.protocol.facts import Stage
from engine.supervisor.registry import find_supervisor


@dataclass
class StopRequest:
    """The STOP file: stop with a checkpoint at the next update, or at the end of a data cycle."""

    requested: str
    """When the stop was requested (ISO 8601, UTC)."""
    at_cycle_end: int | None
    """Stop exactly at the end of this data cycle; None: at the next update."""

    def when(self) -> str:
        """Where the line will stop, in words."""
        if self.at_cycle_end is None:
            return "at the next update"
        return f"at the end of cycle {self.at_cycle_end}"


def stop_line(root: Path | str, at_cycle_end: int | None = None) -> StopRequest:
    """`nsconsole stop`: `request_stop` while the line's supervisor, or a trainer of its own, runs;
    a LineError naming the line, and nothing written, while neither does."""
    # engine.ops.rollback imports this module (through engine.ops.status): imported when called.
    from engine.ops.rollback import running_trainer

    layout = open_line(root)
    _check_cycle_index(at_cycle_end)
    if find_supervisor(layout.root) is None and running_trainer(layout) is None:
        raise LineError(f"{layout.root}: not running (no supervisor or trainer); nothing to stop, no STOP written")
    _refuse_a_cycle_past_the_data(layout, at_cycle_end)
    return request_stop(layout.root, at_cycle_end)


def request_stop(root: Path | str, at_cycle_end: int | None = None) -> StopRequest:
    """Write the line's STOP file atomically (replacing an earlier request), running or not: the
    supervisor's `stop` call and a stop queued before a start (tests) come here directly."""
    layout = open_line(root)
    _check_cycle_index(at_cycle_end)
    _refuse_a_cycle_behind(layout, at_cycle_end)
    request = StopRequest(
        requested=datetime.fromtimestamp(time.time(), tz=timezone.utc).isoformat(timespec="seconds"),
        at_cycle_end=at_cycle_end,
    )
    document = {"requested": request.requested, "at_cycle_end": request.at_cycle_end}
    write_text_atomic(layout.stop, json.dumps(document, sort_keys=True) + "\n")
    return request


def _refuse_a_cycle_behind(layout: LineLayout, at_cycle_end: int | None) -> None:
    """A stop at the end of a cycle the line has left behind (its trainer's heartbeat names the cycle
    it trains) is refused: the trainer would take it as a stop at the next update, mid-cycle, which
    is not what was asked. A trainer waiting for data names the cycle it waits for, none of which it
    has read: it stands at the end of the cycle before, where a stop at that end stops it exactly."""
    from engine.supervisor.reads import read_json  # which imports this module: imported when called

    beat = read_json(layout.heartbeat) or {}
    cycle = beat.get("cycle")
    if at_cycle_end is None or not isinstance(cycle, int) or isinstance(cycle, bool):
        return
    waiting = beat.get("stage") == Stage.WAITING_DATA
    if at_cycle_end >= cycle or (waiting and at_cycle_end == cycle - 1):
        return
    if waiting:
        raise LineError(
            f"{layout.root}: cycle {at_cycle_end} has ended (the line waits for data of cycle {cycle}, at the end "
            f"of cycle {cycle - 1}); no STOP written: `--at-cycle-end {cycle - 1}` or no --at-cycle-end stops it "
            f"there, `--at-cycle-end {cycle}` at the end of the cycle it waits for"
        )
    raise LineError(
        f"{layout.root}: cycle {at_cycle_end} has ended (the line trains cycle {cycle}); no STOP written: "
        f"`--at-cycle-end {cycle}` stops at the end of the cycle it trains, no --at-cycle-end at the next update"
    )


def _refuse_a_cycle_past_the_data(layout: LineLayout, at_cycle_end: int | None) -> None:
    """A stop at the end of a cycle past its data line's last is refused: the line finishes at the end
    of its data first, and the request would wait in STOP for a cycle that never comes. A data line
    without a last cycle (an open-ended recipe), or one that cannot be read, says nothing here."""
    if at_cycle_end is None:
        return
    from datalines.errors import DataLineError
    from engine.config.run import RunConfig
    from engine.ops.line_end import data_last_cycle

    try:
        last = data_last_cycle(layout, RunConfig.load(layout.run_json))
    except (LineError, DataLineError, OSError):
        return
    if last is not None and at_cycle_end > last:
        raise LineError(
            f"{layout.root}: its data line's last cycle is {last}, where the line finishes; cycle {at_cycle_end} "
            f"never comes, no STOP written: `--at-cycle-end {last}` or earlier, or let it finish"
        )


def _check_cycle_index(at_cycle_end: int | None) -> None:
    if at_cycle_end is not None and at_cycle_end < 0:
        raise LineError(f"--at-cycle-end must be a cycle index (0 or more), got {at_cycle_end}")


def read_stop(layout: LineLayout) -> StopRequest | None:
    """The pending stop request (None when there is none); a malformed STOP is a LineError."""
    try:
        document = json.loads(layout.stop.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise LineError(f"{layout.stop}: malformed stop request ({error})") from None
    at_cycle_end = document.get("at_cycle_end") if isinstance(document, dict) else None
    if not isinstance(document, dict) or not (at_cycle_end is None or isinstance(at_cycle_end, int)):
        raise LineError(f"{layout.stop}: malformed stop request (expected requested and at_cycle_end)")
    return StopRequest(str(document.get("requested", "")), at_cycle_end)
