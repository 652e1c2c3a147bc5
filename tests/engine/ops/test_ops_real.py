"""new / check against the real model registry and a real (tiny, local) data line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.data import make_chat_corpus, make_tokenizer, make_web_corpus, write_recipe

from datalines import open_data_line
from datalines.creation import init_data_line
from datalines.validation import build_validation
from engine.config.run import RunConfig
from engine.models.presets import preset_config
from nsconsole.cli import main

PRESET = "transformer-tiny"


@pytest.fixture(scope="module")
def data_line(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("inputs")
    web = make_web_corpus(root / "web")
    chat = make_chat_corpus(root / "chat")
    tokenizer = make_tokenizer(root / "tokenizer.json", [web, chat])
    recipe = write_recipe(root / "recipe.json", web, chat, tokenizer)
    return init_data_line(tmp_path_factory.mktemp("lines") / "data", recipe, 0, 5000, None).path


@pytest.fixture(autouse=True)
def no_host_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NSCONSOLE_HOST", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def test_new_follows_the_data_lines_vocabulary_and_check_passes(
    tmp_path: Path, data_line: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    vocab = open_data_line(data_line).vocab_size
    assert preset_config(PRESET).vocab_size != vocab  # so the override is needed
    line = tmp_path / "line"
    arguments = ["new", str(line), "--model", PRESET, "--data", str(data_line), "--seq-len", "32",
                 "--tokens-per-update", "256"]
    assert main(arguments) == 0
    config = RunConfig.load(line / "run.json")
    assert config.model.overrides == {"vocab_size": vocab}
    capsys.readouterr()
    # No held-out rows yet: the check says so as the trainer's start would, naming the command.
    assert main(["check", str(line)]) == 1
    assert f"no held-out rows of length 32 for this line's validation; build them with `nsconsole data val --work {data_line} --seq-len 32 --long-seq-len 0`" in capsys.readouterr().out
    build_validation(open_data_line(data_line), [32])
    assert main(["check", str(line)]) == 0, capsys.readouterr().out
    assert f"vocab {vocab} = model's" in capsys.readouterr().out

    # A model whose vocabulary no longer matches the tokenizer fails the check.
    document = json.loads((line / "run.json").read_text())
    document["model"]["overrides"] = {}
    (line / "run.json").write_text(json.dumps(document))
    assert main(["check", str(line)]) == 1
    assert f"has a tokenizer of {vocab} tokens" in capsys.readouterr().out
