"""A damaged or lost wandb_run.json: the run the line's checkpoints record continues
(engine.wandb.recovery), through the mirror with a recording backend, and `nsconsole status` says so.

Checkpoints here hold a state.json (all the recovery reads of them) and, for `status`, which skips a
checkpoint whose files are missing or not the sizes meta.json lists, empty stand-ins of the others.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers.wandb_fakes import (
    FAST,
    ONLINE,
    RecordingBackend,
    SimulatedServer,
    row,
    run_ids,
    state_of,
    write_rows,
)

from engine.checkpoints.format import (
    EXTRA_FILE,
    FORMAT_VERSION,
    META_NAME,
    MODEL_FILE,
    OPTIMIZER_FILE,
    RUN_JSON_FILE,
    STATE_NAME,
    TOKENIZER_FILE,
    blake2b_of,
)
from engine.config.run import WandbConfig
from engine.layout import LineLayout
from engine.ops.status import line_status
from engine.wandb import recovery
from engine.wandb.checkpoint_records import RecordedRun, recorded_run
from engine.wandb.mirror import WandbMirror
from engine.wandb.recovery import load_or_recover
from engine.wandb.rows import row_values
from nsconsole.commands.status import format_status

DAMAGED = '{"version": 1, "run_id": '
OFFLINE = WandbConfig(project="p", mode="offline")


def checkpoint(line: Path, update: int, wandb: Any, latest: bool = True) -> None:
    """A checkpoint directory whose state.json records `wandb`; `latest` names it when asked."""
    directory = LineLayout(line).checkpoint(update)
    directory.mkdir(parents=True)
    (directory / STATE_NAME).write_text(json.dumps({"update": update, "wandb": wandb}))
    for name in (MODEL_FILE, OPTIMIZER_FILE, EXTRA_FILE, RUN_JSON_FILE, TOKENIZER_FILE):
        (directory / name).write_bytes(b"")
    files = {
        path.name: {"bytes": path.stat().st_size, "blake2b": blake2b_of(path)} for path in sorted(directory.iterdir())
    }
    (directory / META_NAME).write_text(json.dumps({"format": FORMAT_VERSION, "files": files}))
    if latest:
        (line / "checkpoints" / "latest").write_text(directory.name + "\n")


def record(run_id: str | None, acknowledged: int | None) -> dict[str, Any]:
    return {"run_id": run_id, "acknowledged_step": acknowledged}


def start(line: Path, backend: RecordingBackend, live: range = range(0), loss_offset: float = 0.0) -> list[str]:
    """One start of the line, logging `live` rows (`loss_offset`: their losses differ from `row`'s by
    that much, as those of updates trained after a rollback); returns the lines said to run.log."""
    said: list[str] = []
    settings = OFFLINE if backend.offline else ONLINE
    mirror = WandbMirror(line, settings, backend=backend, options=FAST, new_run_id=run_ids(), report=said.append)
    mirror.start()
    for item in write_rows(line, live, loss_offset):
        mirror.log(item)
    assert mirror.close(timeout_s=10.0)
    return said


def test_online_the_recovered_run_continues_and_the_server_s_count_decides_what_is_sent(tmp_path: Path) -> None:
    # The server holds 1..10; the newest checkpoint (u8) recorded step 6 acknowledged; the trainer
    # resumed from u8 (rows.jsonl cut back to 8) and trains 9..12 again.
    server = SimulatedServer(history={"old": [(u, row_values(row(u))) for u in range(1, 11)]})
    write_rows(tmp_path, range(1, 9))
    checkpoint(tmp_path, 0, record(None, None))
    checkpoint(tmp_path, 5, record("old", 4))
    checkpoint(tmp_path, 8, record("old", 6))
    (tmp_path / "wandb_run.json").write_text(DAMAGED)
    said = start(tmp_path, RecordingBackend(server), live=range(9, 13))
    assert set(server.history) == {"old"}  # no second run
    assert server.steps("old") == list(range(1, 13))  # each update once
    assert ("init", {"id": "old", "resume": True, "fork": None, "rewind": None}) in server.calls
    state = state_of(tmp_path)
    assert (state.run_id, state.start, state.acknowledged_step) == ("old", "resume", 12)
    assert state.replay_mismatch_count == 0  # 9 and 10 were compared with the server's copy
    [aside] = tmp_path.glob("wandb_run.json.bad-*")
    assert aside.read_text() == DAMAGED
    assert said == [
        f"W&B: wandb_run.json: malformed JSON at line 1 column 26: Expecting value; set aside as {aside.name}; "
        "continuing run old from checkpoint u00000008 (update 8, W&B step 6 acknowledged); the rows after "
        "the server's last step are sent again from rows.jsonl"
    ]


def test_offline_the_rows_after_the_recorded_step_are_sent_again(tmp_path: Path) -> None:
    # Offline nothing says what the run holds: the recorded step decides; steps the run has are
    # logged again (the client takes a step not above the last; W&B keeps its copy at the sync).
    server = SimulatedServer(history={"old": [(u, row_values(row(u))) for u in range(1, 9)]})
    write_rows(tmp_path, range(1, 9))
    checkpoint(tmp_path, 8, record("old", 5))
    (tmp_path / "wandb_run.json").unlink(missing_ok=True)
    said = start(tmp_path, RecordingBackend(server, offline=True), live=range(9, 11))
    assert [step for kind, step in server.calls if kind == "dropped"] == [6, 7, 8]
    assert server.steps("old") == list(range(1, 11))
    assert state_of(tmp_path).acknowledged_step == 10
    assert said == [
        "W&B: wandb_run.json: missing; continuing run old from checkpoint u00000008 (update 8, W&B step 5 "
        "acknowledged); the rows after step 5 are sent again from rows.jsonl"
    ]


def test_a_recorded_run_with_no_step_acknowledged_gets_every_row_again(tmp_path: Path) -> None:
    server = SimulatedServer(history={"old": [(1, {"loss": 10.0})]})
    write_rows(tmp_path, range(1, 4))
    checkpoint(tmp_path, 3, record("old", None))
    said = start(tmp_path, RecordingBackend(server, offline=True))
    assert server.steps("old") == [1, 2, 3]
    assert said[0].endswith("(update 3, no step acknowledged); every row is sent again from rows.jsonl")


def test_the_record_is_the_newest_at_or_before_latest_that_names_a_run(tmp_path: Path) -> None:
    layout = LineLayout(tmp_path)
    checkpoint(tmp_path, 0, record(None, None))  # a new line's first: its run had not begun
    checkpoint(tmp_path, 5, record("a", 4))
    checkpoint(tmp_path, 6, None)  # W&B disabled then
    checkpoint(tmp_path, 7, record(None, None))
    (layout.checkpoint(8)).mkdir()  # state.json unreadable
    (layout.checkpoint(8) / "state.json").write_text("{")
    checkpoint(tmp_path, 9, record("a", "seven"))  # a step that is no step: unknown
    checkpoint(tmp_path, 10, record("b", 10), latest=False)  # after `latest`: a rollback abandoned it
    assert recorded_run(layout) == RecordedRun("a", None, "u00000009", 9)
    (tmp_path / "checkpoints" / "latest").write_text("u00000008\n")
    assert recorded_run(layout) == RecordedRun("a", 4, "u00000005", 5)
    (tmp_path / "checkpoints" / "latest").write_text("u00000004\n")
    assert recorded_run(layout) is None
    # No readable `latest`: every checkpoint counts, as for the trainer's resume.
    (tmp_path / "checkpoints" / "latest").write_text("garbage\n")
    assert recorded_run(layout) == RecordedRun("b", 10, "u00000010", 10)
    (tmp_path / "checkpoints" / "latest").unlink()
    assert recorded_run(layout) == RecordedRun("b", 10, "u00000010", 10)


def test_a_rolled_back_line_rewinds_the_run_its_later_checkpoints_record_not_an_earlier_one(
    tmp_path: Path,
) -> None:
    # Run b replaced a after update 5 (a rollback where W&B could not rewind): b is the run the line
    # had when it was rolled back to 5, so b is rewound; a stays as it was.
    server = SimulatedServer(history={"a": [(u, {"loss": 1.0}) for u in range(1, 6)],
                                      "b": [(u, {"loss": 2.0}) for u in range(1, 11)]})  # fmt: skip
    write_rows(tmp_path, range(1, 6))
    checkpoint(tmp_path, 5, record("a", 5))
    checkpoint(tmp_path, 10, record("b", 10), latest=False)
    (tmp_path / "wandb_run.json").write_text(DAMAGED)
    start(tmp_path, RecordingBackend(server), live=range(6, 8))
    assert set(server.history) == {"a", "b"} and server.steps("a") == list(range(1, 6))
    assert server.steps("b") == list(range(1, 8)) and server.losses("b")[5:] == [10.0 / 6, 10.0 / 7]


def test_where_no_checkpoint_records_a_run_a_lost_state_file_starts_a_new_run_silently(tmp_path: Path) -> None:
    server = SimulatedServer()
    write_rows(tmp_path, range(1, 4))
    checkpoint(tmp_path, 0, record(None, None))
    said = start(tmp_path, RecordingBackend(server))
    assert server.steps("run1") == [1, 2, 3]
    assert said == []  # a line whose run has not begun: nothing happened to it


def test_an_earlier_damaged_file_set_aside_is_never_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recovery.time, "strftime", lambda _format: "20260101-000000")
    (tmp_path / "wandb_run.json.bad-20260101-000000").write_text("first")
    (tmp_path / "wandb_run.json.bad-20260101-000000-2").write_text("second")
    (tmp_path / "wandb_run.json").write_text(DAMAGED)
    said: list[str] = []
    state = load_or_recover(LineLayout(tmp_path), said.append)
    assert state.run_id is None
    assert (tmp_path / "wandb_run.json.bad-20260101-000000").read_text() == "first"
    assert (tmp_path / "wandb_run.json.bad-20260101-000000-2").read_text() == "second"
    assert (tmp_path / "wandb_run.json.bad-20260101-000000-3").read_text() == DAMAGED
    assert not (tmp_path / "wandb_run.json").exists()
    assert "set aside as wandb_run.json.bad-20260101-000000-3, starting a new W&B run" in said[0]


def status_line(tmp_path: Path, mode: str = "offline") -> Path:
    line = tmp_path / "line"
    line.mkdir()
    document = {"model": {"preset": "transformer-tiny"}, "data": {"line": "d"}, "wandb": {"project": "p", "mode": mode}}
    (line / "run.json").write_text(json.dumps(document))
    return line


def test_status_says_which_run_the_next_start_recovers(tmp_path: Path) -> None:
    line = status_line(tmp_path)
    checkpoint(line, 8, record("old", 6))
    (line / "wandb_run.json").write_text(DAMAGED)
    status = line_status(line)
    assert status.wandb_unreadable and status.wandb_recovery is not None
    [problem] = [text for text in status.problems if "wandb_run.json" in text]
    assert problem == (
        "wandb_run.json: malformed JSON at line 1 column 26: Expecting value; the next start sets it aside and "
        "continues run old from checkpoint u00000008 (update 8, W&B step 6 acknowledged)"
    )
    assert (line / "wandb_run.json").read_text() == DAMAGED  # status only reads
    assert "W&B: wandb_run.json unreadable (below)" in format_status(status)
    (line / "wandb_run.json").unlink()
    status = line_status(line)
    assert status.wandb is None and status.wandb_recovery is not None
    assert "wandb_run.json: missing; the next start continues run old from checkpoint u00000008" in status.problems[-1]
    assert "W&B: wandb_run.json missing (below)" in format_status(status)


def test_status_of_a_line_with_nothing_to_recover_says_nothing_of_it(tmp_path: Path) -> None:
    line = status_line(tmp_path)
    checkpoint(line, 0, record(None, None))
    status = line_status(line)
    assert status.wandb_recovery is None and not status.problems
    (line / "wandb_run.json").write_text(DAMAGED)
    status = line_status(line)
    assert status.wandb_recovery is None
    assert status.problems == ["wandb_run.json: malformed JSON at line 1 column 26: Expecting value"]


def test_status_names_a_damaged_file_s_json_error_whole(tmp_path: Path) -> None:
    # A README walk read "...: Invalid control character at; the next start ...": the decoder's own
    # message ends in "at" (Python appends the place), which after our "at line L column C" read cut.
    line = status_line(tmp_path)
    checkpoint(line, 0, record(None, None))
    (line / "wandb_run.json").write_text('{"version": 1, "run_id": "ab\tc"}\n')
    assert line_status(line).problems == [
        "wandb_run.json: malformed JSON at line 1 column 29: Invalid control character"
    ]
    (line / "wandb_run.json").write_text('{"version": 1, "run_id": "abc')
    assert line_status(line).problems == [
        "wandb_run.json: malformed JSON at line 1 column 26: Unterminated string"
    ]


def test_status_of_a_disabled_line_recovers_nothing(tmp_path: Path) -> None:
    # The next start does not mirror at all, so it recovers nothing either.
    line = status_line(tmp_path, mode="disabled")
    checkpoint(line, 8, record("old", 6))
    status = line_status(line)
    assert status.wandb_recovery is None and not status.problems
