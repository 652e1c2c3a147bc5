"""A damaged shard is named (fault walk, item 9): `data status` (text and --json) says which file
and what is wrong with it, and the preparer's log says why it rebuilds the cycle."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers.data import make_web_chat_recipe

from datalines import open_data_line
from datalines.creation import init_data_line
from datalines.service import StatusLines, run_preparer
from nsconsole.cli import main

CYCLE_TOKENS = 5000


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data line with cycles 0 and 1 prepared (each test works on a copy)."""
    root = tmp_path_factory.mktemp("inputs")
    recipe = make_web_chat_recipe(root)
    line = init_data_line(root / "line", recipe, 0, CYCLE_TOKENS, None)
    assert run_preparer(line, ahead=2, min_free_bytes=0, once=True).ready == [0, 1]
    return line.path


@pytest.fixture
def damaged(prepared: Path, tmp_path: Path) -> tuple[Path, Path, Path, int]:
    """A copy of the prepared line whose cycle 1 has web.tokens truncated and chat.docs deleted:
    (the copy, the two files, web.tokens' size before)."""
    work = tmp_path / "line"
    shutil.copytree(prepared, work)
    truncated, deleted = work / "cycles" / "c0001" / "web.tokens", work / "cycles" / "c0001" / "chat.docs"
    size = truncated.stat().st_size
    with open(truncated, "r+b") as handle:
        handle.truncate(size // 2)
    deleted.unlink()
    return work, truncated, deleted, size


def test_data_status_names_the_damaged_files_and_the_problem(
    damaged: tuple[Path, Path, Path, int], capsys: pytest.CaptureFixture[str]
) -> None:
    work, truncated, deleted, size = damaged
    problems = [  # in the manifest's order of the shards: its sources by name
        f"{deleted}: shard missing (cycle 1)",
        f"{truncated}: shard is {size // 2} bytes, the manifest says {size} (truncated?)",
    ]

    assert main(["data", "status", "--work", str(work), "--json"]) == 1  # it reports damage
    report = json.loads(capsys.readouterr().out)
    assert report["cycles"] == {"0": "ready", "1": "damaged"}
    assert report["problems"] == {"1": "; ".join(problems)}

    assert main(["data", "status", "--work", str(work)]) == 1
    out = capsys.readouterr().out
    assert f"  cycle    1  damaged: {'; '.join(problems)}\n" in out
    assert "  cycle    0  ready\n" in out


def test_the_preparer_says_why_it_rebuilds_a_cycle(
    damaged: tuple[Path, Path, Path, int], capsys: pytest.CaptureFixture[str]
) -> None:
    work, truncated, deleted, size = damaged

    status = run_preparer(open_data_line(work), ahead=2, min_free_bytes=0, once=True, on_status=StatusLines())
    assert status.ready == [0, 1]
    log = capsys.readouterr().out
    assert (
        f"preparer: preparing: cycle 1: {deleted}: shard missing (cycle 1); {truncated}: shard is {size // 2} "
        f"bytes, the manifest says {size} (truncated?); rebuilding its shards from the manifest\n"
    ) in log
    assert open_data_line(work).cycle_state(1) == "ready"
