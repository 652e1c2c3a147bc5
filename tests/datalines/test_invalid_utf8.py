"""Bytes that are not UTF-8 in local text and jsonl files: read as U+FFFD (the data is kept, every
byte of the text as it always was), counted per cycle in the manifest, said in the preparer's log
naming the file and how many bytes, and shown by `data status`."""

from __future__ import annotations

import gzip
import io
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from datalines import open_data_line
from datalines.creation import init_data_line
from datalines.manifest import load_manifest
from datalines.preparer import invalid_utf8_bytes
from datalines.sources.formats import read_documents
from datalines.tokenizer import EMBEDDED_EOS_TOKEN, train_byte_level_bpe
from nsconsole.cli import main

WORDS = ["the", "a", "model", "trains", "on", "tokens", "while", "spikes", "flow", "through", "layers", "of",
         "state", "and", "memory"]  # fmt: skip
BAD = {b"caf\xe9 au lait": 1, b"half a euro \xe2\x82": 2, b"\xc3( and \xff\xfe": 3}
"""Bytes that are not UTF-8 in a document, and how many: a Latin-1 byte, a sequence cut short, a
lead byte without its continuation, and bytes UTF-8 never uses."""


def jsonl_line(text: bytes) -> bytes:
    """A jsonl record whose text holds `text` raw (json.dumps would escape what is not ASCII)."""
    return b'{"text": "' + text + b'"}\n'


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """Two jsonl files (one gzipped) and a text file, some of whose documents hold bytes that are not UTF-8."""
    root = tmp_path / "corpus"
    root.mkdir()
    rng = random.Random(0)
    for name in ("a.jsonl", "b.jsonl.gz"):
        lines = [jsonl_line(" ".join(rng.choice(WORDS) for _ in range(30)).encode()) for _ in range(60)]
        lines[7] = jsonl_line(b"words then " + b" ".join(BAD))
        data = b"".join(lines)
        (root / name).write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    (root / "c.txt").write_bytes(b"a text file, " + b"\xff" * 5 + b" in its middle\n")
    return root


def make_line(tmp_path: Path, corpus: Path) -> Path:
    texts = [" ".join(WORDS)] * 20
    (tmp_path / "tokenizer.json").write_text(train_byte_level_bpe(texts, 300, [EMBEDDED_EOS_TOKEN]))
    recipe = {"seed": 0, "segments_per_cycle": 2, "at_corpus_end": "last_cycle", "validation_tokens": 100,
              "sources": [{"name": "text", "kind": "local", "path": str(corpus), "heldout_fraction": 0.0}],
              "schedule": [{"from_tokens": 0, "shares": {"text": 1.0}}]}  # fmt: skip
    (tmp_path / "recipe.json").write_text(json.dumps(recipe))
    return init_data_line(tmp_path / "data", tmp_path / "recipe.json", 0, 5000, tmp_path / "tokenizer.json").path


def test_bytes_that_are_not_utf8_are_counted_per_cycle_said_and_shown(
    tmp_path: Path, corpus: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = make_line(tmp_path, corpus)
    command = [sys.executable, "-m", "nsconsole", "data", "run-preparer", "--work", str(data), "--ahead", "20", "--once"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr

    line = open_data_line(data)
    last = line.last_cycle()
    assert last is not None
    per_cycle = {index: invalid_utf8_bytes(load_manifest(line.cycle_dir(index))[0]) for index in range(last + 1)}
    totals: dict[str, int] = {}
    for counts in per_cycle.values():
        for path, count in counts.get("text", {}).items():
            totals[path] = totals.get(path, 0) + count
    assert totals == {"a.jsonl": 6, "b.jsonl.gz": 6, "c.txt": 5}  # every byte, each once, in one cycle or another
    warnings = [text for text in result.stdout.splitlines() if text.startswith("preparer: warning: ")]
    expected = {f"cycle {index}: {corpus / path}: source text: {count} bytes that are not UTF-8, replaced by "
                f"U+FFFD (the data is kept)" for index, counts in per_cycle.items()
                for path, count in counts.get("text", {}).items()}  # fmt: skip
    assert {text.removeprefix("preparer: warning: ") for text in warnings} == expected

    assert main(["data", "status", "--work", str(data)]) == 0
    shown = capsys.readouterr().out
    for index, counts in per_cycle.items():
        for path, count in counts.get("text", {}).items():
            assert f"text {path} {count}" in next(text for text in shown.splitlines() if f"cycle {index:4d}" in text)
    assert main(["data", "status", "--work", str(data), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["invalid_utf8"]
    assert {int(index): counts for index, counts in report.items()} == {i: c for i, c in per_cycle.items() if c}


def test_a_clean_cycle_records_nothing(tmp_path: Path) -> None:
    """A manifest without bytes to report is the bytes it always was: no new key."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = random.Random(1)
    (corpus / "a.jsonl").write_bytes(b"".join(jsonl_line(" ".join(rng.choice(WORDS) for _ in range(30)).encode())
                                              for _ in range(200)))  # fmt: skip
    line = open_data_line(make_line(tmp_path, corpus))
    from datalines.preparer import prepare_cycle

    manifest = prepare_cycle(line, 0)
    assert manifest is not None and invalid_utf8_bytes(manifest) == {}
    assert "invalid_utf8_bytes" not in (line.cycle_dir(0) / "manifest.json").read_text()


@pytest.mark.parametrize("suffix", [".jsonl", ".txt"])
def test_the_text_read_is_what_errors_replace_made_of_it(tmp_path: Path, suffix: str) -> None:
    """The count changes nothing read: random bytes decode exactly as `errors="replace"` did, lines
    and their newlines (\\n, \\r, \\r\\n) too, and the count is the bytes a lossless decode escapes."""
    rng = random.Random(2)
    pieces = [b"ok ", b"\xe2\x82\xac", b"\xe2\x82", b"\xff", b"\xc3", b"(", b"\xed\xa0\x80", b"\r", b"\r\n", b"\xf0\x9f"]
    for attempt in range(200):
        body = b"".join(rng.choice(pieces) for _ in range(rng.randrange(1, 30)))
        if suffix == ".txt":
            path, expected = tmp_path / f"{attempt}.txt", [body.decode("utf-8", errors="replace")]
            path.write_bytes(body)
        else:
            lines = [jsonl_line(part) for part in body.replace(b"\r", b"").split(b"\n")]
            path = tmp_path / f"{attempt}.jsonl"
            path.write_bytes(b"".join(lines))
            text = io.TextIOWrapper(io.BytesIO(b"".join(lines)), encoding="utf-8-sig", errors="replace")
            expected = [json.loads(record)["text"] for record in text if record.strip()]
        read = read_documents(path, "text", "test")
        assert read.texts == expected
        escaped = body.replace(b"\r", b"").replace(b"\n", b"") if suffix == ".jsonl" else body
        bad = sum(1 for char in escaped.decode("utf-8", errors="surrogateescape") if "\udc80" <= char <= "\udcff")
        assert sum(read.invalid_utf8.values()) == bad
