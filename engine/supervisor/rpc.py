"""What a line's supervisor answers on its socket: the handler behind `engine/supervisor/server.py`.

Reads (`status`, `rows`, `log`, `gpu`) come from the supervisor's own view of the line: it tails
rows.jsonl as the trainer appends (whole lines only, an index of their offsets kept), so a
client never reads a file mid-write. Mutations change the line through the same engine
functions the commands use (`engine.ops.lines`, `engine.ops.branch`, `nsconsole tune`); the server
applies each request_id once:

- `stop {at_cycle_end}` writes the STOP request and replies at once.
- `branch {path, at_cycle, plan, data}` forks now when the trunk's cycle has ended (`{"state":
  "forked"}`), else checks everything the fork will decide against the position the trunk is
  expected to have at that cycle's end and queues it (`{"state": "queued"}`; `status` lists it in
  `queued_forks`); either way a `branched` event follows the fork (a notified `branch_failed` when
  a queued one cannot be made, or its cycle never comes; `status` then lists it in
  `failed_forks`). Relative paths are taken under host.json's `work_root`, else beside the line.
- `rollback {to}` and `tune {shared}` need the trainer stopped: the supervisor stops it (a
  checkpoint at its next update), does the work, relaunches it, and only then replies (with what
  was done: the rollback's outcome, the tuned shapes); the `rolled_back` / `tuned` event carries
  the same (`rollback_failed` / `tune_failed` on a refusal). A client whose call times out
  meanwhile retries with the same request_id and gets the one outcome. Until the reply, this
  line's other mutations wait (the server applies mutations one at a time).
"""

from __future__ import annotations

import dataclasses
import subprocess
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from engine.checkpoints.format import no_such_checkpoint, pin_checkpoint, unpin_checkpoint
from engine.config.host import HostSettings
from engine.config.run import RunConfig
from engine.errors import LineError
from engine.gpu.devices import gpu_snapshot, lease_holder
from engine.layout import LineLayout
from engine.ops.rollback import rollback_line
from engine.ops.stop import request_stop
from engine.protocol import wire
from engine.protocol.facts import EventKind, LineState
from engine.supervisor.children import tune_command
from engine.supervisor.forks import ForkQueue, new_fork
from engine.supervisor.reads import latest_update, read_log_chunk
from engine.supervisor.rows_tail import RowsTail


@dataclass
class PausedWork:
    """Work on the line that needs its trainer stopped, done by the supervisor between two launches."""

    name: str
    """What it is (`rollback`, `tune`), for run.log lines and replies."""
    state: LineState
    """The supervisor's state while it runs (`rolling-back`, `tuning`)."""
    done_event: EventKind
    """The event published with its result (`rolled_back`, `tuned`)."""
    failed_event: EventKind
    """The event published when it is refused or fails (`rollback_failed`, `tune_failed`)."""
    work: Callable[[], dict[str, Any]]
    """Does it (in the supervisor's loop); its result is the reply. A `LineError` is a refusal."""
    needs_gpu: bool
    """It runs on the line's device: on a GPU line only with the lease held and no other process there."""
    outcome: Future[dict[str, Any]] = field(default_factory=Future)
    """Set when done (or refused, or when the supervisor ends first)."""
    answered: threading.Event = field(default_factory=threading.Event)
    """Set once the RPC thread has taken the outcome (its reply is on its way to the client)."""


class SupervisorView(Protocol):
    """What the handler needs from the supervisor it serves."""

    layout: LineLayout
    rows_tail: RowsTail
    request_log: wire.RequestLog
    forks: ForkQueue

    def state_for_status(self) -> dict[str, Any]: ...

    def request_stop(self, at_cycle_end: int | None) -> None: ...

    def between_launches(self, work: PausedWork) -> dict[str, Any]: ...

    def save_requests(self) -> None: ...

    def placed_environment(self) -> dict[str, str] | None: ...


class LineHandler:
    """The supervisor's RPC methods (see `engine/protocol/wire.py` for their parameters)."""

    def __init__(self, supervisor: SupervisorView) -> None:
        self.supervisor = supervisor
        self.request_log = supervisor.request_log

    def requests_changed(self) -> None:
        """A mutation was applied (or refused): its request_id reaches supervisor.json before the reply."""
        self.supervisor.save_requests()

    def status(self) -> dict[str, Any]:
        return self.supervisor.state_for_status()

    def rows(self, since: int, limit: int) -> dict[str, Any]:
        rows, next_index = self.supervisor.rows_tail.read(since, limit)
        return {"rows": rows, "next": next_index, "total": self.supervisor.rows_tail.count}

    def series(self, name: str, since: int, stride: int) -> dict[str, Any]:
        points, next_index = self.supervisor.rows_tail.series(name, since, stride)
        return {"points": points, "next": next_index, "total": self.supervisor.rows_tail.count}

    def row(self, index: int, offset: int, length: int) -> dict[str, Any]:
        return self.supervisor.rows_tail.row_text(index, offset, length)

    def history(self, since: int) -> dict[str, Any]:
        rows, next_index = self.supervisor.rows_tail.history(since)
        return {"rows": rows, "next": next_index, "total": self.supervisor.rows_tail.count}

    def log(self, offset: int, length: int) -> dict[str, Any]:
        return read_log_chunk(self.supervisor.layout.run_log, offset, length)

    def gpu(self) -> dict[str, Any]:
        snapshot = gpu_snapshot().to_json()
        leases = []
        for device in snapshot["devices"]:
            holder = lease_holder(device["index"])
            held = None if holder is None else {"line": holder.line, "pid": holder.pid, "since": holder.since}
            leases.append(held)
        snapshot["leases"] = leases
        return snapshot

    def stop(self, at_cycle_end: int | None) -> dict[str, Any]:
        request = request_stop(self.supervisor.layout.root, at_cycle_end)
        self.supervisor.request_stop(at_cycle_end)
        when = request.when()
        return {"stopping": True, "when": when, "requested": request.requested, "at_cycle_end": at_cycle_end}

    def branch(
        self, path: str, at_cycle: int | None, at_update: int | None, plan: str | None, data: str | None,
        long_seq_len: int | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        if at_update is not None:
            raise LineError("branch: a branch forks at a trunk cycle end; give at_cycle, not at_update")
        if at_cycle is None:
            raise LineError("branch: give at_cycle, the trunk cycle at whose end the branch forks")
        if plan is None:
            raise LineError("branch: give a plan: decay:TOKENS[:shape] and long:TOKENS, comma-separated")
        if data is None:
            raise LineError("branch: give the branch's own data line (the trunk's is consumed as it trains)")
        fork = new_fork(self._request_path(path), at_cycle, plan, self._request_path(data), long_seq_len)
        return self.supervisor.forks.branch(fork)

    def rollback(self, to: int) -> dict[str, Any]:
        layout = self.supervisor.layout
        check_rollback_target(layout, to)  # before the trainer is stopped for nothing

        def roll_back() -> dict[str, Any]:
            result = rollback_line(layout.root, to)
            reply = dataclasses.asdict(result)
            reply["rows_kept"] = None if result.rows_kept is None else str(result.rows_kept)
            return reply

        # The trainer stops with a checkpoint of its own first, and retention then keeps only the
        # newest rolling ones: pinned, the chosen checkpoint stays whatever retention runs meanwhile.
        target = layout.checkpoint(to).name
        pin_checkpoint(layout.checkpoints, target)
        try:
            return self.supervisor.between_launches(
                PausedWork("rollback", LineState.ROLLING_BACK, EventKind.ROLLED_BACK, EventKind.ROLLBACK_FAILED,
                           roll_back, needs_gpu=False)
            )
        finally:
            unpin_checkpoint(layout.checkpoints, target)

    def tune(self, shared: bool) -> dict[str, Any]:
        layout = self.supervisor.layout
        config = RunConfig.load(layout.run_json)
        if shared:  # refused here, before the trainer is paused for it (the tune asks again)
            config.guards.shared_tune_reserve_bytes(str(layout.run_json), "a shared tune")
        return self.supervisor.between_launches(
            PausedWork("tune", LineState.TUNING, EventKind.TUNED, EventKind.TUNE_FAILED,
                       lambda: tune_in_child(layout, shared, self.supervisor.placed_environment()), needs_gpu=True)
        )

    def _request_path(self, text: str) -> Path:
        """A path sent over the socket: the client's working directory is unknown here, so a relative
        one is taken under host.json's `work_root`, else beside this line."""
        path = Path(text).expanduser()
        if path.is_absolute():
            return path
        work_root = HostSettings.load().work_root
        base = Path(work_root).expanduser() if work_root else self.supervisor.layout.root.parent
        return (base / path).absolute()


def check_rollback_target(layout: LineLayout, to: int) -> None:
    """Refuse a rollback to a checkpoint that is not there or not before `latest` (`rollback_line`
    checks all of it again once the trainer has stopped)."""
    target = layout.checkpoint(to)
    if not target.is_dir():
        raise LineError(no_such_checkpoint(target))  # naming those the line has, as `nsconsole rollback` does
    latest = latest_update(layout)
    if latest is None or to >= latest:
        named = "none" if latest is None else layout.checkpoint(latest).name
        raise LineError(f"{target}: not before the line's latest checkpoint ({named}); a rollback goes back")


def tune_in_child(layout: LineLayout, shared: bool, env: dict[str, str] | None = None) -> dict[str, Any]:
    """A tune of the line (`engine.supervisor.children tune`) in a child process; the shapes it wrote into run.json.

    A child, not this process: the measurement builds the model on the line's device, and a CUDA
    context left in the supervisor would hold GPU memory and count as another process on the GPU.
    Its table goes to run.log; its one-line error becomes the refusal. `env`: the supervisor's
    placement on the leased GPU (None: this process's environment).
    """
    command = tune_command(layout.root, shared)  # it ends with the supervisor
    with open(layout.run_log, "ab") as run_log:
        finished = subprocess.run(
            command, stdin=subprocess.DEVNULL, stdout=run_log, stderr=subprocess.PIPE, env=env
        )
    if finished.returncode != 0:
        errors = finished.stderr.decode("utf-8", errors="replace").strip().splitlines()
        refusals = [line[len("nsconsole: "):] for line in errors if line.startswith("nsconsole: ")]
        last = refusals[-1] if refusals else (errors[-1] if errors else "no output")
        raise LineError(f"tune exited with status {finished.returncode}: {last}")
    config = RunConfig.load(layout.run_json)
    tuned = sorted({stage.seq_len for stage in config.plan})
    lengths = []
    for entry in config.lengths:
        if entry.seq_len not in tuned:
            continue
        shape = entry.shared if shared else entry
        assert shape is not None  # tune wrote it
        lengths.append({"seq_len": entry.seq_len, "micro_batch_rows": shape.micro_batch_rows,
                        "recompute": shape.recompute})  # fmt: skip
    return {"shared": shared, "lengths": lengths}
