"""Bad input to the `nsconsole data` commands: one line naming the file and the problem, a non-zero
exit, and nothing already saved lost, overwritten or left half-made."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers.data import web_chat_inputs

from nsconsole.cli import main

CYCLE_TOKENS = 5000


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return web_chat_inputs(tmp_path_factory.mktemp("inputs"))


def init_arguments(work: Path, recipe: Path) -> list[str]:
    return ["data", "init", "--work", str(work), "--recipe", str(recipe), "--eos-id", "0",
            "--cycle-tokens", str(CYCLE_TOKENS)]  # fmt: skip


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    [line] = capsys.readouterr().err.splitlines()
    return line


@pytest.fixture
def line(inputs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    work = tmp_path / "line"
    assert main(init_arguments(work, inputs["recipe"])) == 0
    capsys.readouterr()
    return work


def test_a_tokenizer_file_that_is_not_utf8_is_refused_at_init(
    inputs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tokenizer = tmp_path / "tok.json"
    tokenizer.write_bytes(b"\xff\xfe{}")
    work = tmp_path / "line"

    assert main([*init_arguments(work, inputs["recipe"]), "--tokenizer", str(tokenizer)]) == 2
    assert one_error_line(capsys).startswith(f"nsconsole: {tokenizer}: tokenizer is not UTF-8 text (")
    assert not work.exists()


def test_a_lines_tokenizer_that_is_not_utf8_is_one_line_and_stops_the_preparer(
    line: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with open(line / "tokenizer.json", "ab") as handle:
        handle.write(b"\xff")
    tokenizer = line / "tokenizer.json"

    assert main(["data", "status", "--work", str(line)]) == 2
    assert one_error_line(capsys).startswith(f"nsconsole: {tokenizer}: cannot be read (")
    # Stopped for good (78), not a crash a supervisor would restart again and again.
    assert main(["data", "run-preparer", "--work", str(line), "--once"]) == 78
    assert f"restore {tokenizer}, the tokenizer the data line was made with" in capsys.readouterr().err


@pytest.mark.parametrize("like", [False, True])
def test_a_work_that_is_a_file_or_under_one_is_refused(
    like: bool, inputs: dict[str, Path], line: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kept = tmp_path / "notes.txt"
    kept.write_text("mine")
    for work in (kept, kept / "line"):
        arguments = (["data", "init", "--work", str(work), "--like", str(line)] if like
                     else init_arguments(work, inputs["recipe"]))  # fmt: skip
        assert main(arguments) == 2
        assert one_error_line(capsys) == (
            f"nsconsole: {kept}: not a directory, so --work {work} cannot be made; choose another --work"
        )
        assert kept.read_text() == "mine"


def test_a_refused_init_like_leaves_nothing_and_can_be_retried(
    inputs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "inputs"
    shutil.copytree(inputs["root"], root)
    recipe = json.loads((root / "recipe.json").read_text())
    recipe["sources"][0]["path"], recipe["sources"][1]["path"] = str(root / "web"), str(root / "chat")
    (root / "recipe.json").write_text(json.dumps(recipe))
    original = tmp_path / "original"
    assert main(init_arguments(original, root / "recipe.json")) == 0
    assert main(["data", "run-preparer", "--work", str(original), "--once", "--ahead", "1"]) == 0
    chats = root / "chat" / "chats" / "chats.jsonl"
    pinned = chats.read_bytes()
    chats.write_bytes(pinned + b'{"text": "one more"}\n')
    made_by_user = tmp_path / "mine"
    made_by_user.mkdir()
    (made_by_user / "notes.txt").write_text("mine")
    capsys.readouterr()

    for work in (tmp_path / "copy", made_by_user):
        assert main(["data", "init", "--work", str(work), "--like", str(original)]) == 2
        assert f"{chats}: source chat file chats/chats.jsonl changed since init" in one_error_line(capsys)
    assert not (tmp_path / "copy").exists()
    assert [path.name for path in made_by_user.iterdir()] == ["notes.txt"]

    chats.write_bytes(pinned)  # restored: the retry is not refused by what the refusal left
    assert main(["data", "init", "--work", str(tmp_path / "copy"), "--like", str(original)]) == 0


def test_a_tokenizer_out_that_cannot_be_written_is_refused_before_training(
    inputs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    train = ["data", "tokenizer", "--train", "--source", str(inputs["chat"]), "--vocab", "400"]
    directory = tmp_path / "tokenizers"
    (directory / "kept.json").parent.mkdir()
    (directory / "kept.json").write_text("{}")
    assert main([*train, "--out", str(directory), "--force"]) == 2
    assert one_error_line(capsys) == (
        f"nsconsole: {directory}: is a directory; --out names the tokenizer JSON file to write"
    )
    assert (directory / "kept.json").read_text() == "{}"

    kept = directory / "kept.json"
    assert main([*train, "--out", str(kept / "tok.json")]) == 2
    assert one_error_line(capsys) == f"nsconsole: {kept}: not a directory, so --out {kept / 'tok.json'} cannot be written"


@pytest.mark.parametrize(
    ("specials", "problem"),
    [([""], "a special token cannot be empty"),
     (["<|endoftext|>", "<|pad|>", "<|endoftext|>"], "'<|endoftext|>' given more than once (a token has one id)")],
)  # fmt: skip
def test_an_empty_or_repeated_special_token_is_refused(
    specials: list[str], problem: str, inputs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tok.json"
    arguments = ["data", "tokenizer", "--train", "--source", str(inputs["chat"]), "--vocab", "400", "--out", str(out)]
    for special in specials:
        arguments += ["--special", special]

    assert main(arguments) == 2
    assert one_error_line(capsys) == f"nsconsole: --special: {problem}"
    assert not out.exists()


@pytest.mark.parametrize(
    ("from_tokens", "shares", "problem"),
    [("nan", '{"web": 1}', "--from-tokens must be a whole number, got nan"),
     ("inf", '{"web": 1}', "--from-tokens must be a whole number, got inf"),
     ("10000", '{"web": Infinity}', "schedule[1].shares.web must be a finite number >= 0, got inf"),
     ("10000", '{"web": 1e400}', "schedule[1].shares.web must be a finite number >= 0, got inf"),
     ("10000", '{"web": NaN, "chat": 1}', "schedule[1].shares.web must be a finite number >= 0, got nan")],
)  # fmt: skip
def test_a_schedule_piece_that_is_not_finite_is_refused(
    from_tokens: str, shares: str, problem: str, line: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = (line / "dataline.json").read_bytes()

    assert main(["data", "schedule", "--work", str(line), "--from-tokens", from_tokens, "--shares", shares]) == 2
    assert one_error_line(capsys).endswith(problem)
    assert (line / "dataline.json").read_bytes() == config


@pytest.mark.parametrize(
    ("change", "problem"),
    [(lambda recipe: recipe.update(heldout_fraction=0.05),
      "unknown key recipe.heldout_fraction (the recipe's keys: tokenizer, seed, segments_per_cycle, "
      "at_corpus_end, validation_tokens, sources, schedule)"),
     (lambda recipe: recipe["sources"][1].update(heldout_fracton=0.05),
      "unknown key sources[1].heldout_fracton (a local source's keys: name, kind, include, text_field, "
      "strata, heldout_fraction, control_markers, path)"),
     (lambda recipe: recipe["sources"][0].update(repo="org/web"), "unknown key sources[0].repo (a local source's"),
     (lambda recipe: recipe["schedule"][0].update(from_token=0),
      "unknown key schedule[0].from_token (a schedule piece's keys: from_tokens, shares)"),
     (lambda recipe: recipe["schedule"].append({"from_tokens": float("inf"), "shares": {"web": 1}}),
      "schedule[1].from_tokens must be a whole number of tokens >= 0, got inf")],
)  # fmt: skip
def test_a_recipe_key_nothing_reads_or_a_number_that_is_not_finite_is_refused(
    change: object, problem: str, inputs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recipe = json.loads(inputs["recipe"].read_text())
    change(recipe)  # type: ignore[operator]
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps(recipe))

    assert main(init_arguments(tmp_path / "line", path)) == 2
    assert one_error_line(capsys).startswith(f"nsconsole: {path}: {problem}")
    assert not (tmp_path / "line").exists()
    out = tmp_path / "tok.json"
    assert main(["data", "tokenizer", "--train", "--recipe", str(path), "--vocab", "400", "--out", str(out)]) == 2
    assert one_error_line(capsys).startswith(f"nsconsole: {path}: {problem}")
    assert not out.exists()


def test_a_negative_long_seq_len_is_refused(line: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["data", "val", "--work", str(line), "--seq-len", "32", "--long-seq-len", "-1"]) == 2
    assert one_error_line(capsys) == "nsconsole: --long-seq-len must be >= 0 (0: none), got -1"
    assert not (line / "val").exists()


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [("--ahead", "0", "must be at least 1, got 0"), ("--min-free-gb", "-1", "must be a finite number of GiB >= 0"),
     ("--min-free-gb", "nan", "must be a finite number of GiB >= 0")],
)  # fmt: skip
def test_a_bad_preparer_option_is_a_usage_error_not_a_preparer_stopped_for_good(
    line: Path, capsys: pytest.CaptureFixture[str], option: str, value: str, says: str
) -> None:
    """Exit 2 before anything runs (it was 78, "stopped for good", with a generic fix), and no
    preparer.json written."""
    with pytest.raises(SystemExit) as exited:  # argparse's refusal of the option
        main(["data", "run-preparer", "--work", str(line), option, value, "--once"])
    assert exited.value.code == 2
    error = one_error_line(capsys)
    assert option in error and says in error
    assert not (line / "preparer.json").exists()


def test_a_negative_disk_reserve_in_the_environment_is_refused(
    line: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NSCONSOLE_DATA_MIN_FREE_GB", "-3")
    assert main(["data", "run-preparer", "--work", str(line), "--once"]) != 0
    assert "$NSCONSOLE_DATA_MIN_FREE_GB: must be a finite number of GiB >= 0, got '-3'" in one_error_line(capsys)
