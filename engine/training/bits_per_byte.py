"""Bits per byte of the held-out rows: the validation loss in a unit no tokenizer changes.

A loss per token depends on how much text a token holds, so lines with different tokenizers (or
vocabularies) cannot compare it; a loss per byte of text they can (OLMo-core's advice for small
models, where the tokenizer's share of the loss is largest). Each validation adds:

    val_<L>/bpb/<source>   the source's target losses (nats) summed, over ln 2 times the UTF-8
                           bytes those targets decode to
    val_<L>/bpb/mix        the same for the token stream the recipe draws: each source's nats
                           and bytes per target weighted by its share, then divided

A token's bytes come from a table built once from the data line's tokenizer: a byte-level BPE
token is one byte per character of its name (the tokenizer's byte alphabet), a byte-fallback
token (`<0x0A>`) one byte, any other token the UTF-8 of its text (SentencePiece's `▁` a space),
and an added token (the document separator, control markers) none: it stands for no text, but
its loss still counts, as predicting where a document ends is part of modelling the text.
"""

from __future__ import annotations

import json
import math
import re

import torch
from tokenizers import pre_tokenizers

from datalines.tokenizer import PlainTextTokenizer
from engine.training.validation_losses import recipe_mix

BPB_GROUP = "bpb"
"""The metrics' name segment: `val_<L>/bpb/<source>`, `val_<L>/bpb/mix`."""
_BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_SENTENCEPIECE_SPACE = "\u2581"


def _decodes_byte_level(tokenizer: PlainTextTokenizer) -> bool:
    """Whether the tokenizer's decoder maps each character of a token's name to one byte."""
    decoder = json.loads(tokenizer.json_text).get("decoder") or {}
    decoders = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    return any(part.get("type") == "ByteLevel" for part in decoders)


def token_byte_lengths(tokenizer: PlainTextTokenizer) -> torch.Tensor:
    """(vocab,) int64: the UTF-8 bytes each token id decodes to (see the module docstring)."""
    byte_level = _decodes_byte_level(tokenizer)
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    added = set(tokenizer.full.get_added_tokens_decoder())
    lengths = torch.zeros(tokenizer.vocab_size, dtype=torch.int64)
    for token_id in range(tokenizer.vocab_size):
        name = tokenizer.full.id_to_token(token_id)
        if name is None or token_id in added:
            continue
        if byte_level and set(name) <= alphabet:
            lengths[token_id] = len(name)
        elif _BYTE_FALLBACK.fullmatch(name):
            lengths[token_id] = 1
        else:
            lengths[token_id] = len(name.replace(_SENTENCEPIECE_SPACE, " ").encode("utf-8"))
    return lengths


def bits_per_byte_metrics(
    prefix: str,
    windows: dict[str, torch.Tensor],
    losses: dict[str, torch.Tensor],
    weights: dict[str, float],
    byte_lengths: torch.Tensor,
) -> dict[str, float]:
    """`<prefix>/bpb/<source>` and `<prefix>/bpb/mix` from each source's (R, T + 1) windows and
    (R, T) float64 target losses; `byte_lengths` is `token_byte_lengths`' table."""
    nats_per_target: dict[str, float] = {}
    bytes_per_target: dict[str, float] = {}
    metrics: dict[str, float] = {}
    for source, source_windows in windows.items():
        targets = source_windows[:, 1:]
        if not targets.numel():
            continue
        nats = float(losses[source].sum())
        text_bytes = int(byte_lengths[targets].sum())
        if text_bytes == 0:
            continue  # targets that are all separators: no text to measure against
        metrics[f"{prefix}/{BPB_GROUP}/{source}"] = nats / (math.log(2) * text_bytes)
        nats_per_target[source] = nats / targets.numel()
        bytes_per_target[source] = text_bytes / targets.numel()
    mixed_nats, mixed_bytes = recipe_mix(nats_per_target, weights), recipe_mix(bytes_per_target, weights)
    if mixed_nats is not None and mixed_bytes is not None:
        metrics[f"{prefix}/{BPB_GROUP}/mix"] = mixed_nats / (math.log(2) * mixed_bytes)
    return metrics
