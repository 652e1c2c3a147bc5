"""What every source provides: its pinned files, each in a stratum, and the documents of a file."""

from __future__ import annotations

import fnmatch
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from datalines.errors import DataLineError, InputChanged
from datalines.files import sha256_file
from datalines.recipe import SourceSpec
from datalines.sources.formats import FileTexts, read_documents


@dataclass(frozen=True)
class SourceFile:
    """One input file of a source, pinned at init."""

    path: str
    """The file's path relative to the source root (POSIX separators)."""
    stratum: str
    """The stratum the file's documents belong to."""
    size: int
    """The file's size in bytes."""
    sha256: str
    """The file's sha256; a file whose bytes differ is refused."""
    mtime_ns: int | None = None
    """The file's modification time at init, for a local file (None: a download, or a line made by
    an nsconsole that did not record it): `nsconsole check` looks at the size and this, a stat,
    and hashes a file only when they moved (`datalines.pinned_files`)."""

    def to_json(self) -> dict[str, Any]:
        pin: dict[str, Any] = {"path": self.path, "stratum": self.stratum, "size": self.size, "sha256": self.sha256}
        if self.mtime_ns is not None:
            pin["mtime_ns"] = self.mtime_ns
        return pin

    @staticmethod
    def from_json(data: dict[str, Any]) -> SourceFile:
        mtime_ns = data.get("mtime_ns")
        return SourceFile(str(data["path"]), str(data["stratum"]), int(data["size"]), str(data["sha256"]),
                          int(mtime_ns) if mtime_ns is not None else None)  # fmt: skip


def stratum_of(relative_path: str, mode: str) -> str:
    """`subdirs`: the top-level directory (`.` for files at the root); `files`: the file itself."""
    if mode == "files":
        return relative_path
    head, _, rest = relative_path.partition("/")
    return head if rest else "."


def matches(relative_path: str, patterns: tuple[str, ...]) -> bool:
    """Glob match where `**/` also matches no directory at all (`**/*.parquet` matches `a.parquet`)."""
    for pattern in patterns:
        if fnmatch.fnmatchcase(relative_path, pattern):
            return True
        if pattern.startswith("**/") and fnmatch.fnmatchcase(relative_path, pattern[3:]):
            return True
    return False


class Source(ABC):
    """A source's files (pinned at init) and a way to get each one onto the local disk."""

    def __init__(self, spec: SourceSpec, work: Path, pins: dict[str, Any] | None) -> None:
        self.spec = spec
        self.work = work
        if pins is None:
            self.pins = self.take_pins()
        else:
            self.pins = pins
        self.files = [SourceFile.from_json(item) for item in self.pins["files"]]
        if not self.files:
            wanted = list(spec.include) or "any readable file"
            raise DataLineError(f"source {spec.name}: no files match {wanted}")

    @abstractmethod
    def take_pins(self) -> dict[str, Any]:
        """List the files now and pin them (`{"files": [...], ...}`); called once, at init."""

    @abstractmethod
    def fetch(self, file: SourceFile) -> Path:
        """A local path holding the file's pinned bytes (downloaded if need be)."""

    def release(self, file: SourceFile) -> None:
        """The file is no longer needed by future cycles (a download may be deleted); local files stay."""
        return None

    def local_path(self, file: SourceFile) -> Path | None:
        """Where the file is read in place (a local or embedded source), whatever is there now;
        None for a source that downloads its files (their pins are checked as they arrive)."""
        return None

    def needs_download(self, file: SourceFile) -> bool:
        """Whether `fetch` would download the file, taking its size on disk (the preparer waits for
        room for it first); a source read in place never does."""
        return False

    def strata(self) -> list[str]:
        return sorted({file.stratum for file in self.files})

    def documents(self, file: SourceFile) -> list[str]:
        """The file's documents in file order, after checking its bytes against the pin."""
        return self.read(file).texts

    def read(self, file: SourceFile) -> FileTexts:
        """The file's documents in file order and their bytes that were not UTF-8, after checking
        its bytes against the pin."""
        path = self.fetch(file)
        self.verify(file, path)
        return read_documents(path, self.spec.text_field, label=f"source {self.spec.name}: {file.path}")

    def verify(self, file: SourceFile, path: Path) -> None:
        size = path.stat().st_size
        sha256 = sha256_file(path) if size == file.size else None
        if sha256 != file.sha256:
            # Both hashes: a file of the pinned size whose bytes differ shows it here, not only in its size.
            now = f"sha256 {sha256[:12]}..., " if sha256 is not None else ""
            raise InputChanged(
                f"{path}: source {self.spec.name} file {file.path} changed since init "
                f"(pinned sha256 {file.sha256[:12]}..., {file.size} bytes; now {now}{size} bytes)",
                restore_fix(path, file),
            )


def restore_fix(path: Path, file: SourceFile) -> str:
    """How to recover from a pinned file that changed or went away (a clause of a one-line error)."""
    return (
        f"restore {path} as `data init` pinned it ({file.size:,} bytes, sha256 {file.sha256[:12]}...): the data "
        f"line's cycles are made and rebuilt from exactly those bytes (new data goes into a new data line)"
    )
