"""Token ids to text as they are generated.

A byte-level BPE token may carry part of a character's UTF-8 bytes, so a token's text alone can
be half a character: the stream holds back a trailing incomplete character (decoded as U+FFFD)
until the token that completes it arrives. Only the last character can still change: bytes that
can never make one (a model may draw any byte) are U+FFFD for good once another follows, and
show then (held back whole, a run of them would keep everything after it from the screen).

Each token decodes a window of the last few tokens, not everything so far: decoding the whole
text at every token made a long generation quadratic (a sample of 60,000 tokens ran at a tenth of
its first tokens' speed).
"""

from __future__ import annotations

from datalines.tokenizer import PlainTextTokenizer

INCOMPLETE = "\ufffd"
"""What the decoder makes of a character whose bytes have not all arrived."""

CONTEXT_TOKENS = 4
"""Tokens already shown that a window keeps before the new ones: a decoder that treats a text's
first token differently (drops its leading space) then changes only text already shown."""


class TextStream:
    """The text of a growing list of token ids, a new piece at a time."""

    def __init__(self, tokenizer: PlainTextTokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.last = ""
        """The last character shown ('' before any)."""
        self._start = 0
        """Where the decoded window of `ids` begins."""
        self._shown = 0
        """Characters of the window's text shown already."""

    def push(self, token: int) -> str:
        """Add a token; the text it completes ('' while only a character's first bytes are in)."""
        self.ids.append(token)
        return self._show(complete=False)

    def flush(self) -> str:
        """The text still held back (an incomplete character at the very end shows as U+FFFD)."""
        return self._show(complete=True)

    def _show(self, complete: bool) -> str:
        decoded = self.tokenizer.decode(self.ids[self._start :])
        end = len(decoded) - 1 if not complete and decoded.endswith(INCOMPLETE) else len(decoded)
        piece = decoded[self._shown : end]
        self._shown = max(self._shown, end)  # never a character shown twice
        if piece:
            self.last = piece[-1]
        if end == len(decoded) and len(self.ids) - self._start > 2 * CONTEXT_TOKENS:
            # Everything shown: the window moves on to the last CONTEXT_TOKENS tokens.
            self._start = len(self.ids) - CONTEXT_TOKENS
            self._shown = len(self.tokenizer.decode(self.ids[self._start :]))
        return piece
