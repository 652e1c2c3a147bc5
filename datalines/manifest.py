"""The permanent manifest of a cycle: its plan, shard hashes, token counts and sample-order digests.

`cycles/cNNNN/manifest.json` is written last, after every shard is on disk, and never removed:
its presence marks the cycle complete, and after the shards are deleted (consumed) it still says
exactly what the cycle held, so `data rebuild` can redo it and check every byte.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from datalines.errors import DataLineError, ManifestDamaged
from datalines.files import read_json, sha256_bytes, sha256_file

MANIFEST_NAME = "manifest.json"
CONSUMED_MARK = "consumed"
"""The file a trainer writes into a cycle directory when it is done with the cycle (datalines.consumption)."""
MANIFEST_FORMAT = 1
DIGEST_SEQ_LENS = (512, 4096)
"""Sequence lengths whose sample-order digest (at the recipe's seed) the manifest records."""


def manifest_placed(directory: Path) -> bool:
    """Whether the cycle in `directory` has its manifest, or anything in its place (a directory, a
    dangling link: damage `load_manifest` names, never a cycle "not prepared yet" that a preparer
    would make again beside it); False: not prepared yet."""
    return os.path.lexists(directory / MANIFEST_NAME)


def load_manifest(directory: Path) -> tuple[dict[str, Any], str]:
    """(manifest, sha256 of its bytes); `ManifestDamaged` naming the file and how to recover it when
    it is missing or not a manifest, DataLineError when another nsconsole's format."""
    path = directory / MANIFEST_NAME
    if not directory.is_dir():
        raise DataLineError(f"{directory}: cycle {int(directory.name[1:])} is not prepared yet")
    if path.is_dir():
        raise ManifestDamaged(f"{path}: a directory, not the cycle's manifest", manifest_remedy(directory))
    try:
        manifest = read_json(path)
    except DataLineError as error:
        raise ManifestDamaged(str(error), manifest_remedy(directory)) from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("format"), int):
        raise ManifestDamaged(f"{path}: not a cycle manifest (no format)", manifest_remedy(directory))
    if manifest["format"] != MANIFEST_FORMAT:
        raise DataLineError(
            f"{path}: a cycle manifest of format {manifest['format']}, this nsconsole reads format {MANIFEST_FORMAT}"
        )
    return manifest, sha256_bytes(path.read_bytes())


def manifest_remedy(directory: Path) -> str:
    """How to recover the damaged manifest of the cycle in `directory` (a clause of a one-line error).

    Nothing else in a data line records a manifest's bytes, so it is written again only where the
    shards still there prove it (`datalines.preparer.restore_manifest`): never for a consumed
    cycle, whose shards are deleted."""
    line, index = directory.parent.parent, int(directory.name[1:])
    if (directory / CONSUMED_MARK).exists():
        return f"cycle {index} was consumed and its shards deleted, so {restore_advice(index)}"
    # Nothing is written over a directory (it may hold someone's files): its user moves it first.
    first = "move it out of the cycle directory, then " if (directory / MANIFEST_NAME).is_dir() else ""
    return (
        f"{first}`nsconsole data rebuild --work {line} --cycle {index}` writes it again from the cycle's plan if "
        f"the shards there match it byte for byte; else {restore_advice(index)}"
    )


def restore_advice(index: int) -> str:
    """The recovery of a manifest that cannot be written again and checked: a copy of the file."""
    return (
        f"restore it from a backup, or copy it from a data line made identical to this one "
        f"(`nsconsole data init --like`) that prepared cycle {index}"
    )


def shard_files(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    files = []
    for info in manifest["sources"].values():
        files.extend([info["tokens_file"], info["offsets_file"]])
    return files


ShardStamps = tuple[tuple[str, int, int, int, int], ...]
"""Each shard's (name, inode, size, mtime ns, ctime ns): any write to a file, in place or by a
rename over it, changes its stamp, so a stamp that still matches needs no second hashing. A
missing shard's stamp is `MISSING_STAMP` (size -1: never a file's)."""
MISSING_STAMP = (0, -1, 0, 0)


def shard_stamps(directory: Path, manifest: dict[str, Any]) -> ShardStamps:
    """The shards' stamps now."""
    stamps = []
    for entry in shard_files(manifest):
        try:
            info = os.stat(directory / entry["name"])
        except FileNotFoundError:
            stamps.append((entry["name"], *MISSING_STAMP))
            continue
        stamps.append((entry["name"], info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns))
    return tuple(stamps)


def shard_problems(directory: Path, manifest: dict[str, Any]) -> list[str]:
    """What is wrong with each shard that is not as the manifest records it (missing, its size, its
    sha256), one clause naming the file each; empty when every shard matches."""
    problems = (shard_problem(directory, entry, manifest) for entry in shard_files(manifest))
    return [problem for problem in problems if problem is not None]


def shard_problem(directory: Path, entry: dict[str, Any], manifest: dict[str, Any]) -> str | None:
    """What is wrong with the shard of `manifest` that `entry` records (missing, its size, its
    sha256), one clause naming the file; None when it matches."""
    path = directory / entry["name"]
    if not path.is_file():
        return f"{path}: shard missing (cycle {manifest['cycle']})"
    if (size := path.stat().st_size) != entry["bytes"]:
        return f"{path}: shard is {size} bytes, the manifest says {entry['bytes']} (truncated?)"
    if sha256_file(path) != entry["sha256"]:
        return f"{path}: shard sha256 differs from the manifest (corrupted)"
    return None


def verify_shards(directory: Path, manifest: dict[str, Any]) -> None:
    """Every shard present with the size and sha256 the manifest records, else DataLineError naming
    every one that is not (a reader, and whoever mends it, sees all of them at once)."""
    problems = shard_problems(directory, manifest)
    if problems:
        raise DataLineError("; ".join(problems))
