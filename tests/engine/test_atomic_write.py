"""A line's state files, written atomically, get the mode `open(path, "w")` gives: a new file 0666
less the umask, a replaced one its own mode. `tempfile.mkstemp` made every one 0600, so once a
command had written run.json (`nsconsole new`, a tune, a branch) the group sharing the host
could no longer read the line."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers.lines import data_template_fixture

from engine.atomic import write_text_atomic
from nsconsole.cli import main

data_template = data_template_fixture(prepare=0)


@contextmanager
def umask(mask: int) -> Iterator[None]:
    previous = os.umask(mask)
    try:
        yield
    finally:
        os.umask(previous)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize(("mask", "expected"), [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600)])
def test_a_new_file_gets_0666_under_the_umask(tmp_path: Path, mask: int, expected: int) -> None:
    with umask(mask):
        write_text_atomic(tmp_path / "state.json", "{}\n")
    assert mode(tmp_path / "state.json") == expected
    assert (tmp_path / "state.json").read_text() == "{}\n"


def test_a_replaced_file_keeps_its_mode_and_no_temporary_stays(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    path.write_text("old\n")
    path.chmod(0o640)
    with umask(0o022):
        write_text_atomic(path, "new\n")
    assert (path.read_text(), mode(path)) == ("new\n", 0o640)
    assert sorted(child.name for child in tmp_path.iterdir()) == ["run.json"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    path.write_text("old\n")
    with pytest.raises(UnicodeEncodeError):
        write_text_atomic(path, "\udc80")  # a lone surrogate: UTF-8 cannot write it
    assert path.read_text() == "old\n"
    assert sorted(child.name for child in tmp_path.iterdir()) == ["run.json"]


def test_nsconsole_new_writes_a_line_its_group_can_read(tmp_path: Path, data_template: Path) -> None:
    line = tmp_path / "line"
    with umask(0o027):
        assert main(["new", str(line), "--model", "transformer-tiny", "--data", str(data_template)]) == 0
    assert mode(line / "run.json") == 0o640
