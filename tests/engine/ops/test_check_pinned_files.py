"""`nsconsole check` names a pinned source file that changed since `data init` (gone, another size,
other bytes behind a moved modification time): a failure when the cycle the line trains next still
has to be prepared from it (the line would wait for it for good), else a warning; a file touched
but holding the same bytes is no finding."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers.lines import make_data_line, make_line

from datalines import open_data_line
from datalines.planning import load_plan, plan_files
from datalines.preparer import files_still_read
from nsconsole.cli import main

pytestmark = pytest.mark.usefixtures("private_host")


def data_file_lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return [text for text in capsys.readouterr().out.splitlines() if ": data files: " in text]


def test_changed_files_of_prepared_and_future_cycles_are_warnings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = make_data_line(tmp_path, prepare=1)  # cycle 0, which the line trains next, is prepared
    line = make_line(tmp_path, data)
    corpus = tmp_path / "corpus"
    assert main(["check", str(line)]) == 0
    assert data_file_lines(capsys) == ["ok: data files: the 5 files its sources read in place are as init pinned them"]

    opened = open_data_line(data)
    files = [file.path for file in opened.source("text").files]
    later = {files[index] for index in files_still_read(opened)["text"]}
    only_prepared = sorted(set(files[index] for index in plan_files(load_plan(opened, 0))["text"]) - later)
    assert only_prepared and later
    edited, gone = corpus / only_prepared[0], corpus / sorted(later)[-1]
    edited.write_bytes(edited.read_bytes().replace(b"the", b"THE", 1))  # the same size, other bytes
    os.utime(edited, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))  # a time of its own
    gone.unlink()

    assert main(["check", str(line)]) == 0  # warnings: the line trains on meanwhile
    warned = data_file_lines(capsys)
    assert len(warned) == 2 and all(text.startswith("warn: data files: ") for text in warned)
    [edited_line] = [text for text in warned if str(edited) in text]
    assert (f"{edited}: source text file {edited.name} changed since init: its bytes changed (modified "
            "2023-11-14 22:13:20 UTC; sha256 ") in edited_line  # fmt: skip
    assert "no cycle still to be prepared reads it, but rebuilding one that did" in edited_line
    assert f"restore {edited} as `data init` pinned it" in edited_line
    [gone_line] = [text for text in warned if str(gone) in text]
    assert f"{gone}: source text file {gone.name} changed since init: it is gone; a cycle still to be " in gone_line


def test_a_changed_file_the_next_cycle_needs_fails_the_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = make_data_line(tmp_path, prepare=0)  # cycle 0, which the line trains next, is not prepared
    line = make_line(tmp_path, data)
    first = tmp_path / "corpus" / "part0.jsonl"
    content = first.read_bytes()
    first.write_bytes(content + b'{"text": "a line added"}\n')

    assert main(["check", str(line)]) == 1
    [failed] = data_file_lines(capsys)
    assert failed.startswith(f"FAIL: data files: {first}: source text file part0.jsonl changed since init: it is "
                             f"{len(content) + 25:,} bytes now, pinned {len(content):,}; cycle 0, the one the "
                             "line trains next, reads it: the preparer stops there")  # fmt: skip

    first.write_bytes(content)  # the same bytes again, at a new modification time: nothing to say
    assert main(["check", str(line)]) == 0
    assert data_file_lines(capsys)[0].startswith("ok: data files: ")
