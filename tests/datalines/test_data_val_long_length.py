"""`nsconsole data val`'s long length is for long-context probes: one given at or below --seq-len is
refused with one line naming both, and the default long length (32768) gives no long rows beside a
--seq-len at or above it, saying so, as a training line at that length validates."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.lines import make_data_line

from nsconsole.cli import main


@pytest.fixture(scope="module")
def data_line(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data line with a few hundred held-out tokens and no rows built."""
    return make_data_line(tmp_path_factory.mktemp("data"), prepare=0, validation=())


def built_lengths(path: Path) -> list[int]:
    return sorted(int(d.name[1:]) for d in (path / "val").glob("T*"))


@pytest.mark.parametrize("long_seq_len", [16, 32])
def test_a_long_length_not_above_the_row_length_is_refused(
    data_line: Path, capsys: pytest.CaptureFixture[str], long_seq_len: int
) -> None:
    lengths = ["--seq-len", "32", "--long-seq-len", str(long_seq_len)]
    assert main(["data", "val", "--work", str(data_line), *lengths]) == 2
    captured = capsys.readouterr()
    refusal = f"nsconsole: --long-seq-len {long_seq_len} must be above --seq-len 32 (0: none)"
    assert captured.err.splitlines() == [refusal]
    assert captured.out == ""
    assert built_lengths(data_line) == []  # nothing built for a mistaken command


def test_a_row_length_at_or_above_the_default_long_length_gets_no_long_rows(
    data_line: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The held-out documents are far too short for either length: only the lengths tried matter here.
    assert main(["data", "val", "--work", str(data_line), "--seq-len", "40000"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        "val: no long rows: the default --long-seq-len 32768 is not above --seq-len 40000 "
        "(give a longer --long-seq-len for them)"
    )
    assert [text.split(":")[0] for text in out[1:]] == ["val T40000"]


@pytest.mark.parametrize("seq_len", ["0", "-4"])
def test_a_row_length_below_one_is_a_usage_error(seq_len: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["data", "val", "--work", "nowhere", "--seq-len", seq_len])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().endswith(f"argument --seq-len: must be at least 1, got {seq_len}")
