"""A conversation with a pre-trained model: the user's turns and the model's replies, one state.

The model was trained on plain documents, not dialogues, so a turn is plain text: the user's line
and a line break are fed after everything said so far (the first turn after the document
separator, as a document's start), and the reply is what the model writes next, up to the end of
its first non-empty line, the document separator, or `reply_tokens` tokens. The decoding state
runs on across turns (the recurrent state for NS and PSSA, the KV cache for the transformer), so
each turn costs only its own tokens.
"""

from __future__ import annotations

from collections.abc import Iterator

from engine.generation.loading import GenerationModel
from engine.generation.settings import SamplingSettings
from engine.generation.text import TextStream


class Conversation:
    """Turns with one model (see the module docstring)."""

    def __init__(self, loaded: GenerationModel, settings: SamplingSettings, reply_tokens: int) -> None:
        self.loaded = loaded
        self.reply_tokens = reply_tokens
        self.session = loaded.session(settings)
        self._at_line_start = True

    def reply(self, user_text: str) -> Iterator[str]:
        """Feed the user's turn; yield the reply's text as it is generated."""
        tokenizer = self.loaded.tokenizer
        turn = ("" if self._at_line_start else "\n") + user_text + "\n"
        if self.session.fed:
            self.session.feed(tokenizer.encode_documents([turn])[0].tolist())
        else:
            self.session.feed(self.loaded.prompt_ids(turn))
        stream = TextStream(tokenizer)
        separator = self.loaded.separator
        said = False  # whether the reply has shown more than white space: a line break after that ends it
        try:
            for token in self.session.generate(self.reply_tokens, stop=separator):
                if token == separator:
                    break  # the model ended the document: the next turn starts the next one
                piece = stream.push(token)
                shown = piece if said else piece.lstrip()
                if "\n" in shown:
                    # The reply ends with its line. A token may carry the next line's start too (a
                    # line break and the indentation after it): that is not shown.
                    yield piece[: len(piece) - len(shown) + shown.index("\n") + 1]
                    return
                if piece:
                    yield piece
                said = said or bool(piece.strip())
            rest = stream.flush()
            if rest:
                yield rest
        finally:
            # Also when the reply is cut short (Ctrl-C closes this generator): the next turn
            # starts on a line of its own after whatever the state has seen.
            stream.flush()
            self._at_line_start = stream.last == "\n" or self.session.tokens[-1] == separator
