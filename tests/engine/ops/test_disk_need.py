"""What a line's checkpoints need on disk, end to end on real tiny lines: `nsconsole new` and
`check` say it (and warn when the disk cannot hold it), a start without room for its next
checkpoint is refused before it trains or writes anything, and `checkpoints.keep_cycle_ends`
bounds the cycle ends a training line keeps."""

from __future__ import annotations

import json
import os
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
from helpers.lines import copy_data_line, data_template_fixture, make_line

from datalines import open_data_line
from engine.checkpoints.format import list_checkpoints, read_checkpoint_state, read_latest
from engine.protocol.facts import TrainerExitCode
from engine.training import main as trainer_main
from engine.training.trainer import Trainer
from nsconsole.cli import main

DiskUsage = namedtuple("DiskUsage", "total used free")

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread

data_template = data_template_fixture()


def free_disk(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    """Every free-space reading (the trainer's, check's, new's) says `free` bytes."""
    monkeypatch.setattr(shutil, "disk_usage", lambda path: DiskUsage(10**12, 10**12 - free, free))


def fresh_line(tmp_path: Path, data_template: Path, **changes: object) -> Path:
    """A tiny line as `nsconsole new` leaves it: never started, so no accepted_run.json."""
    line = make_line(tmp_path, copy_data_line(data_template, tmp_path), **changes)
    (line / "accepted_run.json").unlink()
    return line


def written(line: Path) -> list[str]:
    """The line's files but its log, its trainer lock (made before anything is read) and its compile
    caches' empty folders (torch makes the inductor one when it imports dynamo: no line state)."""
    leave_out = ("run.log", "trainer.lock")
    return sorted(
        str(path.relative_to(line))
        for path in line.rglob("*")
        if path.name not in leave_out and not (path.relative_to(line).parts[0] == "cache" and path.is_dir())
    )


def test_run_refuses_a_start_without_room_for_its_first_checkpoint(
    tmp_path: Path, data_template: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    line = fresh_line(tmp_path, data_template)
    before = written(line)
    free_disk(monkeypatch, 1000)
    assert main(["run", str(line), "--no-supervisor"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"nsconsole: {line}: 9.31e-07 GiB free on its disk, too little for the next checkpoint")
    assert "estimated: " in error and " parameters x 12 bytes (fp32 weights, two AdamW moments) + the tokenizer" in error
    assert error.endswith("none written yet; not started; free some space and run the line again")
    assert len(error.splitlines()) == 1
    # Nothing written: no checkpoint, no `latest`, no rows, no heartbeat, the configuration not accepted.
    assert written(line) == before
    assert read_latest(line / "checkpoints") is None
    monkeypatch.undo()
    assert main(["run", str(line), "--no-supervisor", "--stop-at", "1"]) == 0  # room again: it starts
    assert read_latest(line / "checkpoints") == "u00000001"


def test_a_resume_without_room_for_its_next_checkpoint_stops_the_line_for_the_operator(
    tmp_path: Path, data_template: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    line = fresh_line(tmp_path, data_template)
    assert Trainer(line, stop_at=2, echo=None).run() == 0
    newest = line / "checkpoints" / "u00000002"
    size = sum(path.stat().st_size for path in newest.iterdir())
    rows = (line / "rows.jsonl").read_bytes()
    free_disk(monkeypatch, size * 6 // 5)  # one checkpoint fits, not the 1.5x a write needs
    # As the supervisor launches it: exit 74, which the supervisor shows as the disk-full state
    # (tests/engine/supervisor/test_verdict.py) instead of relaunching.
    status = trainer_main.main([str(line), "--parent", str(os.getppid()), "--stop-at", "10"])
    assert status == TrainerExitCode.DISK_FULL
    error = capfd.readouterr().err  # written to the descriptor: a full disk may fail a print
    assert "measured on u00000002; 1.5x needed); the newest is update 2; not started" in error
    assert (line / "rows.jsonl").read_bytes() == rows
    assert [path.name for path in list_checkpoints(line / "checkpoints")] == ["u00000000", "u00000002"]


def check_lines(line: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    status = main(["check", str(line)])
    return status, capsys.readouterr().out.splitlines()


def test_check_says_what_retention_keeps(
    tmp_path: Path, data_template: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = fresh_line(tmp_path, data_template)
    cycles = open_data_line(line.parent / "data").last_cycle() + 1
    status, lines = check_lines(line, capsys)
    assert status == 0, lines
    retention = [text for text in lines if text.startswith("ok: disk retention: ")]
    assert len(retention) == 1, lines
    assert retention[0].startswith(
        f"ok: disk retention: retention keeps up to {4 + cycles} checkpoints (the line's start, "
        f"2 rolling, 1 being written, {cycles} cycle ends: {cycles} cycles planned) = "
    )
    assert retention[0].endswith("; it fits")


def test_check_warns_when_the_kept_checkpoints_outgrow_the_disk(
    tmp_path: Path, data_template: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    line = fresh_line(tmp_path, data_template, **{"guards.min_free_disk_gb": 0})
    _status, lines = check_lines(line, capsys)
    disk = next(text for text in lines if text.startswith("ok: disk: "))
    parameters = int(disk.split("estimated: ")[1].split(" parameters")[0].replace(",", ""))
    checkpoint = parameters * 12 + len((line.parent / "data" / "tokenizer.json").read_bytes())
    # Room for 5 checkpoints: the first fits (a pass); the start, 2 rolling, 1 being written and
    # every cycle end do not (a warning, not a failure).
    free_disk(monkeypatch, 5 * checkpoint + 1000)
    status, lines = check_lines(line, capsys)
    assert status == 0, lines
    warning = next(text for text in lines if text.startswith("warn: disk retention: "))
    assert warning.endswith(
        "holds 5 of them: free disk, or lower checkpoints.keep_last or checkpoints.keep_cycle_ends"
    ), warning
    # One rolling checkpoint and one cycle end: 4 in all, and they fit.
    document = json.loads((line / "run.json").read_text())
    document["checkpoints"].update(keep_cycle_ends=1, keep_last=1)
    (line / "run.json").write_text(json.dumps(document))
    _status, lines = check_lines(line, capsys)
    retention = next(text for text in lines if "disk retention: " in text)
    assert retention.startswith("ok: disk retention: retention keeps up to 4 checkpoints ("), retention
    assert "1 cycle end: checkpoints.keep_cycle_ends 1" in retention and retention.endswith("; it fits")


def test_new_says_what_the_checkpoints_need_and_warns_without_refusing(
    tmp_path: Path, data_template: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    data = copy_data_line(data_template, tmp_path)
    arguments = ["new", str(tmp_path / "a"), "--model", "transformer-tiny", "--data", str(data), "--seq-len", "32"]
    assert main(arguments) == 0
    out = capsys.readouterr().out.splitlines()
    assert any(text.startswith("disk: ") and "a checkpoint about" in text for text in out), out
    assert any(text.startswith("disk retention: retention keeps up to ") for text in out), out
    free_disk(monkeypatch, 1000)
    assert main(arguments[:1] + [str(tmp_path / "b")] + arguments[2:]) == 0
    out = capsys.readouterr().out.splitlines()
    assert any(
        text.startswith("warning: disk: ") and text.endswith("the trainer would stop at its first update")
        for text in out
    ), out
    assert any(text.startswith("warning: disk retention: ") for text in out), out
    assert (tmp_path / "b" / "run.json").is_file()  # created all the same: the start refuses, not new


def test_a_line_keeps_only_the_newest_cycle_ends_it_is_told_to(tmp_path: Path, data_template: Path) -> None:
    line = fresh_line(tmp_path, data_template, **{"checkpoints.keep_cycle_ends": 1})
    assert Trainer(line, echo=None).run() == 0  # to the data line's end: every cycle
    cycles = open_data_line(line.parent / "data").last_cycle() + 1
    assert cycles >= 2
    kept = [read_checkpoint_state(path)["kept"] for path in list_checkpoints(line / "checkpoints")]
    assert [reason for reason in kept if reason and reason.startswith("cycle-end")] == [f"cycle-end {cycles - 1}"]
    assert kept[0] == "line-start"
