"""A user's own corpus lived with for weeks: found walking the CLI over local files.

A schedule grown while the preparer runs, a consumed cycle rebuilt by hand, a preparer run with
--once, compressed and binary files, a byte-order mark, relative paths in a recipe, a tokenizer
trained on a recipe's sources.
"""

from __future__ import annotations

import gzip
import itertools
import json
from pathlib import Path

import pytest
from helpers.data import web_chat_inputs, write_recipe

from datalines import DataLineError, open_data_line
from datalines.creation import init_data_line
from datalines.dataline import DataLine
from datalines.planning import Planner, load_plan
from datalines.preparer import prepare_cycle
from datalines.schedule import append_schedule_piece
from datalines.service import run_preparer
from nsconsole.cli import main

CYCLE_TOKENS = 5000


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return web_chat_inputs(tmp_path_factory.mktemp("inputs"))


def new_line(inputs: dict[str, Path], path: Path) -> DataLine:
    return init_data_line(path, inputs["recipe"], 0, CYCLE_TOKENS, None)


def shares_planned(line: DataLine, index: int) -> dict[str, float]:
    plan = load_plan(line, index)
    assert plan is not None
    return {name: source["share"] for name, source in plan["sources"].items()}


def test_a_running_preparer_plans_with_a_schedule_grown_after_it_started(
    inputs: dict[str, Path], tmp_path: Path
) -> None:
    preparers = new_line(inputs, tmp_path / "line")  # opened once, as a preparer running for weeks
    assert run_preparer(preparers, ahead=1, once=True).ready == [0]
    # `data schedule` in another process, while that preparer waits for the trainer.
    append_schedule_piece(open_data_line(preparers.path), 2 * CYCLE_TOKENS, {"web": 0.1, "chat": 0.9})
    preparers.mark_consumed(0)
    assert run_preparer(preparers, ahead=2, once=True).ready == [1, 2]
    assert shares_planned(preparers, 1) == {"web": 0.75, "chat": 0.25}
    assert shares_planned(preparers, 2) == {"web": 0.1, "chat": 0.9}
    manifest = preparers.cycle(2).manifest["sources"]
    assert manifest["chat"]["tokens"] > 3 * manifest["web"]["tokens"]


def test_a_trainers_open_line_weighs_validation_by_the_grown_schedule(
    inputs: dict[str, Path], tmp_path: Path
) -> None:
    trainers = new_line(inputs, tmp_path / "line")
    assert trainers.validation_weights(3 * CYCLE_TOKENS) == {"web": 0.75, "chat": 0.25}
    append_schedule_piece(open_data_line(trainers.path), 2 * CYCLE_TOKENS, {"web": 1})
    assert trainers.validation_weights(3 * CYCLE_TOKENS) == {"web": 1.0}
    assert trainers.validation_weights(0) == {"web": 0.75, "chat": 0.25}
    # Anything else changed in dataline.json is refused, not taken up.
    config = json.loads((trainers.path / "dataline.json").read_text())
    config["eos_id"] = 1
    (trainers.path / "dataline.json").write_text(json.dumps(config))
    with pytest.raises(DataLineError, match=r"dataline\.json: changed in more than its schedule's end"):
        trainers.validation_weights(0)
    assert trainers.eos_id == 0


def test_a_schedule_grown_while_a_cycle_is_planned_gets_the_cycle_planned_again(
    inputs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    line = new_line(inputs, tmp_path / "line")
    prepare_cycle(line, 0)
    plan = Planner.plan
    calls = itertools.count()

    def schedule_meanwhile(self: Planner, index: int, previous: dict | None) -> dict:
        if next(calls) == 0:  # `data schedule` lands between the planning and the plan's write
            append_schedule_piece(open_data_line(line.path), CYCLE_TOKENS, {"web": 1})
        return plan(self, index, previous)

    monkeypatch.setattr(Planner, "plan", schedule_meanwhile)
    prepare_cycle(line, 1)
    assert shares_planned(line, 1) == {"web": 1.0, "chat": 0.0}


def test_a_schedule_piece_over_planned_cycles_names_where_it_may_start(
    inputs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = new_line(inputs, tmp_path / "line")
    for index in range(3):
        prepare_cycle(line, index)
    shares = json.dumps({"web": 0.5, "chat": 0.5})
    arguments = ["data", "schedule", "--work", str(line.path), "--shares", shares, "--from-tokens"]
    assert main([*arguments, str(CYCLE_TOKENS)]) == 2
    error = capsys.readouterr().err
    assert "cycles 1..2 are planned already" in error
    assert "a new piece must start at token 15,000 (cycle 3) or later" in error
    assert len(error.splitlines()) == 1
    assert main([*arguments, str(3 * CYCLE_TOKENS)]) == 0
    assert "from token 15,000" in capsys.readouterr().out


def test_a_consumed_cycle_rebuilt_by_hand_stays_consumed(
    inputs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = new_line(inputs, tmp_path / "line")
    assert run_preparer(line, ahead=2, once=True).ready == [0, 1]
    trainer = tmp_path / "runs" / "a"
    line.mark_consumed(0, by=trainer)
    line.mark_consumed(1, by=trainer)
    assert run_preparer(line, ahead=1, once=True).ready == [2]
    assert main(["data", "rebuild", "--work", str(line.path), "--cycle", "0"]) == 0
    out = capsys.readouterr().out
    assert "every shard matches its manifest byte for byte" in out
    assert f"cycle 0 stays consumed by {trainer}" in out
    assert line.cycle_state(0) == "consumed"  # who trained it is still on record
    # The preparer deletes the rebuilt shards again and keeps the trainer's next cycles ready.
    assert run_preparer(line, ahead=2, once=True).ready == [2, 3]
    assert sorted(path.name for path in line.cycle_dir(0).iterdir()) == ["consumed", "manifest.json"]


def test_a_consumed_cycle_after_an_unconsumed_one_does_not_stall_the_preparer(
    inputs: dict[str, Path], tmp_path: Path
) -> None:
    """What a hand rebuild of an older nsconsole left: cycle 0 readable again, cycle 1 consumed.
    The preparer wanted cycle 1 forever ("preparing cycle 1", "cycle 1 ready" thousands of times a
    second) and never prepared the trainer's next cycle."""
    line = new_line(inputs, tmp_path / "line")
    assert run_preparer(line, ahead=2, once=True).ready == [0, 1]
    line.mark_consumed(0)
    line.mark_consumed(1)
    line.reopen(0)
    statuses = itertools.count()
    status = run_preparer(line, ahead=2, once=True, should_stop=lambda status: next(statuses) > 200)
    assert status.state == "ready" and status.ready == [0, 2]


def test_data_status_after_run_preparer_once_says_it_exited(
    inputs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = new_line(inputs, tmp_path / "line")
    assert main(["data", "run-preparer", "--work", str(line.path), "--ahead", "1", "--once"]) == 0
    capsys.readouterr()
    assert main(["data", "status", "--work", str(line.path)]) == 0
    out = capsys.readouterr().out
    assert "killed or crashed" not in out
    assert "preparer: exited (--once" in out and "cycles 0..0 ready" in out


def test_data_status_shows_a_grown_schedule(
    inputs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = new_line(inputs, tmp_path / "line")
    append_schedule_piece(line, 3 * CYCLE_TOKENS, {"web": 1})
    assert main(["data", "status", "--work", str(line.path)]) == 0
    out = capsys.readouterr().out
    assert "schedule: from token 0 (cycle 0): web 0.75, chat 0.25; from token 15,000 (cycle 3): web 1, chat 0" in out
    assert main(["data", "status", "--work", str(line.path), "--json"]) == 0
    schedule = json.loads(capsys.readouterr().out)["schedule"]
    assert schedule[1] == {"from_tokens": 15000, "shares": {"web": 1.0, "chat": 0.0}}


def write_jsonl(path: Path, texts: list[str], opener=open, encoding: str = "utf-8") -> Path:  # noqa: ANN001
    path.parent.mkdir(parents=True, exist_ok=True)
    with opener(path, "wt", encoding=encoding) as handle:
        handle.writelines(json.dumps({"text": text}) + "\n" for text in texts)
    return path


def one_source_recipe(path: Path, tokenizer: Path, source: dict) -> Path:
    recipe = {"tokenizer": str(tokenizer), "validation_tokens": 2000,
              "sources": [{"name": "own", "kind": "local", **source}],
              "schedule": [{"from_tokens": 0, "shares": {"own": 1}}]}  # fmt: skip
    path.write_text(json.dumps(recipe))
    return path


def chat_texts(inputs: dict[str, Path]) -> list[str]:
    lines = (inputs["chat"] / "chats" / "chats.jsonl").read_text().splitlines()
    return [json.loads(line)["text"] for line in lines]


def test_compressed_jsonl_and_text_files_are_read_as_their_plain_twins(
    inputs: dict[str, Path], tmp_path: Path
) -> None:
    texts = chat_texts(inputs)
    plain, packed = tmp_path / "plain", tmp_path / "packed"
    write_jsonl(plain / "a.jsonl", texts[:100])
    (plain / "b.txt").write_text(texts[100], encoding="utf-8")
    write_jsonl(packed / "a.jsonl.gz", texts[:100], opener=gzip.open)
    with gzip.open(packed / "b.txt.gz", "wt", encoding="utf-8") as handle:
        handle.write(texts[100])
    lines = {}
    for name, root in (("plain", plain), ("packed", packed)):
        recipe = one_source_recipe(tmp_path / f"{name}.json", inputs["tokenizer"], {"path": str(root)})
        lines[name] = init_data_line(tmp_path / f"line-{name}", recipe, 0, 2000, None)
        assert [file.path for file in lines[name].source("own").files] == [
            path.name for path in sorted(root.iterdir())
        ]  # read with no `include`: compressed files are readable files
        prepare_cycle(lines[name], 0)
    # Compressed or not, the same documents (shuffled by each file's own sha256).
    documents = {name: [line.source("own").documents(file) for file in line.source("own").files]
                 for name, line in lines.items()}  # fmt: skip
    assert documents["plain"] == documents["packed"] == [texts[:100], [texts[100]]]
    sizes = [line.cycle(0).manifest["sources"]["own"]["tokens"] for line in lines.values()]
    assert abs(sizes[0] - sizes[1]) < 200 and all(size > 1000 for size in sizes)


def test_a_binary_file_is_refused_naming_it_rather_than_trained_as_text(
    inputs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "own"
    write_jsonl(root / "a.jsonl", chat_texts(inputs)[:50])
    (root / "b.tar").write_bytes(b"archive\0\0\0" + bytes(range(256)))  # a binary file the glob takes in
    recipe = one_source_recipe(tmp_path / "recipe.json", inputs["tokenizer"], {"path": str(root), "include": ["*"]})
    assert main(["data", "init", "--work", str(tmp_path / "line"), "--recipe", str(recipe), "--eos-id", "0",
                 "--cycle-tokens", "2000"]) == 2  # fmt: skip
    error = capsys.readouterr().err
    assert f"{root / 'b.tar'}: source own: b.tar is not text (it holds NUL bytes" in error
    assert len(error.splitlines()) == 1
    assert not (tmp_path / "line").exists()


def test_a_directory_without_a_readable_file_is_named(
    inputs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "own"
    root.mkdir()
    (root / "a.csv").write_text("text\nhello\n")
    recipe = one_source_recipe(tmp_path / "recipe.json", inputs["tokenizer"], {"path": str(root)})
    assert main(["data", "init", "--work", str(tmp_path / "line"), "--recipe", str(recipe), "--eos-id", "0",
                 "--cycle-tokens", "2000"]) == 2  # fmt: skip
    error = capsys.readouterr().err
    assert f"{root}: source own: no file there is readable; a local source reads .parquet, .jsonl" in error


def test_a_jsonl_file_with_a_byte_order_mark_is_read(inputs: dict[str, Path], tmp_path: Path) -> None:
    texts = chat_texts(inputs)[:60]
    write_jsonl(tmp_path / "bom" / "a.jsonl", texts, encoding="utf-8-sig")
    write_jsonl(tmp_path / "plain" / "a.jsonl", texts)
    recipe = one_source_recipe(tmp_path / "recipe.json", inputs["tokenizer"], {"path": str(tmp_path / "bom")})
    line = init_data_line(tmp_path / "line", recipe, 0, 2000, None)
    source = line.source("own")
    assert source.documents(source.files[0]) == texts  # no U+FEFF before the first
    prepare_cycle(line, 0)


def test_a_jsonl_line_that_is_not_json_or_lacks_the_field_is_named(
    inputs: dict[str, Path], tmp_path: Path
) -> None:
    root = tmp_path / "own"
    path = write_jsonl(root / "a.jsonl", chat_texts(inputs)[:5])
    recipe = one_source_recipe(tmp_path / "recipe.json", inputs["tokenizer"], {"path": str(root)})
    with open(path, "a") as handle:
        handle.write("this is not json\n")
    with pytest.raises(DataLineError, match=r"a\.jsonl: source own: a\.jsonl line 6 is not JSON \(Expecting value, column 1\)"):
        init_data_line(tmp_path / "line", recipe, 0, 2000, None)
    write_jsonl(path, chat_texts(inputs)[:5])
    with open(path, "a") as handle:
        handle.write('{"content": "x", "id": 3}\n')
    with pytest.raises(DataLineError, match=r"line 6 is not a JSON object with a 'text' field \(its fields: content, id\)"):
        init_data_line(tmp_path / "line", recipe, 0, 2000, None)


def test_a_relative_source_path_is_taken_from_the_recipe_file(
    inputs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "recipes").mkdir()
    write_jsonl(tmp_path / "corpus" / "a.jsonl", chat_texts(inputs)[:80])
    recipe = one_source_recipe(tmp_path / "recipes" / "recipe.json", inputs["tokenizer"], {"path": "../corpus"})
    monkeypatch.chdir(inputs["root"])  # anywhere else: the path is the recipe's, not the shell's
    line = init_data_line(tmp_path / "line", recipe, 0, 2000, None)
    assert line.config["pins"]["own"]["root"] == str(tmp_path / "corpus")


def test_a_tokenizer_trained_on_a_recipe_reads_its_sources_as_init_does(
    inputs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenizers import Tokenizer

    import datalines.tokenizer_training
    from datalines.corpus import file_documents

    trained: list[str] = []
    train = datalines.tokenizer_training.train_byte_level_bpe

    def recording(texts, *arguments):  # noqa: ANN001, ANN002, ANN202
        trained.extend(texts)
        return train(trained, *arguments)

    monkeypatch.setattr(datalines.tokenizer_training, "train_byte_level_bpe", recording)
    out = tmp_path / "tok.json"
    arguments = ["data", "tokenizer", "--train", "--recipe", str(inputs["recipe"]), "--vocab", "400", "--out", str(out)]
    assert main(arguments) == 0
    assert "special tokens <|endoftext|>, <|im_start|>, <|im_end|>" in capsys.readouterr().out
    tokenizer = Tokenizer.from_file(str(out))
    assert [tokenizer.token_to_id(token) for token in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    # The line it makes holds the markers as tokens, and its held-out chats (5 %) were never trained on.
    line = init_data_line(tmp_path / "line", inputs["recipe"], 0, CYCLE_TOKENS, out)
    chat = line.source("chat")
    heldout = [text for file in chat.files for text in file_documents(chat, file, 0).heldout]
    assert len(heldout) >= 3 and not set(heldout) & set(trained)
    assert len(trained) == len(set(trained)) > 100
    assert main(["data", "tokenizer", "--train", "--recipe", str(inputs["recipe"]), "--source", "x",
                 "--out", str(out)]) == 2  # fmt: skip
    assert "takes --source DIR (repeatable) or --recipe FILE" in capsys.readouterr().err


def test_a_cycle_larger_than_a_source_is_refused_at_init(
    inputs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The README's `--cycle-tokens 2e10` over a small local corpus: init passed, then the preparer
    waited for disk for shards of a cycle that could never be planned."""
    work = tmp_path / "line"
    arguments = ["data", "init", "--work", str(work), "--recipe", str(inputs["recipe"]), "--eos-id", "0"]
    assert main([*arguments, "--cycle-tokens", "2e10"]) == 2
    error = capsys.readouterr().err
    assert "--cycle-tokens 20,000,000,000: source web holds about " in error
    assert "short of its share of one cycle (15,000,000,000 at 0.75)" in error
    assert len(error.splitlines()) == 1 and not work.exists()
    last_cycle = write_recipe(tmp_path / "recipe.json", inputs["web"], inputs["chat"], inputs["tokenizer"],
                              at_corpus_end="last_cycle")  # fmt: skip
    assert main([*arguments[:5], str(last_cycle), "--eos-id", "0", "--cycle-tokens", "2e10"]) == 0
