"""Small corpora, tokenizers and recipes for the data-line tests."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pyarrow
import pyarrow.parquet

from datalines.tokenizer import train_byte_level_bpe

_WORD_TEXT = (
    "the of and to in is was for on that with as by at from his her an which this be or are were had "
    "river stone market winter letter garden engine signal harbor thunder copper lantern meadow orbit "
    "def return class import yield lambda while async await print self None True False"
)


WORDS = _WORD_TEXT.split()


SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


ADDED_TOKENS = ["</s>", "<think>"]


def make_text(rng: random.Random, words: int) -> str:
    sentence = " ".join(rng.choice(WORDS) for _ in range(words))
    return sentence[0].upper() + sentence[1:] + f". {rng.randrange(10**6)}\n"


def write_parquet(path: Path, texts: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pyarrow.parquet.write_table(pyarrow.table({"text": texts, "id": list(range(len(texts)))}), path)


def make_web_corpus(
    root: Path, seed: int = 0, files_per_stratum: int = 2, documents_per_file: int = 60
) -> Path:
    """Strata `news` and `wiki` (parquet) and `books` (text files, one document each)."""
    rng = random.Random(seed)
    for stratum, length in (("news", 40), ("wiki", 90)):
        for number in range(files_per_stratum):
            texts = [make_text(rng, rng.randrange(length // 2, length)) for _ in range(documents_per_file)]
            write_parquet(root / stratum / f"part-{number:03d}.parquet", texts)
    for number in range(files_per_stratum * 10):
        path = root / "books" / f"book-{number:03d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(make_text(rng, rng.randrange(100, 300)), encoding="utf-8")
    return root


def make_chat_corpus(root: Path, seed: int = 1, documents: int = 150) -> Path:
    """One jsonl stratum of chats with control markers, some quoting `</s>` and `<think>` as text."""
    rng = random.Random(seed)
    path = root / "chats" / "chats.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for _ in range(documents):
            text = (
                f"<|im_start|>user\n{make_text(rng, 12)}<|im_end|>\n"
                f"<|im_start|>assistant\nwrite </s> or <think> {make_text(rng, 20)}<|im_end|>"
            )
            handle.write(json.dumps({"text": text}) + "\n")
    return root


def make_tokenizer(path: Path, corpora: list[Path], vocab: int = 600) -> Path:
    """A byte-level BPE trained on the corpora's texts, with special and added tokens."""
    from tokenizers import Tokenizer

    texts = []
    for corpus in corpora:
        for file in sorted(corpus.rglob("*")):
            if file.suffix == ".parquet":
                texts.extend(pyarrow.parquet.read_table(file).column("text").to_pylist())
            elif file.suffix == ".jsonl":
                texts.extend(json.loads(line)["text"] for line in file.read_text().splitlines())
            elif file.suffix == ".txt":
                texts.append(file.read_text())
    tokenizer = Tokenizer.from_str(train_byte_level_bpe(texts, vocab, SPECIAL_TOKENS))
    tokenizer.add_tokens(ADDED_TOKENS)
    path.write_text(tokenizer.to_str(), encoding="utf-8")
    return path


def write_recipe(path: Path, web: Path, chat: Path, tokenizer: Path, **overrides: object) -> Path:
    recipe = {
        "tokenizer": str(tokenizer),
        "seed": 7,
        "segments_per_cycle": 4,
        "validation_tokens": 20_000,
        "sources": [
            {"name": "web", "kind": "local", "path": str(web)},
            {"name": "chat", "kind": "local", "path": str(chat), "heldout_fraction": 0.05,
             "control_markers": ["<|im_start|>", "<|im_end|>"]},
        ],
        "schedule": [{"from_tokens": 0, "shares": {"web": 0.75, "chat": 0.25}}],
    }
    recipe.update(overrides)
    path.write_text(json.dumps(recipe), encoding="utf-8")
    return path


def web_chat_inputs(root: Path) -> dict[str, Path]:
    """A web and a chat corpus, a tokenizer trained on both and a recipe mixing them, under `root`:
    {"root", "web", "chat", "tokenizer", "recipe"}."""
    web = make_web_corpus(root / "web")
    chat = make_chat_corpus(root / "chat")
    tokenizer = make_tokenizer(root / "tokenizer.json", [web, chat])
    recipe = write_recipe(root / "recipe.json", web, chat, tokenizer)
    return {"root": root, "web": web, "chat": chat, "tokenizer": tokenizer, "recipe": recipe}


def make_web_chat_recipe(root: Path) -> Path:
    """A web and a chat corpus, a tokenizer trained on both and a recipe mixing them, under `root`."""
    return web_chat_inputs(root)["recipe"]


def worst_run_deviation(order: np.ndarray, weights: list[int]) -> float:
    """max over sources and contiguous runs [a, b) of |count in run - (b - a) * share|."""
    total = sum(weights)
    slots = np.arange(len(order) + 1)
    worst = 0.0
    for index, weight in enumerate(weights):
        counts = np.concatenate([[0], np.cumsum(order == index)])
        lag = counts - slots * weight / total  # run deviation = lag[b] - lag[a]
        worst = max(worst, float(lag.max() - lag.min()))
    return worst

