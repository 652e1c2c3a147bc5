"""Token ids to text as they are generated.

A byte-level BPE token may carry part of a character's UTF-8 bytes, so a token's text alone can
be half a character: the stream decodes everything so far and shows what is new, holding back a
trailing incomplete character (decoded as U+FFFD) until the token that completes it arrives.
"""

from __future__ import annotations

from datalines.tokenizer import PlainTextTokenizer

INCOMPLETE = "\ufffd"
"""What the decoder makes of a character whose bytes have not all arrived."""


class TextStream:
    """The text of a growing list of token ids, a new piece at a time."""

    def __init__(self, tokenizer: PlainTextTokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        """The text shown so far."""

    def push(self, token: int) -> str:
        """Add a token; the text it completes ('' while a character is incomplete)."""
        self.ids.append(token)
        decoded = self.tokenizer.decode(self.ids)
        if decoded.endswith(INCOMPLETE):
            return ""
        return self._show(decoded)

    def flush(self) -> str:
        """The text still held back (an incomplete character at the very end shows as U+FFFD)."""
        return self._show(self.tokenizer.decode(self.ids))

    def _show(self, decoded: str) -> str:
        piece = decoded[len(self.text) :]
        self.text = decoded
        return piece
