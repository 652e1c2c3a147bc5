"""Documents of a file by its format: parquet (a text column), jsonl (a text field), text (one document).

jsonl and text files may be compressed: `.gz`, `.bz2` or `.zst` after the format's suffix
(`part-0.jsonl.gz`, `book.txt.zst`). A file read as text that holds a NUL byte is not text (a
compressed or binary file under another name) and is refused: tokenized, its bytes would train.
Bytes that are not UTF-8 are replaced by U+FFFD, as they always were (the text, hence every
shard, stays byte for byte what it was), and counted per document (`FileTexts.invalid_utf8`):
the preparer says how many, per file, in its log and in each cycle's manifest.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import IO

import pyarrow
import pyarrow.parquet

from datalines.errors import DataLineError

READABLE_SUFFIXES = (".parquet", ".jsonl", ".txt", ".py", ".md")
COMPRESSIONS = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd"}
"""A compressed file's last suffix -> its codec (pyarrow's); the suffix before it is the format's."""
FORMATS_TEXT = "a local source reads .parquet, .jsonl and text files (.jsonl and text also as .gz, .bz2 or .zst)"


_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")
"""What `surrogateescape` makes of each byte that is not UTF-8 (a UTF-8 decoder never yields these
lone surrogates from valid input, nor from the encoded surrogates it refuses: those are escaped too)."""


@dataclass(frozen=True)
class FileTexts:
    """A file's documents in file order, and the bytes of each that were not UTF-8."""

    texts: list[str]
    invalid_utf8: dict[int, int] = field(default_factory=dict)
    """Document index -> how many of its bytes were not UTF-8 (each run replaced by one U+FFFD);
    only documents that had any."""


def _decode_counting(data: bytes) -> tuple[str, int]:
    """`data` decoded as UTF-8 with U+FFFD for what is not, exactly as `errors="replace"`, and how
    many bytes were not UTF-8 (counted on a lossless decode, only when there are any)."""
    try:
        return data.decode("utf-8"), 0
    except UnicodeDecodeError:
        escaped = data.decode("utf-8", errors="surrogateescape")
        return data.decode("utf-8", errors="replace"), len(_ESCAPED_BYTE.findall(escaped))


def file_format(name: str) -> tuple[str, str | None]:
    """The format suffix of a file name (lower case) and its compression codec, if any."""
    path = PurePosixPath(name)
    codec = COMPRESSIONS.get(path.suffix.lower())
    if codec is None:
        return path.suffix.lower(), None
    return PurePosixPath(path.stem).suffix.lower(), codec


def is_readable(name: str) -> bool:
    """A file a source reads when its recipe names no `include` patterns."""
    suffix, codec = file_format(name)
    return suffix in READABLE_SUFFIXES and not (codec and suffix == ".parquet")


def read_documents(path: Path, text_field: str, label: str) -> FileTexts:
    """Every document of the file in file order; a damaged file raises `DataLineError` naming it."""
    suffix, codec = file_format(path.name)
    if suffix == ".parquet":
        if codec is not None:
            raise DataLineError(f"{path}: {label} is a compressed parquet file; parquet compresses "
                                f"its own columns: decompress it")  # fmt: skip
        return FileTexts(_read_parquet(path, text_field, label))  # Arrow's strings are UTF-8 already
    try:
        with _opened(path, codec) as handle:
            if suffix == ".jsonl":
                return _read_jsonl(handle, path, text_field, label)
            data = handle.read()
    except (pyarrow.ArrowException, OSError) as error:
        how = f" as {codec}" if codec else ""
        raise DataLineError(f"{path}: {label} cannot be read{how} ({error})") from None
    if b"\0" in data:
        raise DataLineError(
            f"{path}: {label} is not text (it holds NUL bytes: a binary or compressed file?); {FORMATS_TEXT}"
        )
    text, invalid = _decode_counting(data)
    return FileTexts([text], {0: invalid} if invalid else {})


@contextmanager
def _opened(path: Path, codec: str | None) -> Iterator[IO[bytes]]:
    if codec is None:
        with open(path, "rb") as handle:
            yield handle
    else:
        with pyarrow.input_stream(str(path), compression=codec) as stream:
            yield stream  # type: ignore[misc]


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


def _read_jsonl(binary: IO[bytes], path: Path, text_field: str, label: str) -> FileTexts:
    documents: list[str] = []
    invalid_utf8: dict[int, int] = {}
    # utf-8-sig: a byte-order mark (Windows tools write one) is no part of the first line's JSON.
    # surrogateescape keeps each byte that is not UTF-8, to count it on its line; the line is then
    # decoded again with U+FFFD for them, as `errors="replace"` decoded the whole file (a newline
    # byte is never inside a UTF-8 sequence, so a line's replacements are the file's).
    handle = io.TextIOWrapper(binary, encoding="utf-8-sig", errors="surrogateescape")
    for number, line in enumerate(handle, start=1):
        if not line.strip():
            continue
        invalid = len(_ESCAPED_BYTE.findall(line))
        if invalid:
            line = line.encode("utf-8", errors="surrogateescape").decode("utf-8", errors="replace")
        try:
            record = json.loads(line)
            text = record[text_field]
        except json.JSONDecodeError as error:
            detail = error.msg.removesuffix(" at")
            raise DataLineError(f"{path}: {label} line {number} is not JSON ({detail}, column {error.colno})") from None
        except (KeyError, TypeError):
            fields = f" (its fields: {', '.join(map(str, record))})" if isinstance(record, dict) else ""
            raise DataLineError(
                f"{path}: {label} line {number} is not a JSON object with a {text_field!r} field{fields}; "
                f"the source's `text_field` names the field"
            ) from None
        if not isinstance(text, str):
            raise DataLineError(f"{path}: {label} line {number} field {text_field!r} is not text")
        if invalid:
            invalid_utf8[len(documents)] = invalid
        documents.append(text)
    handle.detach()  # the caller closes the file
    return FileTexts(documents, invalid_utf8)
