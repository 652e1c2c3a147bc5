"""`nsconsole status`: the last validation (found backwards across blocks) and the W&B run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.ops import status as status_module
from engine.ops.status import line_status, read_last_validation
from engine.wandb.state import LocalRunFiles, PendingStart, WandbRunState
from nsconsole.commands.status import format_status


def write_rows(path: Path, rows: list[dict], torn: str = "") -> None:
    path.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows) + torn)


def test_last_validation_is_found_backwards_across_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(status_module, "TAIL_BLOCK_BYTES", 37)  # many blocks, lines cut at every boundary
    rows = [{"update": u, "loss": 5.0 - u / 100, "padding": "x" * (u % 7)} for u in range(1, 60)]
    rows[20]["val_32/mix"] = 4.5
    rows[40]["val_32/mix"] = 4.25
    rows[40]["ema/val_32/mix"] = 4.2
    path = tmp_path / "rows.jsonl"
    write_rows(path, rows, torn='{"update": 60, "val_32/mix": 1.0')  # a torn last line is not a row
    assert read_last_validation(path) == rows[40]
    write_rows(path, rows[:30])
    assert read_last_validation(path) == rows[20]
    write_rows(path, rows[:10])
    assert read_last_validation(path) is None
    assert read_last_validation(tmp_path / "missing.jsonl") is None


def test_status_shows_the_last_validation_and_the_wandb_run(tmp_path: Path) -> None:
    line = tmp_path / "line"
    line.mkdir()
    (line / "run.json").write_text(
        json.dumps({"model": {"preset": "transformer-tiny"}, "data": {"line": "d"}})
    )
    write_rows(line / "rows.jsonl", [
        {"update": 1, "loss": 5.0},
        {"update": 2, "loss": 4.9, "val_32/text": 4.8, "val_32/mix": 4.8, "val_32/mean": 4.8,
         "opt/decay/param_norm": 3.0},
        {"update": 3, "loss": 4.7, "gpu_mode": "shared"},
    ])  # fmt: skip
    state = WandbRunState(run_id="abc123", start="resume", acknowledged_step=2)
    state.pending = PendingStart(kind="rewind", at_update=1)
    state.save(line / "wandb_run.json")
    status = line_status(line)
    assert status.last_validation is not None and status.last_validation["update"] == 2
    assert status.wandb is not None and status.wandb.run_id == "abc123"
    text = "\n".join(format_status(status))
    assert "validation (update 2, 4 metrics):" in text
    rows = [line for line in text.splitlines() if line.startswith("  update ")]
    assert "GPU SHARED" in rows[-1] and not any("GPU SHARED" in line for line in rows[:-1])
    assert "  val_32/mix 4.8" in text and "  val_32/mean 4.8" in text
    assert "W&B: run abc123 (resume), acknowledged step 2; next start: rewind at update 1" in text


def test_status_without_validation_or_wandb(tmp_path: Path) -> None:
    line = tmp_path / "line"
    line.mkdir()
    (line / "run.json").write_text(
        json.dumps({"model": {"preset": "transformer-tiny"}, "data": {"line": "d"}})
    )
    (line / "wandb_run.json").write_text("{not json")
    status = line_status(line)
    text = "\n".join(format_status(status))
    assert "validation: none yet" in text
    # Not "no run yet": the run's record is damaged, and the next start replaces it.
    assert "W&B: wandb_run.json unreadable (below); the next start sets it aside and starts a new run" in text
    assert any("wandb_run.json" in problem for problem in status.problems)


def test_status_counts_the_offline_directories_wandb_sync_has_not_uploaded(tmp_path: Path) -> None:
    line = tmp_path / "line"
    (line / "wandb").mkdir(parents=True)
    (line / "run.json").write_text(json.dumps({"model": {"preset": "transformer-tiny"}, "data": {"line": "d"}}))
    state = WandbRunState(run_id="abc123", start="resume", acknowledged_step=2)
    for name in ("offline-run-1-abc123", "offline-run-2-abc123", "offline-run-3-abc123"):
        directory = line / "wandb" / name
        directory.mkdir()
        (directory / "run-abc123.wandb").write_bytes(b"log")
        state.local_files.append(LocalRunFiles(str(directory), "abc123", offline=True))
    (line / "wandb" / "offline-run-1-abc123" / "run-abc123.wandb.synced").write_bytes(b"")  # uploaded
    state.save(line / "wandb_run.json")
    text = "\n".join(format_status(line_status(line)))
    assert f"; 2 offline directories not uploaded (wandb sync {line / 'wandb'}/offline-run-*)" in text


def test_status_names_the_ranks_of_a_line_above_degree_one(tmp_path: Path) -> None:
    line = tmp_path / "line"
    line.mkdir()
    document = {"model": {"preset": "transformer-tiny"}, "data": {"line": "d"}, "device": "cpu"}
    (line / "run.json").write_text(json.dumps(document))
    [config_line] = [text for text in format_status(line_status(line)) if text.startswith("tokens per update")]
    assert config_line.endswith("; device cpu")
    (line / "run.json").write_text(json.dumps(document | {"parallel": {"degree": 2}}))
    [config_line] = [text for text in format_status(line_status(line)) if text.startswith("tokens per update")]
    assert config_line.endswith("; device cpu; 2 ranks (none; their logs in ranks/)")
