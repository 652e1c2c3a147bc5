"""The tokenizer of a data line: a `tokenizers` JSON pinned by sha256, encoding documents as plain text.

A document is plain text: an added token of the tokenizer written in a document (`</s>`,
`<think>`, `<|endoftext|>` inside a Python string) encodes as its characters, never as that
token. Only a source's declared control markers (e.g. `<|im_start|>`) encode as their tokens.
`tokenizers` matches every added token in the text by default (and `encode_special_tokens`
only turns that off for the *special* ones), so we encode with a copy of the tokenizer whose
added-token list is empty, after splitting the text on the declared markers ourselves.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from datalines.errors import DataLineError
from datalines.files import sha256_bytes

EMBEDDED_EOS_TOKEN = "<|endoftext|>"
_ENCODE_BATCH_DOCUMENTS = 256


class PlainTextTokenizer:
    """Encodes documents as plain text plus declared control markers; see the module docstring."""

    def __init__(self, json_text: str, where: str) -> None:
        try:
            self.full = Tokenizer.from_str(json_text)
            config = json.loads(json_text)
            config["added_tokens"] = []
            self.plain = Tokenizer.from_str(json.dumps(config))
        except Exception as error:  # tokenizers raises a bare Exception on a malformed file
            raise DataLineError(f"{where}: not a valid tokenizers JSON ({error})") from None
        self.json_text = json_text
        self.sha256 = sha256_bytes(json_text.encode("utf-8"))
        self.vocab_size = self.full.get_vocab_size(with_added_tokens=True)
        self.where = where

    def marker_ids(self, markers: Sequence[str]) -> dict[str, int]:
        ids = {}
        for marker in markers:
            token_id = self.full.token_to_id(marker)
            if token_id is None:
                raise DataLineError(
                    f"{self.where}: control marker {marker!r} is not a token of the tokenizer"
                )
            ids[marker] = token_id
        return ids

    def encode_documents(self, texts: Sequence[str], markers: Sequence[str] = ()) -> list[np.ndarray]:
        """Token ids (int64) of each document; `markers` encode as their tokens, all else as text."""
        if not markers:
            return self._encode_plain(list(texts))
        marker_ids = self.marker_ids(markers)
        longest_first = sorted(markers, key=len, reverse=True)
        splitter = re.compile("(" + "|".join(re.escape(marker) for marker in longest_first) + ")")
        pieces_of_documents = [splitter.split(text) for text in texts]
        # Odd positions of re.split's result are the markers; even positions the text between them.
        plain_pieces = [piece for pieces in pieces_of_documents for piece in pieces[0::2]]
        encoded = iter(self._encode_plain(plain_pieces))
        documents = []
        for pieces in pieces_of_documents:
            parts: list[np.ndarray] = []
            for position, piece in enumerate(pieces):
                if position % 2:
                    parts.append(np.array([marker_ids[piece]], dtype=np.int64))
                else:
                    parts.append(next(encoded))
            documents.append(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64))
        return documents

    def _encode_plain(self, texts: list[str]) -> list[np.ndarray]:
        result: list[np.ndarray] = []
        for start in range(0, len(texts), _ENCODE_BATCH_DOCUMENTS):
            chunk = texts[start : start + _ENCODE_BATCH_DOCUMENTS]
            batch = self.plain.encode_batch(chunk, add_special_tokens=False)
            result.extend(np.asarray(encoding.ids, dtype=np.int64) for encoding in batch)
        return result

    def decode(self, ids: Sequence[int]) -> str:
        return self.full.decode(list(ids), skip_special_tokens=False)


def load_tokenizer(path: Path) -> PlainTextTokenizer:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise DataLineError(f"{path}: tokenizer cannot be read ({error})") from None
    except UnicodeDecodeError as error:
        raise DataLineError(f"{path}: tokenizer is not UTF-8 text ({error})") from None
    return PlainTextTokenizer(text, str(path))


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int, special_tokens: Sequence[str]) -> str:
    """Train a byte-level BPE on the texts; returns its JSON. The special tokens take ids 0, 1, ..."""
    if not 256 + len(special_tokens) < vocab_size <= 1 << 20:
        smallest = 256 + len(special_tokens)
        raise DataLineError(f"tokenizer vocab must be in ({smallest}, 2**20], got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer.to_str()
