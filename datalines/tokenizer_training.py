"""`data tokenizer --train`: a byte-level BPE trained on local directories or the embedded corpus.

Held-out documents (1 % by text hash, as in every data line) are left out of the training
text, so a tokenizer trained here never saw a document a line will validate on.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

from datalines.corpus import file_documents
from datalines.errors import DataLineError
from datalines.files import write_bytes_atomic
from datalines.recipe import SourceSpec
from datalines.sources import Source, open_source
from datalines.tokenizer import PlainTextTokenizer, train_byte_level_bpe


def _training_texts(sources: list[Source]) -> Iterator[str]:
    for source in sources:
        for file in source.files:
            yield from file_documents(source, file, seed=0).training


def train_tokenizer_file(
    locations: Sequence[str], vocab_size: int, out: Path, text_field: str, special_tokens: Sequence[str]
) -> int:
    """Train on the sources (directories or `embedded`), write `out`; returns the vocab size."""
    sources = []
    for index, location in enumerate(locations):
        if location == "embedded":
            spec = SourceSpec(name=f"source{index}", kind="embedded")
        else:
            if not Path(location).is_dir():
                raise DataLineError(f"{location}: --source must be a directory or `embedded`")
            spec = SourceSpec(name=f"source{index}", kind="local", location=location, text_field=text_field)
        sources.append(open_source(spec, out.parent, None))
    tokenizer_json = train_byte_level_bpe(_training_texts(sources), vocab_size, special_tokens)
    write_bytes_atomic(out, tokenizer_json.encode("utf-8"))
    return PlainTextTokenizer(tokenizer_json, str(out)).vocab_size
