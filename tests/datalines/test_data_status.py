"""`nsconsole data status` of a finished line's data after a rollback reopened one of its cycles, and
of damaged cycles: its exit status is 1 when it reports damage (it was 0, found in a CLI walkthrough)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.lines import make_data_line

from datalines import open_data_line
from datalines.service import run_preparer
from nsconsole.cli import main
from nsconsole.commands.data import EXIT_DAMAGED


def test_a_cycle_a_rollback_reopened_reads_as_reopened_not_damaged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = open_data_line(make_data_line(tmp_path, validation=()))
    last = line.last_cycle()
    assert last is not None and last >= 1
    for index in range(last + 1):  # the line trained every cycle: all consumed
        line.mark_consumed(index)
    assert run_preparer(line).state == "finished"  # it deleted every consumed cycle's shards
    assert line.reopen(0)  # what a rollback into cycle 0 does: the mark goes, the manifest stays

    assert main_status(line.path, "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["cycles"] == {"0": "reopened", **{str(index): "consumed" for index in range(1, last + 1)}}

    assert main_status(line.path) == 0
    out = capsys.readouterr().out
    assert "  cycle    0  reopened: shards to rebuild from its manifest\n" in out
    assert "damaged" not in out and "is consumed" not in out
    assert (f"preparer: finished (pid {report['preparer']['pid']}) when every cycle was consumed; reopened "
            f"since: cycle 0, whose shards the next preparer rebuilds (the line's supervisor runs one, or "
            f"`nsconsole data run-preparer --work {line.path}`)\n") in out  # fmt: skip


def test_a_cycle_missing_some_of_its_shards_is_damaged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = open_data_line(make_data_line(tmp_path, prepare=1, validation=()))
    (line.cycle_dir(0) / "text.tokens").unlink()  # its offsets are still there: not a reopened cycle
    assert main_status(line.path, "--json") == EXIT_DAMAGED
    assert json.loads(capsys.readouterr().out)["cycles"]["0"] == "damaged"


@pytest.mark.parametrize("damage", ["shard", "manifest"])
def test_data_status_exits_1_when_it_reports_damage(
    tmp_path: Path, damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = open_data_line(make_data_line(tmp_path, prepare=2, validation=()))
    assert main_status(line.path) == 0  # every prepared cycle ready: nothing to report
    assert "damaged" not in capsys.readouterr().out
    damaged = line.cycle_dir(1) / ("text.tokens" if damage == "shard" else "manifest.json")
    damaged.write_bytes(damaged.read_bytes()[:10])  # truncated

    assert main_status(line.path) == EXIT_DAMAGED == 1
    assert f"  cycle    1  damaged: {damaged}: " in capsys.readouterr().out
    assert main_status(line.path, "--json") == 1
    assert json.loads(capsys.readouterr().out)["cycles"]["1"] == "damaged"


def main_status(work: Path, *options: str) -> int:
    return main(["data", "status", "--work", str(work), *options])
