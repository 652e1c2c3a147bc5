"""`data val`: validation rows of every source from the held-out documents of every stratum.

A source's rows come from each stratum in proportion to the stratum's share of the source
(`validation_tokens` split by those shares), so the source's mean row loss weights its strata
by their shares. Held-out documents are read from each stratum's files in pinned order, joined
with EOS (strata interleaved like the training shards) and cut into rows of seq_len + 1 tokens.
Held-out documents never enter a training shard, so no validation token was trained on.
"""

from __future__ import annotations

import shutil
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


def rows_of(documents: list[np.ndarray], eos_id: int, seq_len: int) -> np.ndarray:
    """Non-overlapping rows of seq_len + 1 tokens from the EOS-joined documents: (rows, seq_len + 1) int32."""
    tokens, _ = join_documents(documents, eos_id, np.dtype("<i4"))
    count = len(tokens) // (seq_len + 1)
    return tokens[: count * (seq_len + 1)].reshape(count, seq_len + 1)


def build_validation(line: DataLine, seq_lens: list[int]) -> dict[int, dict[str, int]]:
    """Write `val/T<L>/` for each length; returns length -> source -> rows written."""
    documents = {
        name: heldout_documents(line, name, line.recipe.validation_tokens)
        for name in line.sources
        if line.recipe.source(name).heldout_fraction > 0
    }
    summary: dict[int, dict[str, int]] = {}
    for seq_len in seq_lens:
        if seq_len < 1:
            raise DataLineError(f"--seq-len must be >= 1, got {seq_len}")
        directory = line.validation_dir(seq_len)
        partial = directory.with_name(f".tmp-{directory.name}")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        index: dict[str, dict[str, object]] = {}
        for name, source_documents in documents.items():
            rows = rows_of(source_documents, line.eos_id, seq_len)
            if len(rows) == 0:
                continue
            entry = write_array_atomic(partial / f"{name}.i32", rows)
            index[name] = {"name": entry["name"], "sha256": entry["sha256"], "rows": int(len(rows))}
        if not index:
            shutil.rmtree(partial, ignore_errors=True)
            raise DataLineError(f"{line.path}: the held-out documents give no row of {seq_len + 1} tokens")
        write_json_atomic(partial / "index.json", {"seq_len": seq_len, "sources": index})
        _replace_directory(partial, directory)
        summary[seq_len] = {name: int(entry["rows"]) for name, entry in index.items()}  # type: ignore[call-overload]
    return summary


def _replace_directory(new: Path, old: Path) -> None:
    if old.exists():
        retired = old.with_name(f".old-{old.name}")
        shutil.rmtree(retired, ignore_errors=True)
        old.rename(retired)
        new.rename(old)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        new.rename(old)
