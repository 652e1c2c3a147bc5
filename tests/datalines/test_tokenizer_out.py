"""`nsconsole data tokenizer --out FILE` writes a new file: an existing one (a tokenizer other data
lines are pinned to) is refused in one line, unless --force."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.data import make_web_corpus

from nsconsole.cli import main


def test_an_existing_out_is_refused_unless_forced(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = make_web_corpus(tmp_path / "web", files_per_stratum=1)
    out = tmp_path / "tok.json"
    out.write_text('{"the": "tokenizer three data lines are pinned to"}')
    arguments = ["data", "tokenizer", "--train", "--source", str(corpus), "--vocab", "400", "--out", str(out)]

    assert main(arguments) == 2
    [message] = capsys.readouterr().err.splitlines()
    assert message == f"nsconsole: {out}: already exists; give another --out, or --force to overwrite it"
    assert json.loads(out.read_text()) == {"the": "tokenizer three data lines are pinned to"}  # untouched

    assert main([*arguments, "--force"]) == 0
    assert "vocab 400" in capsys.readouterr().out
    assert json.loads(out.read_text())["added_tokens"][0]["content"] == "<|endoftext|>"
