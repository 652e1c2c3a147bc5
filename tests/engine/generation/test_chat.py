"""A conversation's turns share one decoding state; text streams whole characters; prompts start documents."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from helpers.lines import SENTENCE

from datalines.tokenizer import EMBEDDED_EOS_TOKEN, PlainTextTokenizer, train_byte_level_bpe
from engine.errors import LineError
from engine.generation.chat import Conversation
from engine.generation.loading import GenerationModel, document_separator
from engine.generation.settings import SamplingSettings
from engine.generation.text import TextStream
from engine.models.build import build_model

pytestmark = pytest.mark.usefixtures("one_thread")

TOKENIZER_JSON = train_byte_level_bpe([SENTENCE] * 20, 300, [EMBEDDED_EOS_TOKEN])
"""A byte-level BPE of ASCII text: id 0 is the separator, and a non-ASCII character takes a token a byte."""


def _loaded(preset: str, tokenizer_json: str = TOKENIZER_JSON) -> GenerationModel:
    torch.manual_seed(0)
    model = build_model(preset, {"vocab_size": 300}).double().eval()
    tokenizer = PlainTextTokenizer(tokenizer_json, "tokenizer.json")
    separator = document_separator(model, tokenizer)
    return GenerationModel(model, tokenizer, Path("u00000006"), preset, torch.device("cpu"), separator)


@pytest.mark.parametrize("preset", ["pssa-tiny", "transformer-tiny"])
def test_a_conversation_carries_its_state_from_turn_to_turn(preset: str) -> None:
    loaded = _loaded(preset)
    conversation = Conversation(loaded, SamplingSettings(temperature=1.0, top_p=1.0, seed=1), reply_tokens=12)
    first = "".join(conversation.reply("the model trains"))
    turn_two_starts = len(conversation.session.tokens)
    second = "".join(conversation.reply("spikes flow"))
    assert first and second and "\n" not in first.strip() and "\n" not in second.strip()
    session = conversation.session
    session.feed([])  # the last reply token too
    everything = torch.tensor([session.fed])
    model = loaded.model
    with torch.no_grad():
        one_decode, _ = model.decode(everything, model.decode_state(1, torch.device("cpu")))
        full = model.logits(everything)
        second_alone, _ = model.decode(everything[:, turn_two_starts:], model.decode_state(1, torch.device("cpu")))
    assert session.next_logits is not None
    assert (session.next_logits - one_decode[0, -1]).abs().max().item() <= 1e-9
    assert (session.next_logits - full[0, -1]).abs().max().item() <= 1e-9
    assert not torch.allclose(session.next_logits, second_alone[0, -1])  # the first turn is in the state
    # The first turn starts a document: the separator, then the user's line as training encodes text.
    first_line = loaded.tokenizer.encode_documents(["the model trains\n"])[0].tolist()
    assert session.fed[: 1 + len(first_line)] == [loaded.separator, *first_line]


def test_a_reply_ends_with_its_line_break_without_the_next_lines_indentation() -> None:
    # It ended "there:\n   " when one token held the line break and the next line's indentation.
    code = ["def f(x):\n    return x\n    pass\n"] * 50
    loaded = _loaded("transformer-tiny", train_byte_level_bpe(code, 300, [EMBEDDED_EOS_TOKEN]))
    ids = loaded.tokenizer.encode_documents(["there:\n    return x"])[0].tolist()
    assert "\n   " in [loaded.tokenizer.decode([token]) for token in ids]  # one token: the break and spaces
    conversation = Conversation(loaded, SamplingSettings(temperature=0.0, seed=1), reply_tokens=len(ids))

    def generate(count: int, stop: int | None = None):  # what the model writes next, fixed
        for token in ids[:count]:
            conversation.session.feed([])  # as the session's own: the token drawn waits to be fed
            conversation.session.pending.append(token)
            yield token

    conversation.session.generate = generate
    assert "".join(conversation.reply("hello")) == "there:\n"
    assert not conversation._at_line_start  # the state saw the indentation: the next turn starts a line


def test_a_character_split_across_tokens_shows_once_it_is_complete() -> None:
    tokenizer = PlainTextTokenizer(TOKENIZER_JSON, "tokenizer.json")
    ids = tokenizer.encode_documents(["é!"])[0].tolist()
    assert len(ids) == 3  # two bytes of é, then !
    stream = TextStream(tokenizer)
    assert [stream.push(token) for token in ids] == ["", "é", "!"]
    assert stream.flush() == "" and stream.last == "!"


def test_a_stream_shows_the_text_of_its_tokens_whatever_bytes_they_carry() -> None:
    # The stream decodes a window of the last tokens (the whole text each token was quadratic):
    # its pieces still make the text of every token, across characters split over tokens, bytes
    # that make no character, and windows that start inside a character.
    tokenizer = PlainTextTokenizer(TOKENIZER_JSON, "tokenizer.json")
    words = tokenizer.encode_documents(["h\u00e9 w\u00f6rld \u2713 \u65e5\u672c the model \U0001f642"])[0].tolist()
    generator = random.Random(0)
    for trial in range(200):
        pool = words if trial % 2 else list(range(1, tokenizer.vocab_size))
        ids = [generator.choice(pool) for _ in range(generator.randint(0, 60))]
        stream = TextStream(tokenizer)
        assert "".join(stream.push(token) for token in ids) + stream.flush() == tokenizer.decode(ids), ids


def test_a_prompt_follows_the_separator_and_without_one_a_prompt_is_needed() -> None:
    loaded = _loaded("pssa-tiny")
    assert loaded.prompt_ids("") == [0]
    assert loaded.prompt_ids("the") == [0, *loaded.tokenizer.encode_documents(["the"])[0].tolist()]
    without = _loaded("pssa-tiny", train_byte_level_bpe([SENTENCE] * 20, 300, ["<pad>"]))
    assert without.separator is None
    assert without.prompt_ids("the") == without.tokenizer.encode_documents(["the"])[0].tolist()
    with pytest.raises(LineError, match="tokenizer.json: names no document separator"):
        without.prompt_ids("")
