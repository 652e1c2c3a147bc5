"""Calibration: measured tokens per byte of every stratum, and the strata's shares of a source.

Budgets are planned in bytes of document text (known before tokenizing) and converted with each
stratum's measured rates: `text_bytes_per_file_byte` (parquet compresses; text files are 1) and
`tokens_per_text_byte` (code and prose differ). They are measured once, at init, on the first
files of each stratum, and pinned in dataline.json so every plan uses the same numbers.
"""

from __future__ import annotations

from typing import Any

from datalines.corpus import file_documents, text_bytes
from datalines.errors import DataLineError
from datalines.sources import Source
from datalines.tokenizer import PlainTextTokenizer

CALIBRATION_FILE_BYTES = 4 << 20
"""Files of a stratum read for calibration: the first ones in pinned order up to this many bytes."""
CALIBRATION_TEXT_BYTES = 256 << 10
"""Text tokenized for calibration per stratum (its first training documents in shuffled order)."""


def calibrate_source(source: Source, tokenizer: PlainTextTokenizer, seed: int) -> dict[str, dict[str, float]]:
    """Stratum -> {tokens_per_text_byte, text_bytes_per_file_byte} measured on its first files.

    A source whose measured files hold no text at all is refused: every stratum's share of it
    would be 0, so no cycle could ever take one of its documents, and the first cycle would stop
    the preparer weeks after init (a wrong `text_field`'s column of empty strings, empty files).
    So is a stratum whose measured files hold none: its share would be 0, and its documents (its
    later files' too) would be left out of every cycle without a word.
    """
    result: dict[str, dict[str, float]] = {}
    documents_read = files_read = 0
    empty: list[str] = []
    for stratum in source.strata():
        file_bytes = 0
        document_bytes = 0
        sample: list[str] = []
        sample_bytes = 0
        for file in (file for file in source.files if file.stratum == stratum):
            if file_bytes >= CALIBRATION_FILE_BYTES:
                break
            documents = file_documents(source, file, seed)
            texts = documents.training + documents.heldout
            documents_read += len(texts)
            files_read += 1
            file_bytes += file.size
            document_bytes += int(text_bytes(texts).sum())
            for text in texts:
                if sample_bytes >= CALIBRATION_TEXT_BYTES:
                    break
                sample.append(text)
                sample_bytes += len(text.encode("utf-8", "surrogatepass"))
        tokens = sum(len(ids) for ids in tokenizer.encode_documents(sample, source.spec.control_markers))
        result[stratum] = {
            "tokens_per_text_byte": tokens / sample_bytes if sample_bytes else 1.0,
            "text_bytes_per_file_byte": document_bytes / file_bytes if file_bytes else 0.0,
        }
        if not document_bytes:
            empty.append(stratum)
    if empty and len(empty) < len(result):
        raise DataLineError(
            f"source {source.spec.name}: stratum {empty[0]}'s first files hold no text, so it would get no "
            f"share and its documents would be left out of every cycle; leave it out with the source's "
            f"`include` patterns, or fix its files"
        )
    if not any(rates["text_bytes_per_file_byte"] for rates in result.values()):
        files = "its files" if files_read == len(source.files) else f"the first {files_read} of its files"
        raise DataLineError(
            f"source {source.spec.name}: {files} hold no text ({documents_read} documents, all empty; "
            f"text_field {source.spec.text_field!r}), so no cycle could take a document of it"
        )
    return result


def stratum_tokens(source: Source, calibration: dict[str, Any]) -> dict[str, float]:
    """Each stratum's estimated tokens of text: its files' bytes at its calibrated rates."""
    estimated: dict[str, float] = {}
    for file in source.files:
        rates = calibration[file.stratum]
        tokens = file.size * rates["text_bytes_per_file_byte"] * rates["tokens_per_text_byte"]
        estimated[file.stratum] = estimated.get(file.stratum, 0.0) + tokens
    return estimated


def stratum_shares(source: Source, calibration: dict[str, Any]) -> dict[str, float]:
    """Each stratum's share of the source's tokens: file bytes x its calibrated rates, normalised."""
    estimated = stratum_tokens(source, calibration)
    total = sum(estimated.values())
    return {stratum: tokens / total for stratum, tokens in sorted(estimated.items()) if tokens > 0}
