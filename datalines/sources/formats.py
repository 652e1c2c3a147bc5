"""Documents of a file by its format: parquet (a text column), jsonl (a text field), text (one document)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow
import pyarrow.parquet

from datalines.errors import DataLineError

READABLE_SUFFIXES = (".parquet", ".jsonl", ".txt", ".py", ".md")


def read_documents(path: Path, text_field: str, label: str) -> list[str]:
    """Every document of the file in file order; a damaged file raises `DataLineError` naming it."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _read_parquet(path, text_field, label)
    if suffix == ".jsonl":
        return _read_jsonl(path, text_field, label)
    return [path.read_bytes().decode("utf-8", errors="replace")]


def _read_parquet(path: Path, text_field: str, label: str) -> list[str]:
    try:
        parquet_file = pyarrow.parquet.ParquetFile(path)
        names = parquet_file.schema_arrow.names
        table = parquet_file.read(columns=[text_field]) if text_field in names else None
    except (pyarrow.ArrowException, OSError) as error:
        raise DataLineError(f"{path}: {label} is not a readable parquet file ({error})") from None
    if table is None:
        raise DataLineError(f"{path}: {label} has no column {text_field!r} (columns: {', '.join(names)})")
    column = table.column(text_field)
    if not (pyarrow.types.is_string(column.type) or pyarrow.types.is_large_string(column.type)):
        raise DataLineError(f"{path}: {label} column {text_field!r} is {column.type}, not text")
    return [text if text is not None else "" for text in column.to_pylist()]


def _read_jsonl(path: Path, text_field: str, label: str) -> list[str]:
    documents: list[str] = []
    with open(path, encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                text = record[text_field]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise DataLineError(
                    f"{path}: {label} line {number} is not a JSON object with a {text_field!r} field"
                ) from None
            if not isinstance(text, str):
                raise DataLineError(f"{path}: {label} line {number} field {text_field!r} is not text")
            documents.append(text)
    return documents
