"""bench/pssa_article.py end to end with a tiny token budget: identical data lines, two training
lines run through `nsconsole run --no-supervisor`, the rows a user reads (the full run is an
hour on 2 cores: bench/RESULTS.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "bench" / "pssa_article.py"


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)  # fmt: skip


@pytest.mark.slow
def test_both_models_train_the_same_tokens_and_are_compared(tmp_path: Path) -> None:
    out = tmp_path / "article"
    # Tiny presets (the data line's vocab 2048 replaces theirs) on a few stdlib packages, 2 updates.
    done = run_script("--tokens", "1024", "--out", str(out), "--include", "email/**", "--include", "json/**",
                      "--heldout-fraction", "0.2", "--validation-tokens", "1000",
                      "--models", "pssa-tiny,transformer-tiny")  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    pssa, transformer, compare = rows
    assert (pssa["model"], transformer["model"]) == ("pssa-tiny", "transformer-tiny")
    for row in (pssa, transformer):
        assert row["tokens"] == 1024 and row["updates"] == 2 and row["seed"] == 42
        assert len(row["train_ce_each_tenth"]) == 10
        # Two updates: the tenths that hold one (the 5th and the 10th) have a loss, the others none.
        assert [value is not None for value in row["train_ce_each_tenth"]] == [False] * 4 + [True] + [False] * 4 + [True]
        assert all(0 < value < 10 for value in row["train_ce_each_tenth"] if value is not None)
        assert 0 < row["heldout_ce"] < 10 and row["tokens_per_s"] > 0
    assert pssa["data"] != transformer["data"]  # each line consumes its own, identical, data line
    assert compare["speedup"] == pytest.approx(pssa["tokens_per_s"] / transformer["tokens_per_s"], abs=0.005)  # rounded to 2 places
    assert compare["heldout_ce_gap"] == pytest.approx(transformer["heldout_ce"] - pssa["heldout_ce"], abs=1e-4)
    # The two lines read the same samples: their first updates' batches are the data lines' same bytes,
    # so the same model on either line would give the same first loss; the manifests say so.
    first, second = Path(pssa["data"]), Path(transformer["data"])
    manifest = Path("cycles", "c0000", "manifest.json")
    assert (first / manifest).read_bytes() == (second / manifest).read_bytes()
    # Each training line validated once, at its end, on every held-out row.
    for row in (pssa, transformer):
        records = [json.loads(text) for text in (out / row["model"] / "rows.jsonl").read_text().splitlines()]
        assert [index for index, record in enumerate(records) if "val_64/mix" in record] == [1]


def test_a_corpus_too_small_for_the_tokens_is_refused_in_one_line(tmp_path: Path) -> None:
    done = run_script("--tokens", "1e7", "--out", str(tmp_path / "article"), "--include", "json/**",
                      "--heldout-fraction", "0.2")  # fmt: skip
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1
    assert "fewer than --tokens 10,000,000; give --corpus DIR" in done.stderr


def test_the_held_out_reading_is_the_last_validation_not_the_last_row(tmp_path: Path) -> None:
    """A stage ends on its tokens: an update short of rows can put the last update past the last
    validation (3.5M tokens: validated at update 6,835, ended at 6,837). The summary reads the last
    row that carries the held-out reading, and says which update it is."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("pssa_article", SCRIPT)
    assert spec is not None and spec.loader is not None
    article = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(article)
    line = tmp_path / "line"
    line.mkdir()
    rows = [{"update": update, "tokens": 512 * update, "loss": 4.0, "tokens_per_update": 512, "tokens_per_s": 1000.0}
            for update in range(1, 11)]  # fmt: skip
    rows[7].update({"val_64/mix": 3.25, "val_64/bpb/mix": 1.5})
    (line / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    summary = article.summary(line, "pssa-1.5m", 10.0, [0.0, 0.0])
    assert (summary["heldout_ce"], summary["heldout_bpb"], summary["heldout_at_update"]) == (3.25, 1.5, 8)
