"""`data tokenizer --train`: a byte-level BPE trained on local directories, the embedded corpus or a
recipe's sources.

Held-out documents (by text hash, as in every data line) are left out of the training text, so a
tokenizer trained here never saw a document a line will validate on: 1 % of each `--source`
directory's, or each recipe source's own `heldout_fraction` with `--recipe` (which also reads
each source's `include` files and `text_field`, as `data init` will).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from datalines.corpus import file_documents
from datalines.errors import DataLineError
from datalines.files import write_bytes_atomic
from datalines.recipe import SourceSpec, check_recipe_keys, parse_recipe, read_recipe_file, with_paths_from
from datalines.sources import Source, open_source
from datalines.tokenizer import PlainTextTokenizer, train_byte_level_bpe


def _training_texts(sources: list[Source]) -> Iterator[str]:
    for source in sources:
        for file in source.files:
            yield from file_documents(source, file, seed=0).training


def train_tokenizer_file(
    locations: Sequence[str],
    vocab_size: int,
    out: Path,
    text_field: str,
    special_tokens: Sequence[str],
    overwrite: bool = False,
) -> int:
    """Train on the sources (directories or `embedded`), write `out` (an existing one only with
    `overwrite`); returns the vocab size."""
    specs = []
    for index, location in enumerate(locations):
        if location == "embedded":
            specs.append(SourceSpec(name=f"source{index}", kind="embedded"))
        else:
            if not Path(location).is_dir():
                raise DataLineError(f"{location}: --source must be a directory or `embedded`")
            specs.append(SourceSpec(name=f"source{index}", kind="local", location=location, text_field=text_field))
    return _train(specs, vocab_size, out, special_tokens, overwrite)


def train_tokenizer_from_recipe(
    recipe_file: Path, vocab_size: int, out: Path, special_tokens: Sequence[str], overwrite: bool = False
) -> tuple[int, list[str]]:
    """Train on a recipe's (local and embedded) sources, each read as `data init` reads it, without
    its held-out documents; the sources' control markers join the special tokens (`data init`
    needs them in the vocabulary). Returns the vocab size and the special tokens."""
    raw = read_recipe_file(recipe_file)
    recipe = with_paths_from(parse_recipe(raw, str(recipe_file)), recipe_file.parent)
    check_recipe_keys(raw, str(recipe_file))
    hub = [spec.name for spec in recipe.sources if spec.kind == "hub"]
    if hub:
        raise DataLineError(
            f"{recipe_file}: data tokenizer --recipe reads local and embedded sources, and "
            f"{', '.join(hub)} {'is a hub source' if len(hub) == 1 else 'are hub sources'}; "
            f"train on local copies with --source"
        )
    specials = list(dict.fromkeys([*special_tokens, *(m for spec in recipe.sources for m in spec.control_markers)]))
    return _train(list(recipe.sources), vocab_size, out, specials, overwrite), specials


def _train(
    specs: list[SourceSpec], vocab_size: int, out: Path, special_tokens: Sequence[str], overwrite: bool
) -> int:
    _check_special_tokens(special_tokens)
    _refuse_existing(out, overwrite)  # before the training, which takes long
    sources = [open_source(spec, out.parent, None) for spec in specs]
    tokenizer_json = train_byte_level_bpe(_training_texts(sources), vocab_size, special_tokens)
    _refuse_existing(out, overwrite)  # and after it: one made meanwhile (another training) stays too
    write_bytes_atomic(out, tokenizer_json.encode("utf-8"))
    return PlainTextTokenizer(tokenizer_json, str(out)).vocab_size


def _refuse_existing(out: Path, overwrite: bool) -> None:
    """DataLineError (one line) when `out` exists and may not be overwritten: a tokenizer is the pin of
    every data line made with it, and one written over by mistake is gone. Also when it cannot be
    written at all (a directory, or under a file), which the write would find only after the training."""
    if out.is_dir():
        raise DataLineError(f"{out}: is a directory; --out names the tokenizer JSON file to write")
    if not overwrite and os.path.lexists(out):
        raise DataLineError(f"{out}: already exists; give another --out, or --force to overwrite it")
    existing = next(path for path in out.parents if path.exists())
    if not existing.is_dir():
        raise DataLineError(f"{existing}: not a directory, so --out {out} cannot be written")


def _check_special_tokens(special_tokens: Sequence[str]) -> None:
    """The special tokens take ids 0, 1, ... in order: an empty one is no token and a repeated one
    takes a single id, so every token after it would get another id than the one asked for."""
    if "" in special_tokens:
        raise DataLineError("--special: a special token cannot be empty")
    repeated = sorted({token for token in special_tokens if list(special_tokens).count(token) > 1})
    if repeated:
        raise DataLineError(f"--special: {', '.join(map(repr, repeated))} given more than once (a token has one id)")
