"""A rewind or fork that waits out a whole session (W&B out from the rollback or branch until the
trainer stops): the line trains on past the rollback or fork point, and the next start, with W&B
back, carries it out and sends every row of the line the trainer resumed from, not only those up
to that point (engine.wandb.start). Through the mirror with the recording backend of
test_wb_logic; the real client's side is in test_trainer_wandb.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers.wandb_fakes import (
    FAST,
    ONLINE,
    RecordingBackend,
    SimulatedServer,
    make_parent,
    save_state,
    state_of,
    write_rows,
)

from engine.wandb.mirror import WandbMirror, plan_branch, plan_rollback
from engine.wandb.state import PendingStart

NEW = 1.0
"""How much the losses of the line's rows after a rollback or branch differ from `row`'s (those of
the abandoned continuation, or of the parent)."""


def trainer_session(line: Path, server: SimulatedServer, resumed_from: int, updates: range, **backend: Any) -> None:
    """One start of the line's trainer, resumed from update `resumed_from` (rows.jsonl holds the
    line's rows up to it): it trains `updates`, each row appended to rows.jsonl and handed to the
    mirror, then stops. A run this start creates is named `new`."""
    mirror = WandbMirror(line, ONLINE, {"model": "x"}, backend=RecordingBackend(server, **backend), options=FAST,
                         new_run_id=lambda: "new", resumed_from=resumed_from)  # fmt: skip
    mirror.start()
    for item in write_rows(line, updates, NEW):
        mirror.log(item)
    assert mirror.close(timeout_s=10.0)


def losses(old: range, new: range) -> list[float]:
    """The losses of `write_rows`' rows: `old` as they were, then `new` written after the rollback or branch."""
    return [10.0 / update for update in old] + [10.0 / update + NEW for update in new]


@pytest.mark.parametrize("rewind", [True, False])
def test_a_rewind_held_over_a_session_sends_the_rows_that_session_trained(tmp_path: Path, rewind: bool) -> None:
    # The run holds 1..8; the line was rolled back to 5 (rows.jsonl cut back there).
    server = SimulatedServer(history={"old": [(u, {"loss": 10.0 / u}) for u in range(1, 9)]})
    write_rows(tmp_path, range(1, 6))
    save_state(tmp_path, run_id="old", start="new", acknowledged_step=8)
    plan_rollback(tmp_path, 5)
    server.down = True
    trainer_session(tmp_path, server, 5, range(6, 21), rewind=rewind)
    assert state_of(tmp_path).pending.at_update == 5  # still to do; the checkpoints at 10 and 20 record it
    server.down = False
    trainer_session(tmp_path, server, 20, range(21, 23), rewind=rewind)
    run_id = "old" if rewind else "new"
    assert server.steps(run_id) == list(range(1, 23))
    assert server.losses(run_id) == losses(range(1, 6), range(6, 23))
    state = state_of(tmp_path)
    assert (state.run_id, state.start, state.method, state.pending) == (
        run_id, "rewind", "native" if rewind else "backfill", None
    )  # fmt: skip


def test_a_line_without_a_run_whose_rollback_waited_gets_every_row_it_resumed_from(tmp_path: Path) -> None:
    # A rewind planned where the line has no run yet: its first run holds the line's rows, those the
    # line trained since the rollback point included.
    server = SimulatedServer()
    write_rows(tmp_path, range(1, 6))
    save_state(tmp_path, pending=PendingStart(kind="rewind", at_update=5))
    write_rows(tmp_path, range(6, 21), NEW)
    trainer_session(tmp_path, server, 20, range(21, 23))
    assert server.steps("new") == list(range(1, 23))
    assert server.losses("new") == losses(range(1, 6), range(6, 23))


@pytest.mark.parametrize("fork", [True, False])
def test_a_fork_held_over_the_branch_s_first_session_sends_the_rows_that_session_trained(
    tmp_path: Path, fork: bool
) -> None:
    parent, server = make_parent(tmp_path, acknowledged=10)
    branch = tmp_path / "decay"
    branch.mkdir()
    plan_branch(branch, parent, 5)
    server.down = True
    trainer_session(branch, server, 5, range(6, 21), fork=fork)
    assert state_of(branch).pending.kind == "fork"
    server.down = False
    trainer_session(branch, server, 20, range(21, 23), fork=fork)
    # The parent's rows up to the fork, then every row of the branch.
    assert server.steps("new") == list(range(1, 23))
    assert server.losses("new") == losses(range(1, 6), range(6, 23))
    state = state_of(branch)
    assert (state.start, state.method, state.pending) == ("fork", "native" if fork else "backfill", None)
