"""A `checkpoints/latest` that names no checkpoint is reported for what it is: missing, or holding a
text (quoted, cut at 40 characters) that is not a checkpoint's name. A garbage one used to be
reported as "missing or unreadable" although it was there and read (found in a fault walkthrough)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.checkpoints.format import verify_line_checkpoints


@pytest.fixture
def line(tmp_path: Path) -> Path:
    (tmp_path / "checkpoints" / "u00000001").mkdir(parents=True)
    return tmp_path


def latest_problems(line: Path) -> list[str]:
    latest = str(line / "checkpoints" / "latest")
    return [problem for problem in verify_line_checkpoints(line) if problem.startswith(latest)]


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("garbage/../x\n", 'holds "garbage/../x", not a checkpoint\'s name (u and 8 digits)'),
        ("u" + "9" * 60, f'holds "u{"9" * 39}"..., not a checkpoint\'s name (u and 8 digits)'),
        ("two\nlines\n", 'holds "two\\nlines", not a checkpoint\'s name (u and 8 digits)'),
        ("\n", "empty, so it names no checkpoint"),
    ],
)
def test_a_latest_naming_no_checkpoint_says_what_it_holds(line: Path, content: str, problem: str) -> None:
    (line / "checkpoints" / "latest").write_text(content)
    assert latest_problems(line) == [f"{line / 'checkpoints' / 'latest'}: {problem}"]


def test_a_latest_that_is_not_text_or_is_missing(line: Path) -> None:
    (line / "checkpoints" / "latest").write_bytes(b"\xff\xfe")
    assert latest_problems(line) == [
        f"{line / 'checkpoints' / 'latest'}: not text, so not a checkpoint's name (u and 8 digits)"
    ]
    (line / "checkpoints" / "latest").unlink()
    assert latest_problems(line) == [f"{line / 'checkpoints' / 'latest'}: missing"]
