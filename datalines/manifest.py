"""The permanent manifest of a cycle: its plan, shard hashes, token counts and sample-order digests.

`cycles/cNNNN/manifest.json` is written last, after every shard is on disk, and never removed:
its presence marks the cycle complete, and after the shards are deleted (consumed) it still says
exactly what the cycle held, so `data rebuild` can redo it and check every byte.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from datalines.errors import DataLineError
from datalines.files import read_json, sha256_bytes, sha256_file

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1
DIGEST_SEQ_LENS = (512, 4096)
"""Sequence lengths whose sample-order digest (at the recipe's seed) the manifest records."""


def load_manifest(directory: Path) -> tuple[dict[str, Any], str]:
    """(manifest, sha256 of its bytes); DataLineError naming the file when missing or malformed."""
    path = directory / MANIFEST_NAME
    manifest = read_json(path)
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise DataLineError(f"{path}: not a cycle manifest of format {MANIFEST_FORMAT}")
    return manifest, sha256_bytes(path.read_bytes())


def shard_files(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    files = []
    for info in manifest["sources"].values():
        files.extend([info["tokens_file"], info["offsets_file"]])
    return files


ShardStamps = tuple[tuple[str, int, int, int, int], ...]
"""Each shard's (name, inode, size, mtime ns, ctime ns): any write to a file, in place or by a
rename over it, changes its stamp, so a stamp that still matches needs no second hashing."""


def shard_stamps(directory: Path, manifest: dict[str, Any]) -> ShardStamps:
    """The shards' stamps now; DataLineError naming the first one missing."""
    stamps = []
    for entry in shard_files(manifest):
        path = directory / entry["name"]
        try:
            info = os.stat(path)
        except FileNotFoundError:
            raise DataLineError(f"{path}: shard missing (cycle {manifest['cycle']})") from None
        stamps.append((entry["name"], info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns))
    return tuple(stamps)


def verify_shards(directory: Path, manifest: dict[str, Any]) -> None:
    """Every shard present with the size and sha256 the manifest records, else DataLineError naming it."""
    for entry in shard_files(manifest):
        path = directory / entry["name"]
        if not path.is_file():
            raise DataLineError(f"{path}: shard missing (cycle {manifest['cycle']})")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise DataLineError(
                f"{path}: shard is {size} bytes, the manifest says {entry['bytes']} (truncated?)"
            )
        if sha256_file(path) != entry["sha256"]:
            raise DataLineError(f"{path}: shard sha256 differs from the manifest (corrupted)")
