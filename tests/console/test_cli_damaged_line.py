"""The commands a user runs on a damaged line (found in a bad-input walkthrough).

A line whose `checkpoints/latest` is damaged (garbage, removed, naming a checkpoint that is gone)
resumes from the newest checkpoint before it, and the commands read the line from there: `branch`
said "has no checkpoint yet; cycle 0 has not ended" of a line past it, `rollback` "not before the
line's latest checkpoint (none)", and `status` said nothing of a missing `latest` or of a line
whose every checkpoint is gone. A rows.jsonl or heartbeat that is a directory was a traceback in
`check`, `status`, `rollback` and `run`; each now says so in one line and changes nothing. A line
directory on a read-only file system was a traceback in `run` (every form), `rollback`, `tune` and
`branch`, and `branch` left the whole branch behind before failing on the trunk's branches.json."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers.lines import copy_data_line, data_template_fixture, make_line

from datalines import open_data_line
from engine.training.trainer import Trainer
from nsconsole.cli import main

pytestmark = pytest.mark.usefixtures("one_thread", "private_host")

data_template = data_template_fixture()


@pytest.fixture
def line(tmp_path: Path, data_template: Path) -> Path:
    """A line trained to update 12: checkpoints u0, u5, u10 (cycle 0's end) and u12."""
    line = make_line(tmp_path, copy_data_line(data_template, tmp_path))
    assert Trainer(line, stop_at=12, echo=None).run() == 0
    return line


def _hashes(root: Path) -> dict[str, str]:
    """Every file of the line by its hash, but the W&B client's own directory (`wandb/`): its service
    process goes on writing there after the trainer that started it has exited."""
    return {str(path): hashlib.blake2b(path.read_bytes()).hexdigest() for path in root.rglob("*")
            if path.is_file() and (root / "wandb") not in path.parents}  # fmt: skip


def _branch(new: Path, line: Path, data: Path) -> list[str]:
    """`nsconsole branch NEW --from LINE --at-cycle 0 --plan decay:100 --data DATA`."""
    return ["branch", str(new), "--from", str(line), "--at-cycle", "0", "--plan", "decay:100", "--data", str(data)]


DAMAGE = {
    "garbage": lambda latest: latest.write_text("hello"),
    "removed": lambda latest: latest.unlink(),
    "names a checkpoint that is gone": lambda latest: latest.write_text("u00000099\n"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_branch_and_rollback_read_the_line_from_the_checkpoint_a_start_resumes_from(
    line: Path, data_template: Path, tmp_path: Path, damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    DAMAGE[damage](line / "checkpoints" / "latest")
    branch_data = copy_data_line(data_template, tmp_path / "branch-data")
    command = _branch(tmp_path / "b", line, branch_data)
    assert main(command) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith(f"branch {tmp_path / 'b'} from {line} after update 10 ")

    assert main(["rollback", str(line), "--to", "5"]) == 0, capsys.readouterr().err
    assert (line / "checkpoints" / "latest").read_text() == "u00000005\n"  # mended: it names a checkpoint


def test_a_rollback_past_a_damaged_latest_checkpoint_mends_the_line(
    line: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `latest` names u12, whose state.json is gone: a start resumes from u10, and a rollback to u10
    # (back from the checkpoint `latest` names) is how the user puts `latest` right.
    (line / "checkpoints" / "u00000012" / "state.json").unlink()
    assert main(["status", str(line)]) == 0
    assert f"problem: {line / 'checkpoints' / 'u00000012' / 'state.json'}: missing or unreadable (a damaged " \
           "checkpoint); a start resumes from u00000010, the newest before it" in capsys.readouterr().out
    assert main(["rollback", str(line), "--to", "10"]) == 0, capsys.readouterr().err
    assert (line / "checkpoints" / "latest").read_text() == "u00000010\n"


def test_status_and_branch_name_a_line_whose_checkpoints_are_gone(
    line: Path, data_template: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoints = line / "checkpoints"
    (checkpoints / "latest").unlink()
    assert main(["status", str(line)]) == 0
    assert f"problem: {checkpoints / 'latest'}: missing; a start resumes from u00000012, the newest (not verified: " \
           "`nsconsole check` hashes its files)" in (
        capsys.readouterr().out.splitlines())  # fmt: skip

    for state in checkpoints.glob("u*/state.json"):
        state.unlink()  # every checkpoint damaged: no start can resume
    saved = _hashes(line)
    branch_data = copy_data_line(data_template, tmp_path / "branch-data")
    command = _branch(tmp_path / "b", line, branch_data)
    assert main(command) == 2
    assert capsys.readouterr().err == (
        f"nsconsole: {checkpoints}: no checkpoint with a readable state.json (u00000000, u00000005, u00000010, "
        "u00000012), though the line has trained; put its checkpoints back to branch it\n"
    )
    assert not (tmp_path / "b").exists() and _hashes(line) == saved

    shutil.rmtree(checkpoints)
    assert main(["status", str(line)]) == 0
    assert f"problem: {checkpoints}: no checkpoint to resume from is left, but the line has trained " \
           f"({line / 'rows.jsonl'} holds" in capsys.readouterr().out


def _run_no_supervisor(line: Path) -> subprocess.CompletedProcess[str]:
    """`nsconsole run LINE --no-supervisor` in a process of its own, as a user runs it."""
    command = [sys.executable, "-m", "nsconsole.cli", "run", str(line), "--no-supervisor", "--stop-at", "13"]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


def test_a_rows_jsonl_that_is_a_directory_is_named_by_every_command(
    line: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = line / "rows.jsonl"
    rows.unlink()
    rows.mkdir()
    saved = _hashes(line)
    said = f"{rows}: a directory, not the file of the line's rows; move it away"

    assert main(["check", str(line)]) == 1
    assert f"FAIL: rows.jsonl: {said}; put the line's rows.jsonl back in its place (from a backup if need be); " \
           "the checkpoints are kept" in capsys.readouterr().out.splitlines()
    assert main(["status", str(line)]) == 0
    assert f"problem: {said}" in capsys.readouterr().out.splitlines()
    assert main(["rollback", str(line), "--to", "5"]) == 2
    assert capsys.readouterr().err == f"nsconsole: {said}\n"
    assert main(["run", str(line), "--foreground"]) == 2  # the supervisor's own start read it: a traceback
    assert capsys.readouterr().err == f"nsconsole: {said}\n"
    ran = _run_no_supervisor(line)
    assert ran.returncode == 2 and "Traceback" not in ran.stderr
    assert ran.stderr.splitlines()[-1].startswith(f"nsconsole: {said}; ")
    assert _hashes(line) == saved


def test_a_heartbeat_that_is_a_directory_is_named_by_status_and_refused_by_a_start(
    line: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    heartbeat = line / "heartbeat"
    heartbeat.unlink()
    heartbeat.mkdir()
    said = f"{heartbeat}: a directory, not the line's heartbeat file; move it away"
    assert main(["status", str(line)]) == 0
    assert f"problem: {said}" in capsys.readouterr().out.splitlines()
    assert main(["run", str(line), "--foreground"]) == 2
    assert capsys.readouterr().err == f"nsconsole: {said}\n"
    ran = _run_no_supervisor(line)
    assert ran.returncode == 2 and "Traceback" not in ran.stderr
    assert ran.stderr.splitlines()[-1] == f"nsconsole: {said}"
    assert len((line / "rows.jsonl").read_text().splitlines()) == 12  # no update trained past the checkpoint


def test_a_path_that_is_not_a_line_directory_is_named_for_what_it_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A file given as LINE was "no such training line directory"; a run.json that is a directory
    # was "not a training line (no run.json)"; a directory holding no line, `status DIR`'s
    # "not a training line" alone.
    line = tmp_path / "line"
    (line / "run.json").mkdir(parents=True)
    assert main(["check", str(line)]) == 2
    assert capsys.readouterr().err == f"nsconsole: {line / 'run.json'}: a directory, not the line's run.json; move it away\n"
    (line / "run.json").rmdir()
    (line / "run.json").write_text("{}")
    assert main(["status", str(line / "run.json")]) == 2
    assert capsys.readouterr().err == (
        f"nsconsole: {line / 'run.json'}: not a directory; a training line is a directory holding run.json\n"
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["status", str(empty)]) == 2
    assert capsys.readouterr().err == (
        f"nsconsole: {empty}: not a training line (no run.json), and no line directly under it\n"
    )


def test_tune_of_a_cuda_line_without_a_gpu_names_its_run_json(
    tmp_path: Path, data_template: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if torch.cuda.is_available():
        pytest.skip("the refusal is of a machine without a GPU")
    line = make_line(tmp_path, copy_data_line(data_template, tmp_path), device="cuda")
    assert main(["tune", str(line)]) == 2
    assert capsys.readouterr().err == (
        f"nsconsole: {line / 'run.json'}: device is 'cuda' but no CUDA device is available\n"
    )
    # The trainer itself (`run --no-supervisor`: no supervisor's start checks before it) names it too.
    assert main(["run", str(line), "--no-supervisor"]) == 2
    assert capsys.readouterr().err.endswith(
        f"nsconsole: {line / 'run.json'}: device is 'cuda' but no CUDA device is available\n"
    )


@pytest.fixture
def read_only(line: Path) -> Iterator[Path]:
    """`line` made read-only: a read-only bind mount as root (who writes through any permission;
    skipped where mounting is not allowed), its permissions otherwise."""
    if os.geteuid() != 0:
        modes = {path: path.stat().st_mode for path in (line, line / "checkpoints")}
        for path in modes:
            path.chmod(0o555)
        yield line
        for path, mode in modes.items():
            path.chmod(mode)
        return
    for options in (["--bind"], ["-o", "remount,ro,bind"]):
        if subprocess.run(["mount", *options, str(line), str(line)], capture_output=True, check=False).returncode:
            subprocess.run(["umount", "-l", str(line)], capture_output=True, check=False)
            pytest.skip("a read-only bind mount needs the right to mount")
    try:
        yield line
    finally:
        subprocess.run(["umount", "-l", str(line)], check=False)


def test_a_read_only_line_is_refused_in_one_line_by_every_command_that_writes_it(
    read_only: Path, data_template: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = read_only
    saved = _hashes(line)
    said = f"{line}: not writable (a read-only file system, or no write permission), and {{}} writes there; " \
           "nothing was changed"
    for command, doing in [
        (["run", str(line), "--no-supervisor"], "a run"),
        (["run", str(line), "--foreground"], "a run"),
        (["run", str(line)], "a run"),
        (["--run", str(line)], "a run"),
        (["rollback", str(line), "--to", "5"], "a rollback"),
        (["tune", str(line)], "tune (its run.json)"),
        (_branch(tmp_path / "b", line, copy_data_line(data_template, tmp_path / "branch-data")),
         "a branch (the trunk's branches.json)"),
    ]:  # fmt: skip
        assert main(command) == 2, command
        assert capsys.readouterr().err == f"nsconsole: {said.format(doing)}\n", command
    assert not (tmp_path / "b").exists()  # the branch was made whole before the trunk's record failed
    assert _hashes(line) == saved


def test_status_names_an_accepted_run_json_that_refuses_every_start(
    tmp_path: Path, data_template: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `run` and `check` refused the line in one line while `status` said nothing of it.
    line = make_line(tmp_path, copy_data_line(data_template, tmp_path))
    (line / "accepted_run.json").write_text("{not json")
    assert main(["status", str(line)]) == 0
    assert f"problem: {line / 'accepted_run.json'}: malformed JSON at line 1 column 2: Expecting property name " \
           "enclosed in double quotes; a start is refused until it is mended (`nsconsole check` says so)" in (
        capsys.readouterr().out.splitlines())  # fmt: skip


def test_data_rebuild_of_a_cycle_the_data_line_never_has_says_so(
    tmp_path: Path, data_template: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # It said "cycle 99 is not prepared yet" of a line whose last cycle is 3: it never will be.
    data = copy_data_line(data_template, tmp_path)
    last = open_data_line(data).last_cycle()
    assert last is not None
    for cycle in (last + 1, -1):
        assert main(["data", "rebuild", "--work", str(data), "--cycle", str(cycle)]) == 2
        assert capsys.readouterr().err == (
            f"nsconsole: {data}: has no cycle {cycle} (cycles 0 to {last}); --cycle names one of them\n"
        )


def test_a_rollback_refused_for_a_damaged_wandb_run_json_leaves_the_line_as_it_was(
    line: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # It said "the rollback changed nothing" and left a rows.rolledback-*.jsonl behind, one a retry.
    (line / "wandb_run.json").write_text("{not json")
    saved = _hashes(line)
    assert main(["rollback", str(line), "--to", "5"]) == 2
    assert "the rollback changed nothing" in capsys.readouterr().err
    assert _hashes(line) == saved


def test_a_branch_refused_for_the_parents_damaged_wandb_run_json_names_it_and_makes_nothing(
    line: Path, data_template: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # It said only "wandb_run.json: malformed JSON ...": not whose, nor what to do.
    (line / "wandb_run.json").write_text("{not json")
    saved = _hashes(line)
    branch_data = copy_data_line(data_template, tmp_path / "branch-data")
    command = _branch(tmp_path / "b", line, branch_data)
    assert main(command) == 2
    assert capsys.readouterr().err == (
        f"nsconsole: {line / 'wandb_run.json'}: malformed JSON at line 1 column 2: Expecting property name "
        "enclosed in double quotes; the branch was not made: run the parent once (its start recovers the W&B "
        "run its checkpoints record) or move the file aside, and branch again\n"
    )
    assert not (tmp_path / "b").exists() and _hashes(line) == saved
    assert not list(tmp_path.glob(".b.*"))

    (line / "wandb_run.json").rename(line / "wandb_run.json.aside")  # the remedy it names
    assert main(command) == 0, capsys.readouterr().err


@pytest.fixture
def line_on_a_full_disk(tmp_path: Path, data_template: Path) -> Iterator[Path]:
    """A line trained to update 12 on a real 16 MiB tmpfs, then the tmpfs filled (mounting needs
    root, else the test is skipped)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)], capture_output=True, check=False
    ).returncode == 0
    if not mounted:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        line = make_line(disk, copy_data_line(data_template, disk))
        assert Trainer(line, stop_at=12, echo=None).run() == 0
        with (disk / "filler").open("wb") as filler, contextlib.suppress(OSError):
            while True:
                filler.write(b"\0" * (1 << 16))
                filler.flush()
        yield line
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_commands_that_write_a_line_on_a_full_disk_say_so_in_one_line_and_change_nothing(
    line_on_a_full_disk: Path, data_template: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Each was a traceback; the rollback left a .rows.rolledback-*.jsonl.partial behind.
    line = line_on_a_full_disk
    disk = line.parent
    saved = _hashes(line)
    branch_data = copy_data_line(data_template, tmp_path / "branch-data")
    full = "No space left on device"
    for command, named, doing in [
        (["rollback", str(line), "--to", "5"], None, "the rollback"),
        (["tune", str(line)], line / "run.json", "tune"),
        (_branch(disk / "b", line, branch_data), None, "the branch"),
    ]:  # fmt: skip
        assert main(command) == 2, command
        err = capsys.readouterr().err
        assert err.startswith("nsconsole: ") and err.count("\n") == 1, err
        assert f": {full} ({doing} stopped there; free some space if the disk is full, and run it again)" in err
        if named is not None:
            assert err.startswith(f"nsconsole: {named}: ")
    assert _hashes(line) == saved
    assert sorted(path.name for path in disk.iterdir()) == ["data", "filler", "line"]  # no half-made branch
