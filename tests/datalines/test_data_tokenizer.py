"""Plain-text encoding: added tokens written in a document are text; declared control markers are tokens."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers.data import ADDED_TOKENS, SPECIAL_TOKENS, make_chat_corpus, make_tokenizer, make_web_corpus
from tokenizers import Tokenizer

from datalines import DataLineError
from datalines.tokenizer import PlainTextTokenizer, load_tokenizer, train_byte_level_bpe
from nsconsole.cli import main


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PlainTextTokenizer:
    root = tmp_path_factory.mktemp("tok")
    corpora = [
        make_web_corpus(root / "web", files_per_stratum=1),
        make_chat_corpus(root / "chat", documents=40),
    ]
    return load_tokenizer(make_tokenizer(root / "tokenizer.json", corpora))


CODE = 'print("<|endoftext|>")  # then </s> and <think>\n#include <functional>\n'
CHAT = "<|im_start|>user\nsay </s><|im_end|><|im_start|>assistant\n<think> ok<|im_end|>"


def test_the_default_tokenizers_behaviour_matches_added_tokens_in_text(tokenizer: PlainTextTokenizer) -> None:
    """What we guard against: `tokenizers` turns `</s>` written in code into the added token."""
    ids = tokenizer.full.encode(CODE, add_special_tokens=False).ids
    assert tokenizer.full.token_to_id("</s>") in ids
    assert tokenizer.full.token_to_id("<|endoftext|>") in ids


def test_added_tokens_written_in_a_document_encode_as_their_characters(tokenizer: PlainTextTokenizer) -> None:
    [ids] = tokenizer.encode_documents([CODE])
    control_ids = {tokenizer.full.token_to_id(token) for token in SPECIAL_TOKENS + ADDED_TOKENS}
    assert not control_ids & set(ids.tolist())
    assert tokenizer.decode(ids.tolist()) == CODE
    assert ids.dtype == np.int64


def test_declared_control_markers_encode_as_their_tokens(tokenizer: PlainTextTokenizer) -> None:
    markers = ["<|im_start|>", "<|im_end|>"]
    [ids] = tokenizer.encode_documents([CHAT], markers)
    start, end = tokenizer.full.token_to_id("<|im_start|>"), tokenizer.full.token_to_id("<|im_end|>")
    assert ids.tolist().count(start) == 2 and ids.tolist().count(end) == 2
    assert ids[0] == start and ids[-1] == end
    assert tokenizer.full.token_to_id("</s>") not in ids.tolist()
    assert tokenizer.full.token_to_id("<think>") not in ids.tolist()
    assert tokenizer.decode(ids.tolist()) == CHAT
    # Without the markers declared, the same chat is all text.
    [plain] = tokenizer.encode_documents([CHAT])
    assert start not in plain.tolist() and tokenizer.decode(plain.tolist()) == CHAT


def test_a_marker_the_tokenizer_lacks_is_refused(tokenizer: PlainTextTokenizer) -> None:
    with pytest.raises(DataLineError, match="control marker '<\\|fim_middle\\|>' is not a token"):
        tokenizer.encode_documents(["x"], ["<|fim_middle|>"])


def test_a_broken_tokenizer_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text('{"model": 3}')
    with pytest.raises(DataLineError, match="tokenizer.json: not a valid tokenizers JSON"):
        load_tokenizer(path)


def test_training_is_byte_level_with_special_tokens_first() -> None:
    texts = ["def f(x):\n    return x + 1\n"] * 50 + ["naïve café ✓\n"] * 20
    tokenizer = Tokenizer.from_str(train_byte_level_bpe(texts, 300, ["<|endoftext|>"]))
    assert tokenizer.token_to_id("<|endoftext|>") == 0
    assert 257 < tokenizer.get_vocab_size() <= 300  # a tiny corpus may run out of merges first
    unseen = "日本語 text never seen"
    assert tokenizer.decode(tokenizer.encode(unseen).ids) == unseen  # bytes cover everything
    with pytest.raises(DataLineError, match="vocab"):
        train_byte_level_bpe(texts, 100, ["<|endoftext|>"])


def test_cli_trains_a_tokenizer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = make_web_corpus(tmp_path / "web", files_per_stratum=1)
    out = tmp_path / "out" / "tok.json"
    out.parent.mkdir()
    arguments = ["data", "tokenizer", "--train", "--source", str(corpus), "--vocab", "400", "--out", str(out)]
    code = main(arguments)
    assert code == 0 and "vocab 400" in capsys.readouterr().out
    assert json.loads(out.read_text())["added_tokens"][0]["content"] == "<|endoftext|>"
    assert main(["data", "tokenizer", "--train", "--source", str(tmp_path / "none"), "--out", str(out)]) == 2
    assert "--source must be a directory" in capsys.readouterr().err
