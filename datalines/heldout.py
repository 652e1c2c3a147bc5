"""Held-out documents: chosen by a hash of the text alone, so the choice is the same in every line.

A document is held out of a source when the first 8 bytes of the blake2b hash of its UTF-8 text,
read as a fraction of 2**64, fall below the source's held-out fraction. No line seed or source
name enters the hash: the same text is held out (or trained) the same way wherever it appears
with the same fraction.
"""

from __future__ import annotations

import hashlib

DEFAULT_HELDOUT_FRACTION = 0.01
_HASH_RANGE = 1 << 64


def document_hash(text: str) -> int:
    """A 64-bit hash of the document's text (surrogates kept so no text is rejected)."""
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def is_held_out(text: str, fraction: float) -> bool:
    return document_hash(text) < fraction * _HASH_RANGE
