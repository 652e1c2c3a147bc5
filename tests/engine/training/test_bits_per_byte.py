"""Bits per byte in every validation, against a hand computation on the same held-out rows.

The bytes by hand come from decoding each row's targets as text with the tokenizer's own decoder
(the separator skipped: it stands for no text), not from the per-token table the validator builds.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers.lines import SEQ_LEN, make_data_line, make_line

from datalines import open_data_line
from datalines.tokenizer import EMBEDDED_EOS_TOKEN, PlainTextTokenizer, train_byte_level_bpe
from engine.config.run import RunConfig
from engine.models.build import build_model
from engine.training.bits_per_byte import bits_per_byte_metrics, token_byte_lengths
from engine.training.optim import AdamWSettings, FlatAdamW, ParameterAverage
from engine.training.step import EagerEngine
from engine.training.validation import Validator

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread


@pytest.fixture(scope="module")
def data_line_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_data_line(tmp_path_factory.mktemp("bpb"), prepare=1, validation=(SEQ_LEN,))


@pytest.fixture(scope="module")
def config(data_line_path: Path, tmp_path_factory: pytest.TempPathFactory) -> RunConfig:
    return RunConfig.load(make_line(tmp_path_factory.mktemp("line"), data_line_path) / "run.json")


def hand_bits_per_byte(model: torch.nn.Module, windows: torch.Tensor, tokenizer: PlainTextTokenizer) -> float:
    model.eval()
    with torch.no_grad():
        nats = float(model(windows[:, :-1], windows[:, 1:])[0].double().sum())
    text_bytes = sum(len(tokenizer.full.decode(row[1:].tolist(), skip_special_tokens=True).encode("utf-8"))
                     for row in windows)  # fmt: skip
    return nats / (math.log(2) * text_bytes)


def test_bits_per_byte_of_a_tiny_line_equal_a_hand_computation(config: RunConfig, data_line_path: Path) -> None:
    torch.manual_seed(0)
    model = build_model("transformer-tiny", config.model.overrides)
    optimizer = FlatAdamW(model, AdamWSettings(0.9, 0.95, 1e-8, 1.0), torch.device("cpu"))
    average = ParameterAverage(optimizer, horizon_tokens=1024, from_tokens=0)
    engine = EagerEngine(model, optimizer, micro_batch_rows=4)
    windows = torch.randint(0, 256, (8, SEQ_LEN + 1), generator=torch.Generator().manual_seed(1))
    for update in (1, 2):
        engine.run_update(windows, lr=3e-3, weight_decay=0.1)
        average.after_update(update * 8 * SEQ_LEN, 8 * SEQ_LEN, True)
    heldout = open_data_line(data_line_path)
    metrics = Validator(model, optimizer, average, config, heldout, torch.device("cpu")).run(
        SEQ_LEN, at_tokens=0, next_lr=1e-3, next_weight_decay=0.1
    )

    rows = torch.from_numpy(heldout.validation_rows(SEQ_LEN)["text"][: config.validation.rows_per_source]).long()
    assert bool((rows[:, 1:] == heldout.eos_id).any())  # the separator's loss counts, its bytes do not
    expected = hand_bits_per_byte(model, rows, heldout.tokenizer)
    assert metrics[f"val_{SEQ_LEN}/bpb/text"] == pytest.approx(expected, rel=1e-9)
    assert metrics[f"val_{SEQ_LEN}/bpb/mix"] == pytest.approx(expected, rel=1e-9)  # one source
    # Nats per byte against nats per token: this tokenizer's tokens hold more than one byte.
    assert metrics[f"val_{SEQ_LEN}/bpb/text"] * math.log(2) < metrics[f"val_{SEQ_LEN}/text"]

    twin = build_model("transformer-tiny", config.model.overrides)
    FlatAdamW(twin, AdamWSettings(0.9, 0.95, 1e-8, 1.0), torch.device("cpu")).params.copy_(average.average)
    averaged = hand_bits_per_byte(twin, rows, heldout.tokenizer)
    assert metrics[f"ema/val_{SEQ_LEN}/bpb/text"] == pytest.approx(averaged, rel=1e-9)
    assert metrics[f"ema/val_{SEQ_LEN}/bpb/text"] != metrics[f"val_{SEQ_LEN}/bpb/text"]


def test_byte_level_tokens_count_the_bytes_of_split_characters() -> None:
    tokenizer = PlainTextTokenizer(train_byte_level_bpe(["the model trains"] * 20, 300, [EMBEDDED_EOS_TOKEN]), "t.json")
    text = "the modèl ☃ trains"  # è and ☃ are not merged: a token per byte, partial characters
    ids = tokenizer.encode_documents([text])[0]
    lengths = token_byte_lengths(tokenizer)
    assert int(lengths[torch.from_numpy(ids)].sum()) == len(text.encode("utf-8"))
    assert int(lengths[0]) == 0  # the separator


def test_byte_fallback_and_sentencepiece_tokens_count_their_text() -> None:
    vocab = {"<unk>": 0, "<0x0A>": 1, "\u2581the": 2, "é": 3, "ab": 4, "a": 5, "b": 6}
    tokenizer_json = {
        "version": "1.0", "truncation": None, "padding": None, "normalizer": None, "post_processor": None,
        "added_tokens": [{"id": 0, "content": "<unk>", "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True}],
        "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": False},
        "decoder": {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"},
                    {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": False}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "vocab": vocab,
                  "merges": [["a", "b"]]},
    }  # fmt: skip
    tokenizer = PlainTextTokenizer(json.dumps(tokenizer_json), "sp.json")
    assert token_byte_lengths(tokenizer).tolist() == [0, 1, 4, 2, 2, 1, 1]


def test_the_mix_is_the_bits_per_byte_of_the_stream_the_recipe_draws() -> None:
    # Source a: 2 targets of 3 bytes each, 6 nats; source b: 2 targets of 1 byte, 2 nats.
    byte_lengths = torch.tensor([0, 3, 1])
    windows = {"a": torch.tensor([[0, 1, 1]]), "b": torch.tensor([[0, 2, 2]])}
    losses = {"a": torch.tensor([[2.0, 4.0]], dtype=torch.float64), "b": torch.tensor([[1.0, 1.0]], dtype=torch.float64)}
    metrics = bits_per_byte_metrics("val_2", windows, losses, {"a": 0.25, "b": 0.75}, byte_lengths)
    ln2 = math.log(2)
    assert metrics["val_2/bpb/a"] == pytest.approx(6 / (6 * ln2))
    assert metrics["val_2/bpb/b"] == pytest.approx(2 / (2 * ln2))
    # Per target drawn: 0.25 x 3 + 0.75 x 1 nats over 0.25 x 3 + 0.75 x 1 bytes.
    assert metrics["val_2/bpb/mix"] == pytest.approx((0.25 * 3 + 0.75 * 1) / (ln2 * (0.25 * 3 + 0.75 * 1)))
