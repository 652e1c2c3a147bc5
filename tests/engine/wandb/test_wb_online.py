"""W&B continuity online: the real wandb 0.31 client against a local server (tests/helpers/wandb_server.py).

No W&B server can run here (`wandb server start` needs Docker and the `wandb/local` image; the
network is closed), so the server is our own HTTP server speaking the part of W&B's API the
client uses. It keeps each run's history as the client streamed it and drops a step that is not
above the run's last one, as W&B does, counting it: "every update once" is read off the server.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.wandb_fakes import wait_for
from helpers.wandb_server import FakeWandbServer, online_wandb

from engine.config.run import WandbConfig
from engine.wandb.mirror import MirrorOptions, RetryPolicy, WandbMirror
from engine.wandb.state import ReplayMismatch, WandbRunState

ONLINE = WandbConfig(project="nsconsole-tests", mode="online")
OPTIONS = MirrorOptions(retry=RetryPolicy(0.05, 0.5, 3600.0), acknowledge_every_s=0.2, finish_timeout_s=30.0)


@pytest.fixture
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeWandbServer]:
    with online_wandb(tmp_path_factory.mktemp("wandb_home")) as fake:
        yield fake


def make_row(update: int, loss: float | None = None) -> dict[str, Any]:
    loss = 10.0 / update if loss is None else loss
    return {"update": update, "tokens": update * 256, "loss": loss, "lr": 0.003, "stage": "trunk",
            "time": 1.7e9 + update, "train/grad_norm/embed": 0.5 / update}  # fmt: skip


def append_rows(line: Path, rows: list[dict[str, Any]]) -> None:
    with (line / "rows.jsonl").open("a", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")


def cut_rows(line: Path, through: int) -> None:
    """What a resume from the checkpoint at `through` leaves in rows.jsonl."""
    rows = [json.loads(text) for text in (line / "rows.jsonl").read_text().splitlines()]
    (line / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows if row["update"] <= through))


def start_mirror(line: Path, reports: list[str] | None = None) -> WandbMirror:
    report = reports.append if reports is not None else None
    mirror = WandbMirror(line, ONLINE, {"model": {"preset": "pssa-tiny"}}, options=OPTIONS, report=report)
    mirror.start()
    return mirror


def run_session(line: Path, live: list[dict[str, Any]], reports: list[str] | None = None) -> WandbMirror:
    """One start of the line: each row is appended to rows.jsonl, then handed to the mirror."""
    mirror = start_mirror(line, reports)
    for row in live:
        append_rows(line, [row])
        mirror.log(row)
    assert mirror.close(timeout_s=60.0)
    return mirror


def state_of(line: Path) -> WandbRunState:
    return WandbRunState.load(line / "wandb_run.json")


def values(row: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in row.items() if key != "update"}


def test_rows_are_mirrored_online_and_the_server_acknowledges_them(tmp_path: Path, server: FakeWandbServer) -> None:
    rows = [make_row(update) for update in range(1, 7)]
    mirror = start_mirror(tmp_path)
    for row in rows:
        append_rows(tmp_path, [row])
        mirror.log(row)
    # While the run is open, the acknowledged step is the server's own last step, read from it.
    wait_for(lambda: state_of(tmp_path).acknowledged_step == 6, timeout_s=60.0)
    assert mirror.close(timeout_s=60.0)
    state = state_of(tmp_path)
    assert (state.start, state.acknowledged_step) == ("new", 6)
    run = server.run(state.run_id)
    assert run.steps() == list(range(1, 7)) and run.dropped == []
    assert run.exit_code == 0  # finished cleanly
    for row, held in zip(rows, run.rows(), strict=True):
        assert {key: held[key] for key in values(row)} == values(row)


def test_a_resume_sends_exactly_the_rows_the_server_lacks(tmp_path: Path, server: FakeWandbServer) -> None:
    run_session(tmp_path, [make_row(update) for update in range(1, 9)])
    run_id = state_of(tmp_path).run_id
    # A crash: the server got rows up to 8 but wandb_run.json last recorded 3, and rows 9-10
    # reached rows.jsonl but never W&B.
    state = state_of(tmp_path)
    state.acknowledged_step = 3
    state.save(tmp_path / "wandb_run.json")
    append_rows(tmp_path, [make_row(9), make_row(10)])
    run_session(tmp_path, [make_row(11), make_row(12)])
    state = state_of(tmp_path)
    assert (state.run_id, state.start, state.acknowledged_step) == (run_id, "resume", 12)
    run = server.run(run_id)
    assert run.steps() == list(range(1, 13)) and run.dropped == []  # the server's count decided
    assert state.replay_mismatch_count == 0


def test_a_replayed_update_that_differs_from_the_server_is_recorded_not_sent(
    tmp_path: Path, server: FakeWandbServer
) -> None:
    run_session(tmp_path, [make_row(update) for update in range(1, 9)])
    run_id = state_of(tmp_path).run_id
    # Killed after W&B got update 8, resumed from the checkpoint at 5: updates 6-8 are trained
    # again. Update 7 comes out different (loss and a gradient norm); its wall-clock time always
    # does, and is no difference.
    cut_rows(tmp_path, through=5)
    replayed = [make_row(6), {**make_row(7, loss=2.5), "train/grad_norm/embed": 9.0, "time": 1.0}, make_row(8)]
    replayed[0]["time"] = 2.0
    reports: list[str] = []
    run_session(tmp_path, [*replayed, make_row(9), make_row(10)], reports)
    state = state_of(tmp_path)
    assert state.replay_mismatches == [
        ReplayMismatch(update=7, metric="loss", line_value="2.5", server_value=json.dumps(10.0 / 7)),
        ReplayMismatch(update=7, metric="train/grad_norm/embed", line_value="9.0", server_value=json.dumps(0.5 / 7)),
    ]
    assert state.replay_mismatch_count == 2
    [line] = reports
    assert "replayed update 7 differs" in line and "loss 2.5 here" in line and "train/grad_norm/embed" in line
    run = server.run(run_id)
    assert run.steps() == list(range(1, 11)) and run.dropped == []  # nothing was sent twice
    assert run.rows()[6]["loss"] == 10.0 / 7  # the server's copy stands


def test_a_server_that_lacks_a_replayed_step_is_recorded(tmp_path: Path, server: FakeWandbServer) -> None:
    """A server whose stored history differs from rows.jsonl: it has no row at a step it counts."""
    run_id = "plantedrun1"
    # The server holds updates 1-4 and 6 (not 5) of the line's run; rows.jsonl holds 1-4.
    planted = [{"_step": update, **values(make_row(update))} for update in (1, 2, 3, 4, 6)]
    server.plant_history(run_id, planted, entity="nsconsole", project=ONLINE.project)
    append_rows(tmp_path, [make_row(update) for update in range(1, 5)])
    WandbRunState(run_id=run_id, start="new", acknowledged_step=4).save(tmp_path / "wandb_run.json")
    reports: list[str] = []
    run_session(tmp_path, [make_row(5), make_row(6), make_row(7)], reports)
    state = state_of(tmp_path)
    assert [(item.update, item.metric) for item in state.replay_mismatches] == [(5, "(row)")]
    assert reports == [f"W&B: replayed update 5 differs from run {run_id}'s copy on the server: "
                       "the server has no row at that step (not sent again)"]  # fmt: skip
    assert server.run(run_id).steps() == [1, 2, 3, 4, 6, 7]


def test_an_outage_in_the_middle_of_a_run_loses_nothing(tmp_path: Path, server: FakeWandbServer) -> None:
    mirror = start_mirror(tmp_path)
    first = [make_row(update) for update in range(1, 4)]
    for row in first:
        append_rows(tmp_path, [row])
        mirror.log(row)
    wait_for(lambda: state_of(tmp_path).acknowledged_step == 3, timeout_s=60.0)
    run_id = state_of(tmp_path).run_id
    server.stop()  # W&B goes down: connections are refused
    during = [make_row(update) for update in range(4, 9)]
    for row in during:
        append_rows(tmp_path, [row])
        mirror.log(row)
    server.start()  # back on the same port
    wait_for(lambda: server.run(run_id).steps()[-1:] == [8], timeout_s=60.0)
    assert mirror.close(timeout_s=60.0)
    run = server.run(run_id)
    assert run.steps() == list(range(1, 9)) and run.dropped == []
    assert state_of(tmp_path).acknowledged_step == 8


def test_a_line_that_starts_while_wandb_is_down_sends_everything_once_it_is_back(
    tmp_path: Path, server: FakeWandbServer
) -> None:
    server.stop()
    mirror = start_mirror(tmp_path)
    rows = [make_row(update) for update in range(1, 6)]
    for row in rows:
        append_rows(tmp_path, [row])
        mirror.log(row)
    wait_for(lambda: mirror.status().last_error is not None, timeout_s=60.0)  # init failed, retrying
    assert mirror.status().queued == 5 and not mirror.status().connected
    server.start()
    wait_for(lambda: mirror.status().connected and mirror.status().sent_through == 5, timeout_s=60.0)
    assert mirror.close(timeout_s=60.0)
    state = state_of(tmp_path)
    run = server.run(state.run_id)
    assert run.steps() == list(range(1, 6)) and run.dropped == []
