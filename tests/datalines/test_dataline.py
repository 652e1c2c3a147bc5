"""The data line's own API for the trainer's and the line operations' marks on its cycles."""

from __future__ import annotations

from pathlib import Path

from helpers.lines import make_data_line

from datalines import open_data_line
from datalines.preparer import delete_consumed_shards, prepare_cycle


def test_reopen_clears_the_consumed_mark_and_the_preparer_rebuilds_the_shards(tmp_path: Path) -> None:
    line = open_data_line(make_data_line(tmp_path, prepare=1))
    manifest_sha256 = line.cycle(0).manifest_sha256
    line.mark_consumed(0)
    assert delete_consumed_shards(line) == [0]
    assert line.cycle_state(0) == "consumed"

    assert line.reopen(0) is True
    assert not line.is_consumed(0)
    assert line.cycle_state(0) == "reopened"  # the manifest kept, its shards deleted
    prepare_cycle(line, 0)  # what the preparer does next: rebuild from the permanent manifest
    assert line.cycle_state(0) == "ready" and line.cycle(0).manifest_sha256 == manifest_sha256

    assert line.reopen(0) is False  # not consumed: nothing to reopen
    assert line.cycle_state(0) == "ready"
