"""Checkpoints: round trip, corruption detection, fallback, retention, interrupted writes."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

from engine.checkpoints.format import (
    LATEST_NAME,
    apply_retention,
    checkpoint_name,
    discard_partial_writes,
    list_checkpoints,
    read_latest,
    verify_checkpoint,
    verify_line_checkpoints,
    write_latest,
)
from engine.checkpoints.tensors import (
    CheckpointSnapshot,
    CheckpointWriter,
    find_resume_point,
    load_checkpoint,
    write_checkpoint,
)
from engine.errors import CheckpointError


def make_snapshot(update: int, kept: str | None = None) -> CheckpointSnapshot:
    generator = torch.Generator().manual_seed(update)
    flat = torch.randn(40, generator=generator)
    return CheckpointSnapshot(
        update=update,
        # Views of one flat buffer, as the trainer hands them over.
        weights={"embed.weight": flat[:24].view(4, 6), "norm.weight": flat[24:40]},
        optimizer={
            "exp_avg": torch.randn(40, generator=generator),
            "exp_avg_sq": torch.rand(40, generator=generator),
            "step": torch.tensor(float(update)),
        },
        extra={"bank.keys": torch.randn(3, 2, generator=generator), "rng/cpu": torch.get_rng_state()},
        state={"tokens_trained": update * 100, "kept": kept, "rows": update, "rows_bytes": update * 10},
        run_json=b'{"model": {"preset": "transformer-tiny"}}\n',
        tokenizer_json=b'{"model": "bpe"}',
    )


def save(checkpoints_dir: Path, snapshot: CheckpointSnapshot, keep_last: int = 2) -> Path:
    return CheckpointWriter(checkpoints_dir, keep_last).save_and_wait(snapshot)


def test_a_reader_loads_only_the_optimizer_tensors_it_names(tmp_path: Path) -> None:
    """sample, chat and eval read no AdamW moments (8 of a checkpoint's 12 bytes a parameter); the
    checkpoint is still verified whole first."""
    snapshot = make_snapshot(7)
    directory = save(tmp_path, snapshot)
    assert load_checkpoint(directory, optimizer_keys=()).optimizer == {}
    some = load_checkpoint(directory, optimizer_keys=("step", "ema"))  # "ema" is not there: left out
    assert list(some.optimizer) == ["step"] and torch.equal(some.optimizer["step"], snapshot.optimizer["step"])
    (directory / "optimizer.safetensors").write_bytes(b"damaged")
    with pytest.raises(CheckpointError, match="optimizer.safetensors"):
        load_checkpoint(directory, optimizer_keys=())


def test_round_trip_is_exact(tmp_path: Path) -> None:
    snapshot = make_snapshot(7, kept="line-start")
    directory = save(tmp_path, snapshot)
    assert directory.name == "u00000007"
    assert read_latest(tmp_path) == "u00000007"
    loaded = load_checkpoint(directory)
    assert loaded.update == 7
    for key, tensor in snapshot.weights.items():
        assert torch.equal(loaded.weights[key], tensor)
    for key, tensor in snapshot.optimizer.items():
        assert torch.equal(loaded.optimizer[key], tensor)
    assert torch.equal(loaded.extra["rng/cpu"], snapshot.extra["rng/cpu"])
    assert loaded.state["tokens_trained"] == 700 and loaded.state["kept"] == "line-start"
    assert loaded.state["code_version"]
    assert loaded.run_json == snapshot.run_json and loaded.tokenizer_json == snapshot.tokenizer_json
    meta = json.loads((directory / "meta.json").read_text())
    assert set(meta["files"]) == {p.name for p in directory.iterdir()} - {"meta.json"}


@pytest.mark.parametrize("damage", ["truncate", "flip", "missing"])
def test_damage_is_detected_and_named(tmp_path: Path, damage: str) -> None:
    checkpoints_dir = tmp_path / "checkpoints"
    directory = save(checkpoints_dir, make_snapshot(3))
    target = directory / "optimizer.safetensors"
    data = target.read_bytes()
    if damage == "truncate":
        target.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        position = len(data) - 5
        target.write_bytes(data[:position] + bytes([data[position] ^ 0x01]) + data[position + 1 :])
    else:
        target.unlink()
    with pytest.raises(CheckpointError, match="optimizer.safetensors"):
        verify_checkpoint(directory)
    with pytest.raises(CheckpointError, match="optimizer.safetensors"):
        load_checkpoint(directory)
    problems = verify_line_checkpoints(tmp_path)
    assert len(problems) == 1 and "optimizer.safetensors" in problems[0]


def test_resume_falls_back_to_newest_good(tmp_path: Path) -> None:
    for update in (1, 2, 3):
        save(tmp_path, make_snapshot(update), keep_last=5)
    (tmp_path / "u00000003" / "model.safetensors").write_bytes(b"garbage")
    point = find_resume_point(tmp_path)
    assert point.checkpoint is not None and point.checkpoint.update == 2
    assert len(point.problems) == 1 and "u00000003/model.safetensors" in point.problems[0]


def test_resume_ignores_checkpoints_after_latest_and_fails_loudly_when_none_is_good(tmp_path: Path) -> None:
    for update in (1, 2):
        save(tmp_path, make_snapshot(update), keep_last=5)
    write_latest(tmp_path, "u00000001")  # e.g. a rollback
    assert find_resume_point(tmp_path).checkpoint.update == 1
    (tmp_path / "u00000001" / "meta.json").unlink()
    with pytest.raises(CheckpointError, match="no good checkpoint"):
        find_resume_point(tmp_path)
    assert find_resume_point(tmp_path / "empty").checkpoint is None


def test_retention_keeps_latest_kept_and_newest_rolling(tmp_path: Path) -> None:
    kept = {0: "line-start", 4: "cycle-end", 7: "length-change"}
    writer = CheckpointWriter(tmp_path, keep_last=2)
    for update in range(11):
        writer.save(make_snapshot(update, kept=kept.get(update)))
    writer.wait()
    names = [path.name for path in list_checkpoints(tmp_path)]
    assert names == [checkpoint_name(u) for u in (0, 4, 7, 9, 10)]
    assert read_latest(tmp_path) == "u00000010"


def test_retention_removes_an_abandoned_continuation(tmp_path: Path) -> None:
    for update in (1, 2, 3):
        save(tmp_path, make_snapshot(update, kept="cycle-end" if update == 3 else None), keep_last=5)
    # The line resumed from u1 (u2 and u3 were, say, corrupted); its next checkpoint is u2 again.
    writer = CheckpointWriter(tmp_path, keep_last=5, abandoned_after=1)
    replacement = make_snapshot(2)
    replacement.state["tokens_trained"] = 12345
    writer.save_and_wait(replacement)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["u00000001", "u00000002"]
    assert load_checkpoint(tmp_path / "u00000002").state["tokens_trained"] == 12345
    # Later writes no longer treat newer checkpoints as abandoned.
    assert writer.abandoned_after is None


def test_interrupted_write_is_discarded_and_latest_untouched(tmp_path: Path) -> None:
    save(tmp_path, make_snapshot(1))
    partial = tmp_path / "u00000002.partial"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half")
    (tmp_path / f".{LATEST_NAME}.abc.tmp").write_text("u00000002\n")
    assert find_resume_point(tmp_path).checkpoint.update == 1
    assert discard_partial_writes(tmp_path) == [f".{LATEST_NAME}.abc.tmp", "u00000002.partial"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST_NAME, "u00000001"]


def test_line_check_reports_missing_latest_and_partials(tmp_path: Path) -> None:
    checkpoints_dir = tmp_path / "checkpoints"
    write_checkpoint(checkpoints_dir, make_snapshot(5))  # renamed but `latest` never moved
    (checkpoints_dir / "u00000006.partial").mkdir()
    problems = verify_line_checkpoints(tmp_path)
    assert any("latest: missing" in problem for problem in problems)
    assert any("u00000006.partial: an interrupted write" in problem for problem in problems)
    write_latest(checkpoints_dir, "u00000009")
    assert any("names u00000009, which is missing" in p for p in verify_line_checkpoints(tmp_path))


def test_writer_reports_a_failed_write(tmp_path: Path) -> None:
    blocker = tmp_path / "checkpoints"
    blocker.write_text("not a directory")
    writer = CheckpointWriter(blocker, keep_last=1)
    writer.save(make_snapshot(1))
    with pytest.raises(CheckpointError, match="checkpoint write failed"):
        writer.wait()


def test_apply_retention_without_latest_keeps_newest(tmp_path: Path) -> None:
    for update in (1, 2, 3):
        write_checkpoint(tmp_path, make_snapshot(update))
    assert apply_retention(tmp_path, keep_last=1) == ["u00000001", "u00000002"]


def test_a_pinned_checkpoint_outlives_retention_until_it_is_unpinned(tmp_path: Path) -> None:
    from engine.checkpoints.format import PINNED_NAME, pin_checkpoint, read_pinned, unpin_checkpoint

    for update in (1, 2, 3, 4):
        write_checkpoint(tmp_path, make_snapshot(update))
    write_latest(tmp_path, "u00000004")
    pin_checkpoint(tmp_path, "u00000002")
    assert apply_retention(tmp_path, keep_last=1) == ["u00000001", "u00000003"]
    assert apply_retention(tmp_path, keep_last=1, abandoned_after=1) == []  # an abandoned one too
    assert read_pinned(tmp_path) == {"u00000002"}
    unpin_checkpoint(tmp_path, "u00000002")
    assert not (tmp_path / PINNED_NAME).exists()
    assert apply_retention(tmp_path, keep_last=1) == ["u00000002"]


@pytest.mark.parametrize(
    "meta", ["[]", '"text"', '{"format": 1}', '{"format": 1, "files": {"model.safetensors": 3}}', "\xff"]
)
def test_meta_json_of_the_wrong_shape_is_named_and_the_previous_checkpoint_used(tmp_path: Path, meta: str) -> None:
    for update in (1, 2):
        save(tmp_path, make_snapshot(update), keep_last=5)
    (tmp_path / "u00000002" / "meta.json").write_bytes(meta.encode("latin-1"))
    with pytest.raises(CheckpointError, match="u00000002/meta.json: unreadable"):
        verify_checkpoint(tmp_path / "u00000002")
    point = find_resume_point(tmp_path)
    assert point.checkpoint is not None and point.checkpoint.update == 1
    assert "u00000002/meta.json" in point.problems[0]


def test_latest_replaced_by_a_directory_is_refused_and_nothing_is_removed(tmp_path: Path) -> None:
    for update in (1, 2):
        save(tmp_path, make_snapshot(update), keep_last=5)
    (tmp_path / LATEST_NAME).unlink()
    (tmp_path / LATEST_NAME).mkdir()
    assert read_latest(tmp_path) is None
    with pytest.raises(CheckpointError, match="latest: a directory, not the file naming the newest checkpoint"):
        find_resume_point(tmp_path)
    [problem] = verify_line_checkpoints(_as_line(tmp_path))
    assert "latest: a directory" in problem
    assert [path.name for path in list_checkpoints(tmp_path)] == ["u00000001", "u00000002"]


def test_latest_that_is_not_utf8_falls_back_to_the_newest_good(tmp_path: Path) -> None:
    for update in (1, 2):
        save(tmp_path, make_snapshot(update), keep_last=5)
    (tmp_path / LATEST_NAME).write_bytes(b"\xff\xfeu00000002\n")
    assert read_latest(tmp_path) is None
    point = find_resume_point(tmp_path)
    assert point.checkpoint is not None and point.checkpoint.update == 2
    assert point.problems == [f"{tmp_path / LATEST_NAME}: not text, so not a checkpoint's name (u and 8 digits)"]


def _as_line(checkpoints_dir: Path) -> Path:
    """A line directory whose `checkpoints` is `checkpoints_dir` (verify_line_checkpoints takes a line)."""
    line = checkpoints_dir.parent / "line"
    line.mkdir()
    (line / "checkpoints").symlink_to(checkpoints_dir)
    return line


def test_a_pinned_cycle_end_outlives_keep_cycle_ends_until_it_is_unpinned(tmp_path: Path) -> None:
    """A branch queued at the end of cycle 1 pins that end before it is written: the ends of cycles
    2 and 3 come before the fork is made, and `keep_cycle_ends 1` must not remove cycle 1's."""
    from engine.checkpoints.format import (
        PINNED_NAME,
        pin_checkpoint,
        pin_cycle_end,
        read_pinned,
        unpin_checkpoint,
        unpin_cycle_end,
    )

    pin_cycle_end(tmp_path / "checkpoints", 1)  # queued before the line has any checkpoint
    checkpoints = tmp_path / "checkpoints"
    for update, cycle in ((10, 0), (20, 1), (30, 2), (40, 3)):
        write_checkpoint(checkpoints, make_snapshot(update, kept=f"cycle-end {cycle}"))
        write_latest(checkpoints, checkpoint_name(update))
        apply_retention(checkpoints, keep_last=2, keep_cycle_ends=1)
    assert [path.name for path in list_checkpoints(checkpoints)] == ["u00000020", "u00000040"]
    pin_checkpoint(checkpoints, "u00000040")  # the two kinds of pin live side by side
    assert read_pinned(checkpoints) == {"cycle-end 1", "u00000040"}
    unpin_cycle_end(checkpoints, 1)
    assert (checkpoints / PINNED_NAME).read_text() == "u00000040  # rollback\n"
    unpin_checkpoint(checkpoints, "u00000040")
    assert not (checkpoints / PINNED_NAME).exists()
    assert apply_retention(checkpoints, keep_last=2, keep_cycle_ends=1) == ["u00000020"]


@pytest.mark.parametrize(
    "refusal",
    [OSError(errno.ENOSPC, "No space left on device"), OSError(errno.EDQUOT, "Disk quota exceeded"),
     # What safetensors' own writer raises: no errno, the OS error in its text only.
     SafetensorError('Error while serializing: I/O error: No space left on device (os error 28) at path "x"')],
)  # fmt: skip
def test_a_write_the_disk_refuses_is_disk_full_whatever_the_free_bytes_read(
    refusal: Exception, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC (the inodes ran out) or EDQUOT (a quota) while plenty of bytes read free, said by the OS
    or by safetensors: the line stops for the operator (DiskFull: `disk-full`), not as a failed line
    (a plain CheckpointError: exit 2, `failed`; found on a real tmpfs whose inodes ran out)."""
    from engine.checkpoints import tensors
    from engine.errors import DiskFull

    save(tmp_path, make_snapshot(1))

    def refused(_tensors: dict, path: Path) -> None:
        raise refusal

    monkeypatch.setattr(tensors, "save_file", refused)
    writer = CheckpointWriter(tmp_path, keep_last=2)
    writer.save(make_snapshot(2))
    with pytest.raises(DiskFull, match=r"the disk filled while checkpoint u00000002 was written \(.* GiB free, "
                                       r"enough for its .* GiB: its inodes or a quota ran out; .*\); the newest "
                                       r"complete one is u00000001; free some space and run the line again$"):
        writer.wait()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["latest", "u00000001"]  # no partial left


def test_a_line_whose_checkpoints_were_removed_by_hand_is_not_started_afresh(tmp_path: Path) -> None:
    """`latest` naming a checkpoint, or rows.jsonl holding rows, with no checkpoint left: a fresh start
    would cut rows.jsonl to nothing, so it is refused; a new line (neither) starts."""
    from engine.checkpoints.format import no_checkpoint_left_problem, resume_candidate
    from engine.layout import LineLayout

    layout = LineLayout(tmp_path / "line")
    layout.checkpoints.mkdir(parents=True)
    assert no_checkpoint_left_problem(layout) is None  # a new line
    for update in (5, 10):
        save(layout.checkpoints, make_snapshot(update), keep_last=5)
    layout.rows_jsonl.write_text('{"update": 1}\n' * 10)
    shutil.rmtree(layout.checkpoints / "u00000010")
    assert resume_candidate(layout.checkpoints) == layout.checkpoints / "u00000005"
    assert no_checkpoint_left_problem(layout) is None  # the trainer falls back to u5
    shutil.rmtree(layout.checkpoints / "u00000005")
    assert resume_candidate(layout.checkpoints) is None
    problem = no_checkpoint_left_problem(layout)
    assert problem is not None and problem.startswith(f"{layout.checkpoints}: no checkpoint to resume from is left")
    assert "latest names u00000010" in problem and "move checkpoints/ and rows.jsonl away" in problem
    (layout.checkpoints / LATEST_NAME).unlink()
    assert "rows.jsonl holds 140 bytes of rows" in (no_checkpoint_left_problem(layout) or "")
