"""`data val`: validation rows of every source from the held-out documents of every stratum.

A source's rows come from each stratum in proportion to the stratum's share of the source
(`validation_tokens` split by those shares), so the source's mean row loss weights its strata
by their shares. Held-out documents are read from each stratum's files in pinned order, joined
with EOS (strata interleaved like the training shards) and cut into rows of seq_len + 1 tokens.
Held-out documents never enter a training shard, so no validation token was trained on.

Each length is built on its own: a length that no source has a row of (a small corpus, a long
length) is reported with each source's shortfall in tokens and the other lengths are still built;
a source without a row at a length that others have is left out of that length and reported.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from datalines.calibration import stratum_shares
from datalines.corpus import file_documents
from datalines.dataline import DataLine
from datalines.errors import DataLineError
from datalines.files import write_json_atomic
from datalines.mixture import merge_strata
from datalines.shards import join_documents, write_array_atomic


def heldout_documents(line: DataLine, source_name: str, token_budget: int) -> list[np.ndarray]:
    """Token ids of held-out documents of every stratum, about `token_budget` tokens in all."""
    source = line.source(source_name)
    spec = line.recipe.source(source_name)
    calibration = line.calibration[source_name]
    strata_documents: list[list[np.ndarray]] = []
    for stratum, share in stratum_shares(source, calibration).items():
        budget = token_budget * share
        texts: list[str] = []
        estimated = 0.0
        for file in (file for file in source.files if file.stratum == stratum):
            if estimated >= budget:
                break
            for text in file_documents(source, file, line.recipe.seed).heldout:
                texts.append(text)
                text_bytes = len(text.encode("utf-8", "surrogatepass"))
                estimated += text_bytes * calibration[stratum]["tokens_per_text_byte"]
        strata_documents.append(line.tokenizer.encode_documents(texts, spec.control_markers))
    lengths = [np.array([len(ids) + 1 for ids in docs], dtype=np.int64) for docs in strata_documents]
    return [strata_documents[stratum][document] for stratum, document in merge_strata(lengths).tolist()]


def rows_of(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """Non-overlapping rows of seq_len + 1 tokens from a source's EOS-joined documents: (rows, seq_len + 1)."""
    count = len(tokens) // (seq_len + 1)
    return tokens[: count * (seq_len + 1)].reshape(count, seq_len + 1)


@dataclass
class LengthBuild:
    """What `data val` made of one row length."""

    seq_len: int
    """The rows' training length (a row holds seq_len + 1 tokens)."""
    rows: dict[str, int]
    """Source -> rows written (empty: the length was not built)."""
    short: dict[str, tuple[int, int]]
    """Source -> (its held-out tokens, tokens short of one row) for each source without a row."""
    budget: int
    """The recipe's `validation_tokens`: held-out tokens read per source, about."""

    @property
    def built(self) -> bool:
        return bool(self.rows)

    def describe(self) -> str:
        """One line: the rows written, or that the length was not built, and each source's shortfall."""
        lacking = "; ".join(
            f"{name} has no row: its held-out documents give {tokens:,} tokens, a row needs "
            f"{self.seq_len + 1:,} (short by {short:,})"
            for name, (tokens, short) in self.short.items()
        )
        if lacking and self.budget < self.seq_len + 1:
            lacking += f" (the recipe reads about {self.budget:,} held-out tokens a source: its validation_tokens)"
        if not self.built:
            return f"val T{self.seq_len}: not built, no source has a row; {lacking}"
        written = ", ".join(f"{name} {count} rows" for name, count in self.rows.items())
        return f"val T{self.seq_len}: {written}" + (f"; {lacking}" if lacking else "")


def build_validation(line: DataLine, seq_lens: list[int]) -> list[LengthBuild]:
    """Write `val/T<L>/` for each length that has a row of some source; a length none has is
    left as it was (it is reported, not raised: the other lengths are still built)."""
    for seq_len in seq_lens:
        if seq_len < 1:
            raise DataLineError(f"--seq-len must be >= 1, got {seq_len}")
    documents = {
        name: heldout_documents(line, name, line.recipe.validation_tokens)
        for name in line.sources
        if line.recipe.source(name).heldout_fraction > 0
    }
    tokens = {name: join_documents(docs, line.eos_id, np.dtype("<i4"))[0] for name, docs in documents.items()}
    return [_build_length(line, tokens, seq_len) for seq_len in seq_lens]


def _build_length(line: DataLine, tokens: dict[str, np.ndarray], seq_len: int) -> LengthBuild:
    directory = line.validation_dir(seq_len)
    partial = directory.with_name(f".tmp-{directory.name}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    index: dict[str, dict[str, object]] = {}
    short: dict[str, tuple[int, int]] = {}
    for name, source_tokens in tokens.items():
        rows = rows_of(source_tokens, seq_len)
        if len(rows) == 0:
            short[name] = (len(source_tokens), seq_len + 1 - len(source_tokens))
            continue
        entry = write_array_atomic(partial / f"{name}.i32", rows)
        index[name] = {"name": entry["name"], "sha256": entry["sha256"], "rows": int(len(rows))}
    if not index:
        shutil.rmtree(partial, ignore_errors=True)
        return LengthBuild(seq_len, {}, short, line.recipe.validation_tokens)
    write_json_atomic(partial / "index.json", {"seq_len": seq_len, "sources": index})
    _replace_directory(partial, directory)
    written = {name: int(entry["rows"]) for name, entry in index.items()}  # type: ignore[call-overload]
    return LengthBuild(seq_len, written, short, line.recipe.validation_tokens)


def _replace_directory(new: Path, old: Path) -> None:
    if old.exists():
        retired = old.with_name(f".old-{old.name}")
        shutil.rmtree(retired, ignore_errors=True)
        old.rename(retired)
        new.rename(old)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        new.rename(old)
