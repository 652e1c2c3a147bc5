"""bench/pssa_article.py refuses bad input in one line, exit status 2, no traceback, before it
trains a tokenizer or builds a data line where the arguments alone show the problem."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "bench" / "pssa_article.py"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tokens", "nan"], "argument --tokens: must be finite and at least one update (512), got nan"),
        (["--tokens", "inf"], "argument --tokens: must be finite and at least one update (512), got inf"),
        (["--tokens", "1e6", "--models", "pssa-1.5m,pssa-2m"], "argument --models: not a preset: pssa-2m"),
        (["--tokens", "1e6", "--corpus", "/nonexistent/corpus"], "source corpus directory does not exist"),
        (["--tokens", "1e6", "--heldout-fraction", "2"], "heldout_fraction must be a number in [0, 1), got 2.0"),
        (["--tokens", "1e6", "--validation-tokens", "-5"], "validation_tokens must be an integer >= 1, got -5"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    out = tmp_path / "article"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--out", str(out), "--include", "json/**"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and message in done.stderr.strip().splitlines()[-1], done.stderr
    assert not (out / "pssa-1.5m").exists()  # no training line was made
