"""Checkpoints: round trip, corruption detection, fallback, retention, interrupted writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

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
