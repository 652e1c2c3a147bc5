"""A data line on local sources: init, cycles, the reader API, held-out, rebuild, exhaustion, errors."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers.data import (
    make_chat_corpus,
    make_tokenizer,
    make_web_corpus,
    worst_run_deviation,
    write_parquet,
    write_recipe,
)

from datalines import DataLineError, SourceExhausted, open_data_line
from datalines.corpus import file_documents
from datalines.creation import init_data_line
from datalines.dataline import DataLine
from datalines.preparer import delete_consumed_shards, prepare_cycle, rebuild_cycle
from datalines.validation import build_validation
from nsconsole.cli import main

CYCLE_TOKENS = 5000
SEQ_LEN = 32


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("inputs")
    web = make_web_corpus(root / "web")
    chat = make_chat_corpus(root / "chat")
    tokenizer = make_tokenizer(root / "tokenizer.json", [web, chat])
    return {"root": root, "web": web, "chat": chat, "tokenizer": tokenizer,
            "recipe": write_recipe(root / "recipe.json", web, chat, tokenizer)}


@pytest.fixture(scope="module")
def line(inputs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> DataLine:
    work = tmp_path_factory.mktemp("lines") / "line"
    created = init_data_line(work, inputs["recipe"], 0, CYCLE_TOKENS, None)
    for index in range(3):
        prepare_cycle(created, index)
    return open_data_line(created.path)


def shard_hashes(line: DataLine, index: int) -> dict[str, str]:
    directory = line.cycle_dir(index)
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(directory.iterdir())}


def test_init_pins_every_input(line: DataLine, inputs: dict[str, Path]) -> None:
    config = json.loads((line.path / "dataline.json").read_text())
    web_files = config["pins"]["web"]["files"]
    assert {file["stratum"] for file in web_files} == {"books", "news", "wiki"}
    for file in web_files:
        assert file["sha256"] == hashlib.sha256((inputs["web"] / file["path"]).read_bytes()).hexdigest()
    assert set(config["calibration"]["web"]) == {"books", "news", "wiki"}
    assert 0.05 < config["calibration"]["web"]["news"]["tokens_per_text_byte"] < 1
    assert line.tokenizer_json == inputs["tokenizer"].read_text()
    assert line.tokenizer_sha256 == hashlib.sha256(inputs["tokenizer"].read_bytes()).hexdigest()
    assert line.sources == ["web", "chat"]
    assert line.shares(0) == {"web": 0.75, "chat": 0.25}
    assert line.cycle_start_tokens(3) == 3 * CYCLE_TOKENS
    assert line.last_cycle() is None  # error mode: the corpus end is an error, never a planned end


def test_every_cycle_holds_every_stratum_at_its_share(line: DataLine) -> None:
    for index in range(3):
        manifest = line.cycle(index).manifest
        web, chat = manifest["sources"]["web"], manifest["sources"]["chat"]
        assert abs(web["tokens"] / (web["tokens"] + chat["tokens"]) - 0.75) < 0.05
        for stratum, expected in (("books", 0.21), ("news", 0.26), ("wiki", 0.53)):
            share = web["strata"][stratum]["tokens"] / web["tokens"]
            assert abs(share - expected) < 0.1, (index, stratum, share)


def test_sample_order_keeps_every_run_within_two_samples_of_the_recipe(line: DataLine) -> None:
    cycle = line.cycle(1)
    source_of_sample, _ = cycle._order(SEQ_LEN, 3)
    assert len(source_of_sample) == cycle.num_samples(SEQ_LEN) > 100
    assert worst_run_deviation(source_of_sample, [750_000, 250_000]) < 2.0


def test_samples_are_exact_windows_and_resume_anywhere(line: DataLine) -> None:
    cycle = line.cycle(0)
    count = cycle.num_samples(SEQ_LEN)
    everything = cycle.samples(SEQ_LEN, 0, count, seed=5)
    assert everything.shape == (count, SEQ_LEN + 1) and everything.dtype == np.int64
    # Resuming at any sample gives the same windows as an uninterrupted read.
    for start in (0, 1, 17, count - 3):
        assert np.array_equal(cycle.samples(SEQ_LEN, start, 3, seed=5), everything[start : start + 3])
    # Every window of every source is read exactly once, and it is the shard's tokens at that window.
    source_of_sample, window_of_sample = cycle._order(SEQ_LEN, 5)
    for index, name in enumerate(cycle.source_names):
        tokens = np.asarray(cycle.tokens(name), dtype=np.int64)
        mine = np.flatnonzero(source_of_sample == index)
        assert len(set(window_of_sample[mine].tolist())) == len(mine)
        for sample in mine[:20]:
            window = window_of_sample[sample]
            start = window * SEQ_LEN
            assert np.array_equal(everything[sample], tokens[start : start + SEQ_LEN + 1])
    # The k-th sample of a source reads a window of the source's k-th segment of windows: since the
    # shard lays strata out in proportion (merge_strata), every segment of the cycle holds every stratum.
    segments = line.recipe.segments_per_cycle
    for index, name in enumerate(cycle.source_names):
        windows = cycle.windows(name, SEQ_LEN)
        read = window_of_sample[source_of_sample == index]
        for k, window in enumerate(read.tolist()):
            segment = next(g for g in range(segments) if k < (g + 1) * windows // segments)
            assert segment * windows // segments <= window < (segment + 1) * windows // segments
    # Another seed reorders the same windows; the digest tells them apart.
    assert not np.array_equal(cycle.samples(SEQ_LEN, 0, count, seed=6), everything)
    assert cycle.order_digest(SEQ_LEN, 5) != cycle.order_digest(SEQ_LEN, 6)
    assert cycle.order_digest(SEQ_LEN, 5) == line.cycle(0).order_digest(SEQ_LEN, 5)
    with pytest.raises(DataLineError, match="outside cycle 0"):
        cycle.samples(SEQ_LEN, count - 1, 2, seed=5)
    # A source without a single window at a length is an error, never a silently empty cycle.
    with pytest.raises(DataLineError, match="source (web|chat) has no window of 20001 tokens in cycle 0"):
        cycle.num_samples(20_000)


def test_documents_are_joined_with_eos_and_markers_encode_as_tokens(line: DataLine) -> None:
    cycle = line.cycle(0)
    tokens = np.asarray(cycle.tokens("chat"))
    offsets = np.fromfile(cycle.directory / "chat.docs", dtype="<i8")
    assert offsets[0] == 0 and offsets[-1] == len(tokens)
    assert np.all(tokens[offsets[1:] - 1] == line.eos_id)
    first = tokens[offsets[0] : offsets[1] - 1].tolist()
    start_id = line.tokenizer.full.token_to_id("<|im_start|>")
    added_id = line.tokenizer.full.token_to_id("</s>")
    assert first[0] == start_id and added_id not in tokens
    assert "write </s> or <think>" in line.tokenizer.decode(first)


def contains_run(haystack: np.ndarray, needle: np.ndarray) -> bool:
    """Whether `needle` occurs as a contiguous run of tokens in `haystack`."""
    data, pattern = haystack.astype("<u2").tobytes(), needle.astype("<u2").tobytes()
    position = data.find(pattern)
    while position != -1:
        if position % 2 == 0:  # aligned on a token, not straddling two
            return True
        position = data.find(pattern, position + 1)
    return False


def test_contains_run_finds_aligned_runs_only() -> None:
    haystack = np.array([1, 2, 3, 256, 1], dtype=np.int64)
    assert contains_run(haystack, np.array([3, 256])) and not contains_run(haystack, np.array([2, 4]))
    # Bytes 00 01 | 02 00 hold 01 02 (token 0x0201) only across the token boundary.
    straddling = np.array([0x0100, 0x0002])
    assert straddling.astype("<u2").tobytes().find(np.array([0x0201]).astype("<u2").tobytes()) == 1
    assert not contains_run(straddling, np.array([0x0201]))


def held_out_and_trained(line: DataLine) -> tuple[dict[str, list[str]], list[str]]:
    held: dict[str, list[str]] = {}
    for name in line.sources:
        source = line.source(name)
        held[name] = [text for file in source.files for text in file_documents(source, file, 7).heldout]
    trained = []
    for index in range(3):
        cycle = line.cycle(index)
        for name in line.sources:
            tokens = np.asarray(cycle.tokens(name))
            offsets = np.fromfile(cycle.directory / f"{name}.docs", dtype="<i8")
            for start, end in zip(offsets, offsets[1:]):
                trained.append(line.tokenizer.decode(tokens[start : end - 1].tolist()))
    return held, trained


def test_no_held_out_document_is_in_a_training_shard(line: DataLine) -> None:
    held, trained = held_out_and_trained(line)
    assert len(held["web"]) >= 1 and len(held["chat"]) >= 3
    assert not set(trained) & {text for texts in held.values() for text in texts}
    # Token level too: no held-out document's tokens, framed by EOS, occur in any shard.
    for name, texts in held.items():
        spec = line.recipe.source(name)
        encoded = line.tokenizer.encode_documents(texts, spec.control_markers)
        for index in range(3):
            shard = np.concatenate([[line.eos_id], line.cycle(index).tokens(name)])
            for ids in encoded:
                assert not contains_run(shard, np.concatenate([[line.eos_id], ids, [line.eos_id]]))


def test_validation_rows_come_from_held_out_documents(line: DataLine) -> None:
    build_validation(line, [16])
    rows = line.validation_rows(16)
    assert set(rows) == {"web", "chat"}
    assert all(array.dtype == np.int32 and array.shape[1] == 17 and len(array) > 0 for array in rows.values())
    held, _ = held_out_and_trained(line)
    chat_text = "".join(held["chat"])
    assert line.tokenizer.decode(rows["chat"][0][:8].tolist()) in chat_text
    assert line.validation_weights() == {"web": 0.75, "chat": 0.25}
    with pytest.raises(DataLineError, match="data val"):
        line.validation_rows(99)


def test_rebuild_reproduces_a_consumed_cycle_byte_for_byte(
    line: DataLine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = open_data_line(shutil.copytree(line.path, tmp_path / "copy"))
    before = shard_hashes(copy, 1)
    copy.mark_consumed(1)
    assert delete_consumed_shards(copy) == [1]
    assert not copy.cycle_ready(1)
    with pytest.raises(DataLineError, match="consumed"):
        copy.cycle(1)
    assert sorted(path.name for path in copy.cycle_dir(1).iterdir()) == ["consumed", "manifest.json"]
    assert main(["data", "rebuild", "--work", str(copy.path), "--cycle", "1"]) == 0
    assert "matches its manifest byte for byte" in capsys.readouterr().out
    assert {name: digest for name, digest in shard_hashes(copy, 1).items() if name != "consumed"} == before
    assert copy.is_consumed(1)  # still trained: the rebuild only brought its shards back to read
    # A rebuild that comes out different is refused, naming the shard, and touches nothing.
    manifest_path = copy.cycle_dir(1) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["sources"]["chat"]["tokens_file"]["sha256"] = "0" * 64
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(DataLineError, match=r"chat\.tokens: rebuilt shard differs from the manifest"):
        rebuild_cycle(open_data_line(copy.path), 1)
    assert shard_hashes(copy, 1)["chat.tokens"] == before["chat.tokens"]


def test_a_damaged_shard_is_named_and_never_read(line: DataLine, tmp_path: Path) -> None:
    copy = open_data_line(shutil.copytree(line.path, tmp_path / "copy"))
    shard = copy.cycle_dir(2) / "web.tokens"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert not copy.cycle_ready(2)
    with pytest.raises(DataLineError, match=r"web\.tokens: shard sha256 differs"):
        copy.cycle(2)
    shard.write_bytes(bytes(data[:-2]))
    with pytest.raises(DataLineError, match="truncated"):
        open_data_line(copy.path).cycle(2)
    prepare_cycle(copy, 2)  # the manifest is kept: the preparer rebuilds the shards it describes
    assert shard_hashes(copy, 2) == shard_hashes(line, 2)


def test_same_inputs_give_the_same_bytes_in_another_line(
    line: DataLine, inputs: dict[str, Path], tmp_path: Path
) -> None:
    other = init_data_line(tmp_path / "other", inputs["recipe"], 0, CYCLE_TOKENS, None)
    prepare_cycle(other, 0)
    assert shard_hashes(other, 0) == shard_hashes(line, 0)


def test_a_source_running_out_raises_naming_source_and_cycle(line: DataLine, tmp_path: Path) -> None:
    copy = open_data_line(shutil.copytree(line.path, tmp_path / "copy"))
    message = r"source (web|chat) has no untrained documents left for cycle \d+"
    with pytest.raises(SourceExhausted, match=message):
        for index in range(3, 30):
            prepare_cycle(copy, index)
    assert copy.last_cycle() is None


def test_schedule_shares_change_on_cycle_boundaries(inputs: dict[str, Path], tmp_path: Path) -> None:
    schedule = [{"from_tokens": 0, "shares": {"web": 0.75, "chat": 0.25}},
                {"from_tokens": 2 * CYCLE_TOKENS, "shares": {"web": 0.5, "chat": 0.5}}]
    recipe = write_recipe(tmp_path / "recipe.json", inputs["web"], inputs["chat"], inputs["tokenizer"],
                          schedule=schedule)
    line = init_data_line(tmp_path / "line", recipe, 0, CYCLE_TOKENS, None)
    assert line.shares(2 * CYCLE_TOKENS - 1) == {"web": 0.75, "chat": 0.25}
    assert line.shares(2 * CYCLE_TOKENS) == {"web": 0.5, "chat": 0.5}
    prepare_cycle(line, 2)  # plans 0 and 1 first
    sources = line.cycle(2).manifest["sources"]
    chat, web = sources["chat"]["tokens"], sources["web"]["tokens"]
    assert abs(chat / (chat + web) - 0.5) < 0.06
    bad = write_recipe(tmp_path / "bad.json", inputs["web"], inputs["chat"], inputs["tokenizer"],
                       schedule=[schedule[0], {"from_tokens": 7, "shares": {"web": 1}}])
    with pytest.raises(DataLineError, match="from_tokens 7 is not a multiple of the cycle tokens"):
        init_data_line(tmp_path / "bad", bad, 0, CYCLE_TOKENS, None)


def test_a_corrupted_or_truncated_parquet_is_named(inputs: dict[str, Path], tmp_path: Path) -> None:
    web = shutil.copytree(inputs["web"], tmp_path / "web")
    victim = web / "news" / "part-001.parquet"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    recipe = write_recipe(tmp_path / "recipe.json", web, inputs["chat"], inputs["tokenizer"])
    with pytest.raises(DataLineError, match=r"part-001\.parquet.* is not a readable parquet file"):
        init_data_line(tmp_path / "line", recipe, 0, CYCLE_TOKENS, None)
    assert not (tmp_path / "line" / "dataline.json").exists()


def test_an_input_changed_after_init_is_refused(inputs: dict[str, Path], tmp_path: Path) -> None:
    web = shutil.copytree(inputs["web"], tmp_path / "web")
    recipe = write_recipe(tmp_path / "recipe.json", web, inputs["chat"], inputs["tokenizer"])
    line = init_data_line(tmp_path / "line", recipe, 0, CYCLE_TOKENS, None)
    write_parquet(web / "wiki" / "part-000.parquet", ["replaced"])
    with pytest.raises(DataLineError, match=r"part-000\.parquet changed since init"):
        prepare_cycle(open_data_line(line.path), 0)
    assert not line.cycle_dir(0).exists()


def test_recipe_errors_name_the_file_and_field(inputs: dict[str, Path], tmp_path: Path) -> None:
    cases = [
        (
            {"schedule": [{"from_tokens": 0, "shares": {"nope": 1}}]},
            r"schedule\[0\]\.shares\.nope names no source",
        ),
        (
            {"sources": [{"name": "Web", "kind": "local", "path": "x"}]},
            r"sources\[0\]\.name must be lower-case",
        ),
        ({"at_corpus_end": "wrap"}, r"recipe\.at_corpus_end must be one of error, last_cycle"),
    ]
    for overrides, message in cases:
        recipe = write_recipe(
            tmp_path / "recipe.json", inputs["web"], inputs["chat"], inputs["tokenizer"], **overrides
        )
        with pytest.raises(DataLineError, match="recipe.json: " + message):
            init_data_line(tmp_path / "line", recipe, 0, CYCLE_TOKENS, None)
    recipe = write_recipe(tmp_path / "recipe.json", inputs["web"], inputs["chat"], inputs["tokenizer"])
    with pytest.raises(DataLineError, match="--eos-id 9999 is outside the vocab"):
        init_data_line(tmp_path / "line", recipe, 9999, CYCLE_TOKENS, None)


def test_status_lists_cycles_by_state(
    line: DataLine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = open_data_line(shutil.copytree(line.path, tmp_path / "copy"))
    copy.mark_consumed(0)
    (copy.cycle_dir(2) / "web.tokens").unlink()
    assert main(["data", "status", "--work", str(copy.path), "--json"]) == 1  # 1: it reports damage
    report = json.loads(capsys.readouterr().out)
    assert report["cycles"] == {"0": "consumed", "1": "ready", "2": "damaged"}
    assert report["sources"] == {"web": 0.75, "chat": 0.25} and report["last_cycle"] is None
    assert main(["data", "status", "--work", str(copy.path)]) == 1
    assert "cycle    2  damaged" in capsys.readouterr().out


def test_the_schedule_only_grows_at_its_end(
    line: DataLine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = open_data_line(shutil.copytree(line.path, tmp_path / "copy"))
    config_before = json.loads((copy.path / "dataline.json").read_text())
    work = str(copy.path)
    # Cycles 0..2 are planned: a piece starting inside them would change the past.
    arguments = ["data", "schedule", "--work", work, "--from-tokens", str(2 * CYCLE_TOKENS)]
    assert main([*arguments, "--shares", '{"web": 0.5, "chat": 0.5}']) == 2
    assert "cycle 2 is planned already (a planned cycle keeps its shares); a new piece must start at token 15,000" in (
        capsys.readouterr().err
    )
    assert main(["data", "schedule", "--work", work, "--from-tokens", "16000", "--shares", '{"web": 1}']) == 2
    assert "not a multiple of the cycle tokens 5000" in capsys.readouterr().err
    assert main(["data", "schedule", "--work", work, "--from-tokens", "2e4", "--shares", '{"nope": 1}']) == 2
    assert "shares.nope names no source" in capsys.readouterr().err
    assert json.loads((copy.path / "dataline.json").read_text()) == config_before
    even = '{"web": 0.5, "chat": 0.5}'
    assert main(["data", "schedule", "--work", work, "--from-tokens", "2e4", "--shares", even]) == 0
    grown = open_data_line(copy.path)
    assert grown.shares(4 * CYCLE_TOKENS) == {"web": 0.5, "chat": 0.5}
    assert grown.shares(3 * CYCLE_TOKENS) == {"web": 0.75, "chat": 0.25}
    config_after = json.loads((copy.path / "dataline.json").read_text())
    assert {key: value for key, value in config_after.items() if key != "recipe"} == {
        key: value for key, value in config_before.items() if key != "recipe"
    }


def test_last_cycle_mode_trains_every_document_exactly_once(
    inputs: dict[str, Path], tmp_path: Path
) -> None:
    corpora = (inputs["web"], inputs["chat"], inputs["tokenizer"])
    recipe = write_recipe(tmp_path / "recipe.json", *corpora, at_corpus_end="last_cycle")
    line = init_data_line(tmp_path / "line", recipe, 0, CYCLE_TOKENS, None)
    index = 0
    while True:
        prepare_cycle(line, index)
        if line.last_cycle() is not None:
            break
        index += 1
    assert line.last_cycle() == index >= 2
    assert not (tmp_path / "line" / "plans" / f"c{index + 1:04d}.json").exists()
    with pytest.raises(DataLineError, match=f"cycle {index + 1} is past the line's last cycle {index}"):
        prepare_cycle(line, index + 1)
    for name in line.sources:
        source = line.source(name)
        expected = sorted(text for file in source.files for text in file_documents(source, file, 7).training)
        trained = []
        for cycle_index in range(index + 1):
            cycle = line.cycle(cycle_index)
            tokens = np.asarray(cycle.tokens(name))
            offsets = np.fromfile(cycle.directory / f"{name}.docs", dtype="<i8")
            for start, end in zip(offsets, offsets[1:]):
                trained.append(line.tokenizer.decode(tokens[start : end - 1].tolist()))
        assert sorted(trained) == expected  # every training document once: max epochs 1, nothing lost
