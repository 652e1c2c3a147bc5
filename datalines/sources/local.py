"""A local source: a directory of parquet, jsonl or text files, each pinned by its sha256 at init."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from datalines.errors import DataLineError, InputChanged
from datalines.files import sha256_file
from datalines.sources.base import Source, SourceFile, matches, restore_fix, stratum_of
from datalines.sources.formats import FORMATS_TEXT, is_readable


class LocalSource(Source):
    def root(self) -> Path:
        return Path(self.spec.location).expanduser().resolve()

    def take_pins(self) -> dict[str, Any]:
        root = self.root()
        if not root.is_dir():
            raise DataLineError(f"{root}: source {self.spec.name} directory does not exist")
        files = []
        for path in sorted(root.rglob("*"), key=lambda item: item.relative_to(root).as_posix()):
            relative = path.relative_to(root).as_posix()
            if not path.is_file() or any(part.startswith(".") for part in path.relative_to(root).parts):
                continue
            if self.spec.include:
                wanted = matches(relative, self.spec.include)
            else:
                wanted = is_readable(path.name)
            if wanted:
                stratum = stratum_of(relative, self.spec.strata)
                stat = path.stat()  # before the hash: a write meanwhile moves the mtime past the one pinned
                files.append(SourceFile(relative, stratum, stat.st_size, sha256_file(path), stat.st_mtime_ns))
        if not files:
            wanted = f"matches {list(self.spec.include)}" if self.spec.include else "is readable"
            raise DataLineError(f"{root}: source {self.spec.name}: no file there {wanted}; {FORMATS_TEXT}")
        return {"root": str(root), "files": [file.to_json() for file in files]}

    def local_path(self, file: SourceFile) -> Path:
        return Path(self.pins["root"]) / file.path

    def fetch(self, file: SourceFile) -> Path:
        path = self.local_path(file)
        if not path.is_file():
            raise InputChanged(f"{path}: source {self.spec.name} file is gone since init", restore_fix(path, file))
        return path
