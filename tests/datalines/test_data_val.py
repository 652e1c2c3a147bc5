"""`nsconsole data val`: the lengths a line needs by default (4096 and the presets' longest context,
or those of a training line with --line), each length built on its own, and a length no source
has a row of named with each source's shortfall in tokens."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from helpers.lines import make_data_line, make_line

from datalines import open_data_line
from datalines.shards import join_documents
from datalines.validation import heldout_documents
from nsconsole.cli import main


@pytest.fixture(scope="module")
def small_line(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data line with a few hundred held-out tokens and no rows built (the recipe reads about 100)."""
    return make_data_line(tmp_path_factory.mktemp("small"), prepare=0, validation=())


def heldout_tokens(path: Path) -> int:
    line = open_data_line(path)
    documents = heldout_documents(line, "text", line.recipe.validation_tokens)
    return len(join_documents(documents, line.eos_id, np.dtype("<i4"))[0])


def built_lengths(path: Path) -> list[int]:
    return sorted(int(d.name[1:]) for d in (path / "val").glob("T*") if (d / "index.json").is_file())


def test_a_length_without_rows_is_named_and_the_others_are_built(
    tmp_path: Path, small_line: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tokens = heldout_tokens(small_line)
    assert 16 < tokens < 4096
    assert main(["data", "val", "--work", str(small_line), "--seq-len", "16", "--long-seq-len", "4096"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"val T16: text {tokens // 17} rows"
    assert out[1] == (
        f"val T4096: not built, no source has a row; text has no row: its held-out documents give {tokens:,} "
        f"tokens, a row needs 4,097 (short by {4097 - tokens:,}) (the recipe reads about 100 held-out tokens "
        "a source: its validation_tokens)"
    )
    assert built_lengths(small_line) == [16]
    assert not [path for path in (small_line / "val").iterdir() if path.name.startswith(".")]  # no leftovers
    assert len(open_data_line(small_line).validation_rows(16)["text"]) == tokens // 17


def test_the_defaults_are_what_a_new_line_validates_at(small_line: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 4096 (`nsconsole new`'s length) and 32768 (the presets' longest context): this corpus has neither.
    assert main(["data", "val", "--work", str(small_line)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert [re.match(r"val T(\d+): not built", text).group(1) for text in out] == ["4096", "32768"]
    assert main(["data", "val", "--work", str(small_line), "--seq-len", "8", "--long-seq-len", "0"]) == 0
    assert capsys.readouterr().out.splitlines() == [f"val T8: text {heldout_tokens(small_line) // 9} rows"]


def test_line_builds_the_lengths_a_training_line_validates_at(
    tmp_path: Path, small_line: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = make_line(tmp_path, small_line, **{"validation.long_seq_len": 48})  # training at 32
    assert main(["data", "val", "--work", str(small_line), "--line", str(line)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [text.split(":")[0] for text in out] == ["val T32", "val T48"]
    assert {32, 48} <= set(built_lengths(small_line))
    main(["check", str(line)])  # the rows it needs are there now (other checks may fail: no cycle yet)
    assert "ok: held-out rows: built for lengths 32, 48" in capsys.readouterr().out
    assert main(["data", "val", "--work", str(small_line), "--line", str(line), "--seq-len", "32"]) == 2
    assert "give --line or --seq-len / --long-seq-len, not both" in capsys.readouterr().err


def test_a_source_without_a_row_is_left_out_of_a_length_the_others_have(
    tmp_path: Path, small_line: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A second source of one short held-out document: it has no row of 32, the first source has.
    short_corpus = tmp_path / "short"
    short_corpus.mkdir()
    texts = [f"doc {index} " + "x" * 20 for index in range(400)]
    (short_corpus / "a.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    recipe = json.loads((small_line.parent / "recipe.json").read_text())
    recipe["sources"].append({"name": "short", "kind": "local", "path": str(short_corpus), "heldout_fraction": 0.003})
    recipe["schedule"][0]["shares"]["short"] = 0.1
    (tmp_path / "recipe.json").write_text(json.dumps(recipe))
    work = tmp_path / "two"
    arguments = ["data", "init", "--work", str(work), "--recipe", str(tmp_path / "recipe.json"), "--eos-id", "0",
                 "--cycle-tokens", "5000", "--tokenizer", str(small_line.parent / "tokenizer.json")]  # fmt: skip
    assert main(arguments) == 0
    capsys.readouterr()
    assert main(["data", "val", "--work", str(work), "--seq-len", "32", "--long-seq-len", "0"]) == 0
    out = capsys.readouterr().out.strip()
    assert re.fullmatch(
        r"val T32: text \d+ rows; short has no row: its held-out documents give (\d+) tokens, a row needs 33 "
        r"\(short by (\d+)\)",
        out,
    ), out
    given, short = (int(number) for number in re.findall(r"give (\d+) tokens.*short by (\d+)", out)[0])
    assert given + short == 33
    assert set(open_data_line(work).validation_rows(32)) == {"text"}
