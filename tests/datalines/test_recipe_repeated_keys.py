"""A recipe file with a key given twice in one object (two `shares`, a source's key twice): JSON
keeps the last value without a word, and `data init` and `data tokenizer --recipe` took it so. Both
refuse it now, in one line naming the file and the key, and write nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.data import web_chat_inputs

from nsconsole.cli import main

SHARES = '"shares": {"web": 0.75, "chat": 0.25}'

REPEATS = {
    "two shares in a piece": (SHARES, f'"shares": {{"web": 0.5, "chat": 0.5}}, {SHARES}', "schedule[0].shares"),
    "a source's key twice": ('"heldout_fraction": 0.05', '"heldout_fraction": 0.01, "heldout_fraction": 0.05',
                             "sources[1].heldout_fraction"),
    "a share twice": (SHARES, SHARES.replace("0.25}", '0.25, "web": 0.1}'), "schedule[0].shares.web"),
    "a top-level key twice": ('"seed": 7', '"seed": 1, "seed": 7', "recipe.seed"),
}  # fmt: skip


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return web_chat_inputs(tmp_path_factory.mktemp("inputs"))


@pytest.mark.parametrize("repeat", REPEATS)
def test_a_recipe_key_given_twice_is_refused(
    inputs: dict[str, Path], tmp_path: Path, repeat: str, capsys: pytest.CaptureFixture[str]
) -> None:
    once, twice, key = REPEATS[repeat]
    text = inputs["recipe"].read_text()
    assert text.count(once) == 1
    recipe = tmp_path / "recipe.json"
    recipe.write_text(text.replace(once, twice))
    refusal = f"nsconsole: {recipe}: key {key} appears twice (JSON would keep only the last)"

    work = tmp_path / "line"
    assert main(["data", "init", "--work", str(work), "--recipe", str(recipe), "--eos-id", "0",
                 "--cycle-tokens", "5000"]) == 2  # fmt: skip
    assert capsys.readouterr().err.splitlines() == [refusal]
    assert not work.exists()

    out = tmp_path / "tokenizer.json"
    assert main(["data", "tokenizer", "--train", "--recipe", str(recipe), "--vocab", "400", "--out", str(out)]) == 2
    assert capsys.readouterr().err.splitlines() == [refusal]
    assert not out.exists()
