"""A cycle whose permanent manifest is damaged or gone (fault walk, item 4).

A truncated manifest: the preparer and the waiting trainer say how to recover, and `data rebuild`
writes it again from the cycle's plan when the shards still in the cycle directory prove it (the
rebuild from the plan gives them byte for byte), else refuses in one line that says what to do.
A cycle directory without a manifest (moved aside): prepared again in place when what it holds
is the cycle's own shards, refused in one line, with nothing deleted, when it holds anything else.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers.data import make_web_chat_recipe

from datalines import DataLineError, open_data_line
from datalines.creation import init_data_line
from datalines.dataline import CONSUMED_MARK, DataLine
from datalines.manifest import MANIFEST_NAME
from datalines.preparer import prepare_cycle
from datalines.service import run_preparer
from nsconsole.cli import main

CYCLE_TOKENS = 5000


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_web_chat_recipe(tmp_path_factory.mktemp("inputs"))


@pytest.fixture(scope="module")
def prepared(recipe: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data line with cycles 0..2 prepared (each test works on a copy)."""
    line = init_data_line(tmp_path_factory.mktemp("prepared") / "line", recipe, 0, CYCLE_TOKENS, None)
    assert run_preparer(line, ahead=3, min_free_bytes=0, once=True).ready == [0, 1, 2]
    return line.path


def _copy(prepared: Path, tmp_path: Path) -> DataLine:
    shutil.copytree(prepared, tmp_path / "line")
    return open_data_line(tmp_path / "line")


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def _truncate_manifest(line: DataLine, index: int) -> bytes:
    """What the walk did (`head -c 500`); returns the manifest's bytes before."""
    path = line.cycle_dir(index) / MANIFEST_NAME
    original = path.read_bytes()
    path.write_bytes(original[:500])
    return original


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _rebuild(line: DataLine, index: int) -> int:
    return main(["data", "rebuild", "--work", str(line.path), "--cycle", str(index)])


def test_a_truncated_manifest_says_how_to_recover_and_rebuild_writes_it_again(
    prepared: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _copy(prepared, tmp_path)
    original = _truncate_manifest(line, 2)
    recovery = f"`nsconsole data rebuild --work {line.path} --cycle 2`"

    # The trainer waiting for the cycle and the preparer that fails on it both say what to do.
    problem = open_data_line(line.path).cycle_problem(2)
    assert problem is not None and "manifest.json: not valid JSON" in problem and recovery in problem
    with pytest.raises(DataLineError, match="not valid JSON") as failure:
        run_preparer(open_data_line(line.path), ahead=3, min_free_bytes=0, once=True)
    assert recovery in str(failure.value) and "\n" not in str(failure.value)

    assert _rebuild(line, 2) == 0
    out = capsys.readouterr().out
    assert f"cycle 2: {line.cycle_dir(2) / MANIFEST_NAME} written again from {line.path / 'plans' / 'c0002.json'}" in out
    assert (line.cycle_dir(2) / MANIFEST_NAME).read_bytes() == original  # byte for byte what was there
    fresh = open_data_line(line.path)
    assert fresh.cycle_state(2) == "ready"
    assert run_preparer(fresh, ahead=3, min_free_bytes=0, once=True).ready == [0, 1, 2]


def test_rebuild_refuses_a_manifest_whose_shards_do_not_prove_it(
    prepared: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _copy(prepared, tmp_path)
    _truncate_manifest(line, 2)
    _flip_a_byte(line.cycle_dir(2) / "web.tokens")  # the shards are no longer a witness
    before = _snapshot(line.cycle_dir(2))

    assert _rebuild(line, 2) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "web.tokens" in error and "restore" in error and "backup" in error
    assert _snapshot(line.cycle_dir(2)) == before  # nothing written, nothing deleted
    assert not list((line.path / "cycles").glob(".tmp-*"))


def test_rebuild_refuses_the_manifest_of_a_consumed_cycle(
    prepared: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _copy(prepared, tmp_path)
    line.mark_consumed(0)
    run_preparer(line, ahead=2, min_free_bytes=0, once=True)  # deletes cycle 0's shards
    _truncate_manifest(line, 0)
    before = _snapshot(line.cycle_dir(0))

    assert open_data_line(line.path).cycle_state(0) == "consumed"
    assert _rebuild(line, 0) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "consumed" in error and "backup" in error and "--like" in error
    assert _snapshot(line.cycle_dir(0)) == before


def test_a_cycle_directory_without_its_manifest_is_prepared_again_in_place(
    prepared: Path, tmp_path: Path
) -> None:
    line = _copy(prepared, tmp_path)
    good = _snapshot(line.cycle_dir(1))
    (line.cycle_dir(1) / MANIFEST_NAME).rename(tmp_path / "moved-aside.json")  # the walk's manual fix

    def no_retry(seconds: float) -> None:
        raise AssertionError("the preparer retried: a cycle without a manifest must not loop")

    status = run_preparer(line, ahead=3, min_free_bytes=0, once=True, sleep=no_retry)
    assert status.state == "ready" and status.ready == [0, 1, 2]
    assert _snapshot(line.cycle_dir(1)) == good
    assert not list((line.path / "cycles").glob(".tmp-*"))


def test_a_cycle_directory_without_a_manifest_holding_other_files_is_refused(
    prepared: Path, tmp_path: Path
) -> None:
    line = _copy(prepared, tmp_path)
    directory = line.cycle_dir(1)
    (directory / MANIFEST_NAME).rename(directory / "manifest.json.bad")
    before = _snapshot(directory)

    with pytest.raises(DataLineError, match=r"c0001: cycle 1 has no manifest.json and holds manifest.json.bad") as refusal:
        prepare_cycle(line, 1)
    assert "\n" not in str(refusal.value) and "move" in str(refusal.value)
    assert _snapshot(directory) == before


def test_a_cycle_directory_without_a_manifest_whose_shards_differ_is_refused(
    prepared: Path, tmp_path: Path
) -> None:
    line = _copy(prepared, tmp_path)
    directory = line.cycle_dir(1)
    (directory / MANIFEST_NAME).unlink()
    _flip_a_byte(directory / "chat.tokens")  # maybe what a trainer read: never replaced unseen
    before = _snapshot(directory)

    with pytest.raises(DataLineError, match=r"cycle 1 has no manifest.json and its chat.tokens differs") as refusal:
        prepare_cycle(line, 1)
    assert "\n" not in str(refusal.value)
    assert _snapshot(directory) == before
    assert not list((line.path / "cycles").glob(".tmp-*"))


def test_a_consumed_cycle_without_a_manifest_is_refused(prepared: Path, tmp_path: Path) -> None:
    line = _copy(prepared, tmp_path)
    line.mark_consumed(1)
    (line.cycle_dir(1) / MANIFEST_NAME).unlink()
    before = _snapshot(line.cycle_dir(1))

    with pytest.raises(DataLineError, match=rf"cycle 1 is marked {CONSUMED_MARK} but has no manifest.json") as refusal:
        prepare_cycle(line, 1)
    assert "backup" in str(refusal.value)
    assert _snapshot(line.cycle_dir(1)) == before


def test_a_manifest_that_is_a_directory_is_damage_named_not_a_cycle_to_prepare(
    prepared: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before, it read as "not prepared yet": `data status` said planned, while the preparer refused the
    # directory as a leftover.
    line = _copy(prepared, tmp_path)
    manifest = line.cycle_dir(1) / MANIFEST_NAME
    original = manifest.read_bytes()
    manifest.unlink()
    shards = _snapshot(line.cycle_dir(1))
    manifest.mkdir()
    (manifest / "notes.txt").write_text("someone's file")
    damage = f"{manifest}: a directory, not the cycle's manifest; move it out of the cycle directory, then"

    assert main(["data", "status", "--work", str(line.path)]) == 1
    assert f"cycle    1  damaged: {damage}" in capsys.readouterr().out
    assert _rebuild(line, 1) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and damage in error
    assert (manifest / "notes.txt").read_text() == "someone's file"  # nothing written over it, nothing deleted

    shutil.move(manifest, tmp_path / "moved-aside")
    assert _snapshot(line.cycle_dir(1)) == shards  # what the error says to do
    assert _rebuild(line, 1) == 0
    assert manifest.read_bytes() == original
