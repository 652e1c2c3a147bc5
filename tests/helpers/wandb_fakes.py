"""A recording W&B backend and a simulated server for the W&B mirror's tests."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Any

from engine.config.run import WandbConfig
from engine.wandb.backend import StartedRun
from engine.wandb.mirror import (
    MirrorOptions,
    RetryPolicy,
    WandbMirror,
)
from engine.wandb.state import WandbRunState

FAST = MirrorOptions(
    retry=RetryPolicy(first_delay_s=0.005, max_delay_s=0.02, give_up_after_s=3600.0),
    acknowledge_every_s=0.01,
)


ONLINE = WandbConfig(project="p", mode="online")


class ServerDown(ConnectionError):
    pass


@dataclass
class SimulatedServer:
    """The W&B server as the logic can observe it."""

    history: dict[str, list[tuple[int, dict[str, Any]]]] = field(default_factory=dict)
    tags: dict[str, set[str]] = field(default_factory=dict)
    summary: dict[str, dict[str, Any]] = field(default_factory=dict)
    down: bool = False
    refuses_fork: bool = False
    refuses_rewind: bool = False
    fail_log_calls: set[int] = field(default_factory=set)
    """Numbers (1-based, counted over the server's life) of `log` calls that fail once."""
    calls: list[tuple[str, Any]] = field(default_factory=list)
    log_calls: int = 0

    def steps(self, run_id: str) -> list[int]:
        return [step for step, _ in self.history[run_id]]

    def losses(self, run_id: str) -> list[float]:
        return [values["loss"] for _, values in self.history[run_id]]

    def check_up(self) -> None:
        if self.down:
            raise ServerDown("W&B unreachable")


class RecordingBackend:
    """A `WandbBackend` over a `SimulatedServer`, recording every call."""

    def __init__(
        self, server: SimulatedServer, *, offline: bool = False, fork: bool = True, rewind: bool = True
    ) -> None:
        self.server = server
        self.offline = offline
        self.fork = fork
        self.rewind = rewind
        self.run_id: str | None = None

    def init(self, run_id, *, resume=False, fork_from=None, resume_from=None, config=None) -> StartedRun:
        server = self.server
        server.check_up()
        request = {"id": run_id, "resume": resume, "fork": fork_from, "rewind": resume_from}
        server.calls.append(("init", request))
        if resume_from is not None:
            if server.refuses_rewind:
                raise RuntimeError("rewind is not enabled on this server")
            run_id = resume_from.run_id
            server.history[run_id] = [(s, v) for s, v in server.history[run_id] if s <= resume_from.step]
        elif fork_from is not None:
            if server.refuses_fork:
                raise RuntimeError("forking is not enabled on this server")
            parent = server.history[fork_from.run_id]
            server.history[run_id] = [(s, v) for s, v in parent if s <= fork_from.step]
        else:
            assert resume
            server.history.setdefault(run_id, [])
        self.run_id = run_id
        held = server.history[run_id]
        next_step = held[-1][0] + 1 if held else 0
        return StartedRun(run_id=run_id, next_step=None if self.offline else next_step, local_dir=None,
                          offline=self.offline)

    def log(self, row: dict[str, Any], step: int) -> None:
        server = self.server
        server.check_up()
        server.log_calls += 1
        if server.log_calls in server.fail_log_calls:
            raise ServerDown(f"log call {server.log_calls} failed")
        assert self.run_id is not None
        held = server.history[self.run_id]
        if held and step <= held[-1][0]:
            server.calls.append(("dropped", step))  # W&B ignores a step not above the last one
            return
        held.append((step, dict(row)))

    def acknowledged_step(self) -> int | None:
        self.server.check_up()
        held = self.server.history.get(self.run_id or "", [])
        return held[-1][0] if held else None

    def server_rows(self, after: int, through: int) -> dict[int, dict[str, Any]] | None:
        self.server.check_up()
        if self.offline:
            return None
        held = self.server.history.get(self.run_id or "", [])
        return {step: dict(values) for step, values in held if after < step <= through}

    def finish(self) -> bool:
        self.server.check_up()
        self.run_id = None
        return True

    def mark_superseded(self, run_id: str, by_run_id: str, at_update: int) -> StartedRun:
        self.server.check_up()
        self.server.tags.setdefault(run_id, set()).add("superseded")
        self.server.summary.setdefault(run_id, {})["superseded_by"] = by_run_id
        return StartedRun(run_id=run_id, next_step=None, local_dir=None, offline=self.offline)

    def supports_fork(self) -> bool:
        return self.fork

    def supports_rewind(self) -> bool:
        return self.rewind


def row(update: int, loss: float | None = None) -> dict[str, Any]:
    loss = loss if loss is not None else 10.0 / update
    return {"update": update, "tokens": update * 512, "loss": loss, "lr": 1e-3}


def write_rows(line: Path, updates: range, loss_offset: float = 0.0) -> list[dict[str, Any]]:
    rows = [row(update, 10.0 / update + loss_offset) for update in updates]
    with (line / "rows.jsonl").open("a", encoding="utf-8") as handle:
        for item in rows:
            handle.write(json.dumps(item) + "\n")
    return rows


def run_ids() -> Any:
    numbers = count(1)
    return lambda: f"run{next(numbers)}"


def session(line: Path, backend: RecordingBackend, live: list[dict[str, Any]] = (), ids: Any = None,
            options: MirrorOptions = FAST) -> WandbMirror:
    """One start of the line: start the mirror, log `live` rows (appended to rows.jsonl first), close."""
    mirror = WandbMirror(line, ONLINE, {"model": "x"}, backend=backend, options=options,
                         new_run_id=ids or run_ids())
    mirror.start()
    for item in live:
        with (line / "rows.jsonl").open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(item) + "\n")
        mirror.log(item)
    assert mirror.close(timeout_s=10.0)
    return mirror


def started_mirror(
    line: Path, server: SimulatedServer, options: MirrorOptions, ids: Any = None
) -> WandbMirror:
    backend = RecordingBackend(server)
    mirror = WandbMirror(line, ONLINE, backend=backend, options=options, new_run_id=ids or run_ids())
    mirror.start()
    return mirror


def state_of(line: Path) -> WandbRunState:
    return WandbRunState.load(line / "wandb_run.json")


def save_state(line: Path, **fields: Any) -> None:
    WandbRunState(**fields).save(line / "wandb_run.json")


def make_parent(tmp_path: Path, acknowledged: int | None) -> tuple[Path, SimulatedServer]:
    parent = tmp_path / "trunk"
    parent.mkdir()
    write_rows(parent, range(1, 11))
    save_state(parent, run_id="trunkrun", start="new", acknowledged_step=acknowledged)
    server = SimulatedServer(history={"trunkrun": [(u, {"loss": 10.0 / u}) for u in range(1, 11)]})
    return parent, server


def wait_for(condition: Any, timeout_s: float = 10.0) -> None:
    event = threading.Event()
    for _ in range(int(timeout_s / 0.005)):
        if condition():
            return
        event.wait(0.005)
    raise AssertionError("condition not reached")

