"""Shards damaged after their first check (issue 25, item 12): a long-lived preparer sees a shard
of a ready cycle damaged (in place, same size) and rebuilds it instead of saying `ready` forever,
and an open cycle refuses samples from a shard rewritten under it."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from helpers.data import make_web_chat_recipe

from datalines import open_data_line
from datalines.creation import init_data_line
from datalines.dataline import DataLine
from datalines.errors import ShardChanged
from datalines.service import run_preparer

CYCLE_TOKENS = 5000


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_web_chat_recipe(tmp_path_factory.mktemp("inputs"))


def _damage_in_place(path: Path) -> None:
    """Flip one byte in the middle, same size: what bit rot or a stray writer leaves."""
    with open(path, "r+b") as handle:
        handle.seek(path.stat().st_size // 2)
        byte = handle.read(1)
        handle.seek(-1, 1)
        handle.write(bytes([byte[0] ^ 0xFF]))


def _digests(line: DataLine, index: int) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(line.cycle_dir(index).iterdir())}


def _tokens_file(line: DataLine, index: int) -> Path:
    return sorted(line.cycle_dir(index).glob("*.tokens"))[0]


def test_a_shard_damaged_after_the_check_is_rebuilt_by_the_same_preparer(recipe: Path, tmp_path: Path) -> None:
    line = init_data_line(tmp_path / "line", recipe, 0, CYCLE_TOKENS, None)
    status = run_preparer(line, ahead=2, min_free_bytes=0, once=True)
    assert status.state == "ready" and status.ready == [0, 1]
    good = _digests(line, 1)

    _damage_in_place(_tokens_file(line, 1))  # the next cycle, while the same preparer runs on
    assert open_data_line(line.path).cycle_state(1) == "damaged"
    assert line.cycle_problem(1) is not None and "corrupted" in line.cycle_problem(1)
    status = run_preparer(line, ahead=2, min_free_bytes=0, once=True)  # the same DataLine: its cache
    assert status.state == "ready" and status.ready == [0, 1]
    assert _digests(line, 1) == good  # rebuilt from the manifest, byte for byte
    assert open_data_line(line.path).cycle_state(1) == "ready"


def test_an_open_cycle_refuses_a_shard_rewritten_under_it(recipe: Path, tmp_path: Path) -> None:
    line = init_data_line(tmp_path / "line", recipe, 0, CYCLE_TOKENS, None)
    run_preparer(line, ahead=1, min_free_bytes=0, once=True)
    cycle = line.cycle(0)
    before = cycle.samples(32, 0, 4, 0)
    cycle.verify_unchanged()  # nothing moved: a stat per shard

    shard = _tokens_file(line, 0)
    original = shard.read_bytes()
    shard.write_bytes(original)  # rewritten with the same bytes: its stamp moves, its hash does not
    cycle.verify_unchanged()
    _damage_in_place(shard)
    with pytest.raises(ShardChanged, match=r"\.tokens: shard sha256 differs from the manifest .* while cycle 0 was open"):
        cycle.verify_unchanged()
    assert not line.cycle_ready(0)
    shard.write_bytes(original)
    cycle.verify_unchanged()
    assert (cycle.samples(32, 0, 4, 0) == before).all()


def test_a_cycle_opened_unverified_checks_its_shards_before_its_samples_count(recipe: Path, tmp_path: Path) -> None:
    line = init_data_line(tmp_path / "line", recipe, 0, CYCLE_TOKENS, None)
    run_preparer(line, ahead=1, min_free_bytes=0, once=True)
    _damage_in_place(_tokens_file(line, 0))
    cycle = line.cycle(0, verify=False)  # a resume compares the manifest first: it is intact
    assert cycle.manifest_sha256
    with pytest.raises(ShardChanged):
        cycle.verify_unchanged()
