"""Tiny real data lines and training lines for the trainer tests.

A local source of a few hundred short jsonl documents, a byte-level BPE of 300 tokens trained on
them, cycles of 5,000 tokens (`at_corpus_end: last_cycle`, so the line ends by itself; the
preparer records sample-order digests at 4096, so a cycle needs more than 4097 tokens), and a
`transformer-tiny` training line on it at seq_len 32, 16 rows per update in micro-batches of 8.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from datalines.creation import init_data_line
from datalines.preparer import prepare_cycle
from datalines.tokenizer import EMBEDDED_EOS_TOKEN, train_byte_level_bpe
from datalines.validation import build_validation
from engine.checkpoints.format import read_latest
from engine.checkpoints.tensors import Checkpoint, load_checkpoint
from engine.config.run import RunConfig
from engine.ops.new import NewLineOptions, new_line

SEQ_LEN = 32


TOKENS_PER_UPDATE = 16 * SEQ_LEN


CYCLE_TOKENS = 5000


VALIDATION_LENGTHS = (SEQ_LEN, 2 * SEQ_LEN)
"""Held-out row lengths of the test data lines: the training length and a branch's long stage."""


SENTENCE = (
    "the a model trains on tokens while spikes flow through layers of state and memory "
    "each update reads windows from a cycle then writes a checkpoint before it moves on"
)


WORDS = SENTENCE.split(" ")


def make_data_line(
    root: Path, files: int = 5, prepare: int | None = None, validation: tuple[int, ...] = VALIDATION_LENGTHS
) -> Path:
    """A data line under `root/data` with every cycle (or the first `prepare`) prepared and held-out
    rows of the `validation` lengths (a trainer refuses a line whose validation lacks its rows)."""
    corpus = root / "corpus"
    corpus.mkdir(parents=True)
    rng = random.Random(0)
    texts = []
    for index in range(files):
        documents = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 40))) for _ in range(60)]
        texts += documents
        (corpus / f"part{index}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    (root / "tokenizer.json").write_text(train_byte_level_bpe(texts, 300, [EMBEDDED_EOS_TOKEN]))
    recipe = {
        "seed": 0,
        "segments_per_cycle": 2,
        "at_corpus_end": "last_cycle",
        "validation_tokens": 100,
        "sources": [{"name": "text", "kind": "local", "path": str(corpus), "heldout_fraction": 0.05}],
        "schedule": [{"from_tokens": 0, "shares": {"text": 1.0}}],
    }
    (root / "recipe.json").write_text(json.dumps(recipe))
    line = init_data_line(root / "data", root / "recipe.json", 0, CYCLE_TOKENS, root / "tokenizer.json")
    index = 0
    while prepare is None or index < prepare:
        prepare_cycle(line, index)
        last = line.last_cycle()
        if last is not None and index >= last:
            break
        index += 1
    if validation:
        build_validation(line, list(validation))
    return root / "data"


def make_line(root: Path, data: Path, **changes: Any) -> Path:
    """A transformer-tiny training line on `data`; `changes` replace run.json fields (dotted keys)."""
    line = root / "line"
    options = NewLineOptions(
        preset="transformer-tiny", data=data, seq_len=SEQ_LEN, tokens_per_update=TOKENS_PER_UPDATE
    )
    config = new_line(line, options)
    document = config.to_dict()
    document.update({"device": "cpu", "print_every": 1})
    document["lengths"][0]["micro_batch_rows"] = 8  # two micro-batches per update: accumulation
    document["checkpoints"]["every_updates"] = 5
    document["guards"]["min_free_disk_gb"] = 0.01  # tiny lines: don't depend on the CI disk's size
    warmup_then_constant = [{"kind": "warmup", "until": 512, "to": 1.0}, {"kind": "constant"}]
    document["lr"] = {"peak": 3e-3, "pieces": warmup_then_constant}
    for dotted, value in changes.items():
        target = document
        *parents, last = dotted.split(".")
        for key in parents:
            target = target[key]
        target[last] = value
    config = RunConfig.from_dict(document)
    config.validate()
    config.save(line / "run.json")
    config.save(line / "accepted_run.json")
    return line


WALL_CLOCK_FIELDS = ("time", "tokens_per_s")
"""Row fields that differ between two runs of the same line."""


def rows_without_wall_clock(rows_jsonl: Path) -> list[dict]:
    """A rows.jsonl's rows without their wall-clock fields: what two equal runs share exactly."""
    rows = [json.loads(text) for text in rows_jsonl.read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in WALL_CLOCK_FIELDS} for row in rows]


def data_template_fixture(**options: Any) -> Any:
    """A module-scoped `data_template` fixture: a data line made once per module by
    `make_data_line(..., **options)`, copied by each test that trains on it."""

    @pytest.fixture(scope="module")
    def data_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
        return make_data_line(tmp_path_factory.mktemp("template"), **options)

    return data_template


def trained_line_fixture(stop_at: int = 2) -> Any:
    """A module-scoped `line` fixture: a line on the module's `data_template`, trained once to update
    `stop_at` (a checkpoint there) for the tests that only read it (sample, eval)."""

    @pytest.fixture(scope="module")
    def line(data_template: Path) -> Path:
        from engine.training.trainer import Trainer

        trained = make_line(data_template.parent / "lines", data_template)
        with one_torch_thread():
            assert Trainer(trained, stop_at=stop_at, echo=None).run() == 0
        return trained

    return line


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Tiny models on a shared 2-core machine run many times faster on one intra-op thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def copy_data_line(template: Path, root: Path) -> Path:
    """A private copy of a prepared data line (training marks cycles consumed)."""
    target = root / "data"
    shutil.copytree(template, target)
    return target


def latest_checkpoint(line: Path) -> Checkpoint:
    """The line's checkpoint that `latest` names, loaded."""
    return load_checkpoint(line / "checkpoints" / read_latest(line / "checkpoints"))


def assert_same_state(line: Path, reference: Path) -> None:
    """The latest checkpoints hold the same update, position, data record, weights, optimizer state
    and extra state, bit for bit; the two lines logged the same rows."""
    mine, theirs = latest_checkpoint(line), latest_checkpoint(reference)
    assert mine.update == theirs.update
    assert mine.state["position"] == theirs.state["position"] and mine.state["data"] == theirs.state["data"]
    for part in ("weights", "optimizer", "extra"):
        mine_part, their_part = getattr(mine, part), getattr(theirs, part)
        assert sorted(mine_part) == sorted(their_part), part
        for key, tensor in their_part.items():
            assert torch.equal(mine_part[key], tensor), f"{part}/{key}"
    assert rows_without_wall_clock(line / "rows.jsonl") == rows_without_wall_clock(reference / "rows.jsonl")


def line_readings(line: Path) -> tuple[list[float], torch.Tensor]:
    """A line's losses of every update and its newest checkpoint's weights, flat (for lines that
    may differ in rounding: CUDA lines, compared by `line_spread`)."""
    losses = [json.loads(text)["loss"] for text in (line / "rows.jsonl").read_text().splitlines()]
    latest = load_checkpoint(line / "checkpoints" / read_latest(line / "checkpoints"))
    return losses, torch.cat([latest.weights[key].flatten() for key in sorted(latest.weights)])


def line_spread(a: tuple[list[float], torch.Tensor], b: tuple[list[float], torch.Tensor]) -> tuple[float, float]:
    """The largest loss and weight differences of two lines' `line_readings`."""
    loss = max(abs(x - y) for x, y in zip(a[0], b[0], strict=True))
    return loss, float((a[1] - b[1]).abs().max())
