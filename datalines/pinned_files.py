"""Pinned source files that changed since init, as `nsconsole check` finds them: a stat per file.

A local (or embedded) source reads its files in place; init pins each by its size and sha256, and
a local file by its modification time too. A file edited, replaced or deleted since stops the
preparer at the first cycle that reads it (`InputChanged`, a failure that does not pass), so the
check says so first, naming the file and what changed. Hashing every file would take as long as
init did: a file is hashed only when its modification time moved (a line made before those were
pinned: its size alone is looked at).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from datalines.dataline import DataLine
from datalines.files import sha256_file
from datalines.planning import files_to_read
from datalines.preparer import files_still_read, shards_there
from datalines.sources.base import SourceFile, restore_fix


@dataclass(frozen=True)
class ChangedFile:
    """A pinned file whose bytes are not the pinned ones any more."""

    source: str
    index: int
    """The file's place in its source's pinned files."""
    file: SourceFile
    path: Path
    change: str
    """What changed, for people (`is gone`, `is 1,234 bytes, pinned 1,200`, ...)."""


@dataclass(frozen=True)
class PinFinding:
    """One changed file and what it does to the line: `fails` when the cycle the training line
    reads next needs it (the line would wait for that cycle for good), else a warning."""

    fails: bool
    message: str


def files_read_in_place(line: DataLine) -> int:
    """How many pinned files the line's sources read in place (those `changed_files` looks at)."""
    return sum(1 for name in line.sources for file in line.source(name).files
               if line.source(name).local_path(file) is not None)  # fmt: skip


def changed_files(line: DataLine) -> list[ChangedFile]:
    """Every pinned file of a source read in place that is gone or differs from its pin."""
    changed = []
    for name in line.sources:
        source = line.source(name)
        for index, file in enumerate(source.files):
            path = source.local_path(file)
            change = None if path is None else file_change(path, file)
            if path is not None and change is not None:
                changed.append(ChangedFile(name, index, file, path, change))
    return changed


def file_change(path: Path, file: SourceFile) -> str | None:
    """What changed in the file at `path` since it was pinned as `file`; None when nothing did."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return "it is gone"
    except OSError as error:
        return f"it cannot be read ({error.strerror or error})"
    if stat.st_size != file.size:
        return f"it is {stat.st_size:,} bytes now, pinned {file.size:,}"
    if file.mtime_ns is None or stat.st_mtime_ns == file.mtime_ns:
        return None
    sha256 = sha256_file(path)
    if sha256 == file.sha256:
        return None  # touched, or copied back: the same bytes
    modified = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(stat.st_mtime))
    return f"its bytes changed (modified {modified}; sha256 {sha256[:12]}..., pinned {file.sha256[:12]}...)"


def pinned_file_findings(line: DataLine, next_cycle: int) -> list[PinFinding]:
    """One finding per changed pinned file (`changed_files`): a failure when `next_cycle`, the
    cycle the training line reads next, is not prepared and reads it; a warning otherwise, saying
    whether a cycle still to be prepared reads it (the preparer will stop there) or none does (only
    rebuilding an earlier cycle would fail)."""
    changed = changed_files(line)
    if not changed:
        return []
    now = _files_needed_now(line, next_cycle)
    later = files_still_read(line)
    findings = []
    for item in changed:
        what = f"{item.path}: source {item.source} file {item.file.path} changed since init: {item.change}"
        if item.index in now.get(item.source, ()):
            effect = (f"cycle {next_cycle}, the one the line trains next, reads it: the preparer stops there and "
                      "the line would wait for data that does not come")  # fmt: skip
        elif item.index in later[item.source]:
            effect = ("a cycle still to be prepared reads it: the preparer will stop there, once the line has "
                      "trained the cycles before it")  # fmt: skip
        else:
            effect = ("no cycle still to be prepared reads it, but rebuilding one that did (`data rebuild`, a "
                      "cycle a rollback reopened) would fail")  # fmt: skip
        findings.append(PinFinding(item.index in now.get(item.source, ()),
                                   f"{what}; {effect}; {restore_fix(item.path, item.file)}"))  # fmt: skip
    return findings


def _files_needed_now(line: DataLine, index: int) -> dict[str, set[int]]:
    """The files preparing cycle `index` reads, when it is still to be prepared (its shards are
    not all there); none when it is prepared, consumed or past the line's last cycle."""
    last = line.last_cycle()
    if (last is not None and index > last) or line.is_consumed(index) or shards_there(line, index):
        return {}
    return files_to_read(line, index)
