"""host.json's `tokenizer` and `calibration_from` are `nsconsole data init`'s defaults: the tokenizer
of a recipe that names none, and a data line whose calibration a source with the same files and
tokenizer takes instead of measuring it again. Its `work_root` serves the data commands' --work as
it serves every LINE and `new --data DIR`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.lines import make_data_line

from datalines import creation, open_data_line
from datalines.tokenizer import EMBEDDED_EOS_TOKEN, train_byte_level_bpe
from nsconsole.cli import main


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data line made from `recipe.json` (which names no tokenizer) and `tokenizer.json` beside it."""
    return make_data_line(tmp_path_factory.mktemp("first"), prepare=0, validation=())


def host_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **settings: str) -> None:
    path = tmp_path / "host.json"
    path.write_text(json.dumps(settings))
    monkeypatch.setenv("NSCONSOLE_HOST", str(path))


def init(work: Path, first: Path, *extra: str) -> int:
    recipe = first.parent / "recipe.json"
    return main(["data", "init", "--work", str(work), "--recipe", str(recipe), "--eos-id", "0",
                 "--cycle-tokens", "5000", *extra])  # fmt: skip


def test_the_hosts_tokenizer_serves_a_recipe_that_names_none(
    tmp_path: Path, first: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("NSCONSOLE_HOST", raising=False)
    assert init(tmp_path / "none", first) == 2
    assert "recipe.tokenizer is not set, no --tokenizer was given and host.json names none" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()
    host_file(tmp_path, monkeypatch, tokenizer=str(first.parent / "tokenizer.json"))
    assert init(tmp_path / "second", first) == 0
    assert open_data_line(tmp_path / "second").tokenizer_sha256 == open_data_line(first).tokenizer_sha256


def test_calibration_from_reuses_what_was_measured_on_the_same_data(
    tmp_path: Path, first: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    host_file(tmp_path, monkeypatch, calibration_from=str(first))

    def not_measured(*args: object) -> None:
        raise AssertionError("measured again, not reused")

    with monkeypatch.context() as patch:
        patch.setattr(creation, "calibrate_source", not_measured)
        assert init(tmp_path / "same", first, "--tokenizer", str(first.parent / "tokenizer.json")) == 0
    assert f"calibration of text taken from {first}" in capsys.readouterr().out
    same = json.loads((tmp_path / "same" / "dataline.json").read_text())
    assert same["calibration"] == json.loads((first / "dataline.json").read_text())["calibration"]
    assert same["calibration_from"] == {"line": str(first), "sources": ["text"]}


def test_another_tokenizer_is_measured_afresh(
    tmp_path: Path, first: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "other.json"
    texts = [line for line in (first.parent / "corpus" / "part0.jsonl").read_text().splitlines()]
    other.write_text(train_byte_level_bpe(texts, 280, [EMBEDDED_EOS_TOKEN]))
    measured: list[str] = []
    real = creation.calibrate_source

    def counting(source, tokenizer, seed):  # type: ignore[no-untyped-def]
        measured.append(source.spec.name)
        return real(source, tokenizer, seed)

    monkeypatch.setattr(creation, "calibrate_source", counting)
    # --calibration-from on the command line, over a host.json naming a line that does not exist.
    host_file(tmp_path, monkeypatch, calibration_from=str(tmp_path / "nowhere"))
    assert init(tmp_path / "fresh", first, "--tokenizer", str(other), "--calibration-from", str(first)) == 0
    assert measured == ["text"]
    assert "calibration_from" not in json.loads((tmp_path / "fresh" / "dataline.json").read_text())
    assert "taken from" not in capsys.readouterr().out
    # The host's line is used when the command names none: a missing one is an error naming it.
    assert init(tmp_path / "missing", first, "--tokenizer", str(other)) == 2
    assert f"{tmp_path / 'nowhere' / 'dataline.json'}: no such file" in capsys.readouterr().err
    assert not (tmp_path / "missing").exists()  # refused before anything is written


def test_a_relative_data_line_is_where_new_looks_for_it_from_any_directory(
    tmp_path: Path, first: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`data init --work lines/d` made `./lines/d` while `new --data lines/d` (from another directory)
    looked under host.json's work_root (found in a CLI walkthrough): both resolve a relative path
    as every LINE does (the cwd, else work_root) and record it absolute."""
    root = tmp_path / "root"
    host_file(tmp_path, monkeypatch, work_root=str(root))
    monkeypatch.chdir(first.parent)
    assert init(Path("lines/d"), first, "--tokenizer", "tokenizer.json", "--calibration-from", first.name) == 0
    data = root / "lines" / "d"
    assert (data / "dataline.json").is_file() and not (first.parent / "lines").exists()
    assert json.loads((data / "dataline.json").read_text())["calibration_from"]["line"] == str(first)

    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert main(["data", "status", "--work", "lines/d"]) == 0
    new = ["new", "runs/x", "--model", "transformer-tiny", "--data", "lines/d", "--seq-len", "32", "--device", "cpu"]
    assert main(new) == 0
    assert json.loads((root / "runs" / "x" / "run.json").read_text())["data"]["line"] == str(data)
