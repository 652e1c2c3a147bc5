"""Checkpoints removed by hand, as `check` and `status` read them (found in the disk walkthrough):
with the one `latest` names gone, `check` read the line as new (`model: no checkpoint to resume
yet`, `rows.jsonl: no checkpoint to hold it to yet`, the next cycle 0, the checkpoint's size
estimated) while the trainer resumes from the newest one before it; `status` named the missing
checkpoint as `latest` without a word, and a `latest` that is a directory or not text was a
traceback. With every checkpoint gone, the start is refused (it used to start the line over and
cut rows.jsonl to nothing): `check` fails on it in one line. With the checkpoint before `latest`'s
damaged too, both named the damaged one as the resume point while a start skips it and resumes
from an older one: they now choose as a start does (`search_resume_point`)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from helpers.lines import copy_data_line, data_template_fixture, make_line

from engine.checkpoints.tensors import find_resume_point
from engine.errors import CheckpointError, LineError
from engine.ops.cycle_check import start_without_preparer
from engine.ops.status import line_status
from engine.training.trainer import Trainer
from nsconsole.cli import main
from nsconsole.commands.status import format_status

pytestmark = pytest.mark.usefixtures("one_thread", "private_host")

data_template = data_template_fixture()


def _check(line: Path, capsys: pytest.CaptureFixture[str]) -> list[str]:
    main(["check", str(line)])
    return capsys.readouterr().out.splitlines()


def test_check_and_status_read_the_checkpoint_a_start_falls_back_to(
    tmp_path: Path, data_template: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = make_line(tmp_path, copy_data_line(data_template, tmp_path))
    assert Trainer(line, stop_at=12, echo=None).run() == 0  # u0, u5, u10 (cycle 0's end), u12
    checkpoints = line / "checkpoints"
    assert (checkpoints / "latest").read_text() == "u00000012\n"
    shutil.rmtree(checkpoints / "u00000012")

    out = _check(line, capsys)
    assert any(text.startswith("ok: model: transformer-tiny") and text.endswith(" loads u00000010") for text in out)
    assert "ok: rows.jsonl: holds the 10 rows u00000010 counts" in out
    assert "ok: data consumption: cycle 1, the next this line reads, is not another line's" in out
    assert any(text.startswith("ok: disk: ") and "measured on u00000010" in text for text in out), out
    assert f"FAIL: checkpoints: {checkpoints / 'latest'}: names u00000012, which is missing; a start resumes " \
           "from u00000010, the newest before it" in out

    report = format_status(line_status(line))
    assert any(text.startswith("checkpoints: 3 (") and text.endswith(
        "latest u00000012 (missing); a start resumes from u00000010 (not verified)") for text in report), report
    assert f"problem: {checkpoints / 'latest'}: names u00000012, which is missing; a start resumes from " \
           "u00000010, the newest before it (not verified: `nsconsole check` hashes its files)" in report
    [disk] = [text for text in report if text.startswith("disk: ")]
    assert "(checkpoints " in disk and disk.endswith(" free on its disk")

    (checkpoints / "latest").unlink()
    (checkpoints / "latest").mkdir()  # not the file a checkpoint's rename replaces: the start refuses it
    report = format_status(line_status(line))
    assert f"problem: {checkpoints / 'latest'}: a directory, not the file naming the newest checkpoint; " \
           "move it away (the checkpoints are kept)" in report
    (checkpoints / "latest").rmdir()
    (checkpoints / "latest").write_bytes(b"\xff\xfe")
    assert f"problem: {checkpoints / 'latest'}: not text, so not a checkpoint's name (u and 8 digits); " \
           "a start resumes from u00000010, the newest (not verified: `nsconsole check` hashes its files)" in (
        format_status(line_status(line)))  # fmt: skip

    (checkpoints / "latest").write_text("u00000012\n")
    for directory in checkpoints.glob("u*"):
        shutil.rmtree(directory)
    out = _check(line, capsys)
    assert f"FAIL: rows.jsonl: {checkpoints}: no checkpoint to resume from is left, but the line has trained " \
           f"({checkpoints / 'latest'} names u00000012); a fresh start would erase rows.jsonl and train from " \
           "update 0 again, so it is refused: put the checkpoints back, or to start the line over move " \
           "checkpoints/ and rows.jsonl away" in out
    assert f"problem: {checkpoints / 'latest'}: names u00000012, which is missing; no checkpoint to resume " \
           "from is left (a start is refused: `nsconsole check` says why)" in format_status(line_status(line))


def test_check_and_status_skip_a_damaged_checkpoint_before_a_missing_latest_as_a_start_does(
    tmp_path: Path, data_template: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = make_line(tmp_path, copy_data_line(data_template, tmp_path))
    assert Trainer(line, stop_at=12, echo=None).run() == 0  # u0, u5, u10 (cycle 0's end), u12
    checkpoints = line / "checkpoints"
    shutil.rmtree(checkpoints / "u00000012")  # `latest` names it
    model = checkpoints / "u00000010" / "model.safetensors"
    size = model.stat().st_size
    os.truncate(model, 100)
    assert find_resume_point(checkpoints).checkpoint.update == 5  # the trainer's start skips u10

    out = _check(line, capsys)
    assert f"FAIL: checkpoints: {checkpoints / 'latest'}: names u00000012, which is missing" in out
    assert f"FAIL: checkpoints: {model}: 100 bytes, meta.json says {size} (truncated?); a start resumes from " \
           "u00000005, the newest before it" in out
    assert any(text.startswith("ok: model: transformer-tiny") and text.endswith(" loads u00000005") for text in out)
    assert "ok: rows.jsonl: holds the 5 rows u00000005 counts" in out
    # u10 ended cycle 0: only as damaged, never as where the start resumes (from u5, in the consumed cycle 0).
    assert not [text for text in out if "u00000010" in text and str(model) not in text
                and "(u00000010 after it is damaged), inside cycle 0" not in text], out  # fmt: skip

    report = format_status(line_status(line))
    assert any(text.startswith("checkpoints: 3 (") and text.endswith(
        "latest u00000012 (missing); a start resumes from u00000005 (not verified), and is refused there (see the "
        "problem)") for text in report), report  # u5 stands inside cycle 0, which u10 ended
    assert f"problem: {checkpoints / 'latest'}: names u00000012, which is missing" in report
    assert f"problem: {model}: 100 bytes, meta.json says {size} (truncated?); a start resumes from u00000005, " \
           "the newest before it (not verified: `nsconsole check` hashes its files)" in report

    # Corrupted at its size, u10 is seen by its hashes alone: `check` hashes them, `status` does not
    # (it says so), and neither names u10 as where a start resumes.
    os.truncate(model, size)
    out = _check(line, capsys)
    assert f"FAIL: checkpoints: {model}: blake2b mismatch (corrupted); a start resumes from u00000005, the newest " \
           "before it" in out
    assert "ok: rows.jsonl: holds the 5 rows u00000005 counts" in out
    assert find_resume_point(checkpoints).checkpoint.update == 5
    assert f"problem: {checkpoints / 'latest'}: names u00000012, which is missing; a start resumes from " \
           "u00000010, the newest before it (not verified: `nsconsole check` hashes its files)" in (
        format_status(line_status(line)))  # fmt: skip


def test_a_start_fallen_back_into_a_consumed_cycle_is_refused_by_check_status_and_the_trainer(
    tmp_path: Path, data_template: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `check` passed it (`current data cycle: 0 ended (its end checkpoint moves the line on)`),
    # judging by u10, the cycle-end checkpoint the start skips as damaged; the start then stopped
    # with `.../c0000: cycle 0 was consumed and its shards deleted` and no word of why.
    data = copy_data_line(data_template, tmp_path)
    line = make_line(tmp_path, data)
    assert Trainer(line, stop_at=12, echo=None).run() == 0  # u0, u5, u10 (cycle 0's end), u12
    cycle = data / "cycles" / "c0000"
    assert (cycle / "consumed").exists()
    for shard in [*cycle.glob("*.tokens"), *cycle.glob("*.docs")]:
        shard.unlink()  # as the line's preparer deletes a consumed cycle's shards
    checkpoints = line / "checkpoints"
    shutil.rmtree(checkpoints / "u00000012")
    os.truncate(checkpoints / "u00000010" / "model.safetensors", 100)
    refusal = (
        f"{checkpoints / 'u00000005'}: a start resumes from it (u00000010 after it is damaged), inside cycle 0, "
        f"and {cycle}: cycle 0 was consumed and its shards deleted, so the line cannot go on from there; restore "
        f"u00000010 from a copy if there is one, or `nsconsole rollback {line} --to 5` reopens cycle 0 (the "
        "line's data preparer rebuilds its shards from the manifest, byte for byte)"
    )

    assert f"FAIL: current data cycle: {refusal}" in _check(line, capsys)
    report = format_status(line_status(line))
    assert any(text.startswith("checkpoints: 3 (") and text.endswith(
        "a start resumes from u00000005 (not verified), and is refused there (see the problem)")
        for text in report), report  # fmt: skip
    assert f"problem: {refusal}" in report
    with pytest.raises(LineError) as refused:
        start_without_preparer(line)  # `nsconsole run --no-supervisor`, before the trainer loads
    assert str(refused.value).endswith(f": current data cycle: {refusal}")
    with pytest.raises(CheckpointError) as refused:
        Trainer(line, echo=None).run()  # the trainer's own refusal says why, not only what
    assert str(refused.value) == refusal

    # Fallen back to u0, at the cycle's start, the start reopens the cycle itself (`claim_cycle`)
    # and the line's preparer rebuilds its shards: not refused.
    os.truncate(checkpoints / "u00000005" / "model.safetensors", 100)
    assert "ok: current data cycle: 0 was consumed by this line after u00000000, where a start resumes at the " \
           "cycle's start; the start reopens it and the line's data preparer rebuilds its shards from the " \
           "manifest" in _check(line, capsys)
    assert not [text for text in format_status(line_status(line)) if "refused there" in text]
