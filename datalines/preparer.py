"""Preparing a cycle: plan it, read its documents, tokenize, write shards, then the manifest.

Everything goes into `cycles/.tmp-cNNNN-<pid>/` first; the directory is renamed to
`cycles/cNNNN/` only once every shard and the manifest are on disk, so a kill -9 at any moment
leaves nothing that looks complete, and a restart (which removes the leftovers of dead
processes) produces the same bytes: the plan is fixed and tokenization is deterministic. A
cycle directory found without its manifest (moved aside by hand) is taken over only when it
holds nothing but the cycle's own shards, byte for byte; a damaged manifest is written again
only by `restore_manifest`, where the shards there prove it.
"""

from __future__ import annotations

import os
import shutil
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from datalines.corpus import FileDocuments, file_documents
from datalines.cycle import Cycle
from datalines.dataline import CONSUMED_MARK, DataLine
from datalines.errors import DataLineError, ManifestDamaged
from datalines.files import fsync_directory, write_json_atomic
from datalines.manifest import (
    DIGEST_SEQ_LENS,
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    load_manifest,
    manifest_placed,
    restore_advice,
    shard_files,
    shard_problem,
    verify_shards,
)
from datalines.mixture import merge_strata
from datalines.planning import ensure_plan, load_plan, plan_files, plan_path
from datalines.shards import (
    OFFSETS_SUFFIX,
    TOKENS_SUFFIX,
    ShardWriter,
    join_documents,
    open_tokens,
    token_dtype,
    write_array_atomic,
)

ProgressCallback = Callable[[float, str], None]
"""Called with (fraction of the cycle done, what is being done)."""

_OPEN_FILES_CACHED = 8
_ENCODE_CHUNK_DOCUMENTS = 4096
"""Documents encoded per `encode_batch` round (bounds the memory of one stratum's encoding)."""
_WRITE_BUFFER_TOKENS = 1 << 22
"""Tokens gathered before each write of a merged shard."""
INVALID_UTF8_KEY = "invalid_utf8_bytes"
"""A manifest source's record of the bytes of its documents in the cycle that were not UTF-8 and were
replaced by U+FFFD: file path (in the source) -> bytes. Present only where there were any."""


def _ignore_progress(fraction: float, message: str) -> None:
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_partials(line: DataLine) -> None:
    """Remove partial cycle directories left by processes that are gone (a kill -9 mid-cycle), and
    the temporary files of their atomic writes beside the line's own files and plans
    (`.tmp-<pid>-<name>`, `datalines.files.temporary_name`: preparer.json is rewritten all along a
    cycle, so a kill mid-cycle often leaves one)."""
    cycles = line.path / "cycles"
    for partial in cycles.glob(".tmp-c*") if cycles.is_dir() else ():
        pid_text = partial.name.rsplit("-", 1)[-1]
        if not pid_text.isdigit() or not _pid_alive(int(pid_text)):
            shutil.rmtree(partial, ignore_errors=True)
    for directory in (line.path, line.path / "plans"):
        for temporary in directory.glob(".tmp-*"):
            pid_text = temporary.name.split("-", 2)[1]
            if temporary.is_file() and (not pid_text.isdigit() or not _pid_alive(int(pid_text))):
                temporary.unlink(missing_ok=True)


class _FileCache:
    """The last few files' documents, so ranges of one file in one cycle read it once."""

    def __init__(self, line: DataLine, source: str) -> None:
        self.line, self.source = line, line.source(source)
        self.entries: OrderedDict[int, FileDocuments] = OrderedDict()

    def get(self, file_index: int) -> FileDocuments:
        if file_index in self.entries:
            self.entries.move_to_end(file_index)
        else:
            file = self.source.files[file_index]
            self.entries[file_index] = file_documents(self.source, file, self.line.recipe.seed)
            if len(self.entries) > _OPEN_FILES_CACHED:
                self.entries.popitem(last=False)
        return self.entries[file_index]


def _tokenize_stratum(
    line: DataLine,
    cache: _FileCache,
    ranges: list[list[int]],
    markers: tuple[str, ...],
    spill: Path,
    invalid_utf8: dict[str, int],
) -> np.ndarray:
    """Encode the stratum's documents chunk by chunk into `spill` (EOS after each); their token
    lengths. Adds the bytes of them that were not UTF-8 to `invalid_utf8` (file path -> bytes)."""
    dtype = token_dtype(line.vocab_size)
    lengths: list[np.ndarray] = []
    with open(spill, "wb") as handle:
        for file_index, start, end in ranges:
            documents = cache.get(file_index)
            invalid = sum(count for index, count in documents.invalid_utf8.items() if start <= index < end)
            if invalid:
                path = cache.source.files[file_index].path
                invalid_utf8[path] = invalid_utf8.get(path, 0) + invalid
            texts = documents.training[start:end]
            for chunk_start in range(0, len(texts), _ENCODE_CHUNK_DOCUMENTS):
                chunk = texts[chunk_start : chunk_start + _ENCODE_CHUNK_DOCUMENTS]
                encoded = line.tokenizer.encode_documents(chunk, markers)
                tokens, offsets = join_documents(encoded, line.eos_id, dtype)
                handle.write(tokens.tobytes())
                lengths.append(np.diff(offsets))
    return np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)


def _write_merged_shard(
    directory: Path, name: str, spills: list[Path], lengths: list[np.ndarray], dtype: np.dtype
) -> dict[str, Any]:
    """Lay the strata's documents out in `merge_strata` order, streaming from the spills into the shard."""
    order = merge_strata(lengths)  # (documents, 2): stratum, document index
    starts = [np.concatenate([[0], np.cumsum(stratum_lengths)]) for stratum_lengths in lengths]
    spilled = [open_tokens(spill, dtype, int(start[-1])) for spill, start in zip(spills, starts)]
    with ShardWriter(directory / f"{name}{TOKENS_SUFFIX}") as writer:
        pending: list[np.ndarray] = []
        pending_tokens = 0
        for stratum, document in order.tolist():
            begin, end = starts[stratum][document], starts[stratum][document + 1]
            pending.append(spilled[stratum][begin:end])
            pending_tokens += end - begin
            if pending_tokens >= _WRITE_BUFFER_TOKENS:
                writer.write(np.concatenate(pending))
                pending, pending_tokens = [], 0
        if pending:
            writer.write(np.concatenate(pending))
        tokens_entry = writer.close()
    merged_lengths = np.zeros(len(order), dtype=np.int64)
    for stratum, stratum_lengths in enumerate(lengths):
        rows = order[:, 0] == stratum
        merged_lengths[rows] = stratum_lengths[order[rows, 1]]
    offsets = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(merged_lengths, out=offsets[1:])
    offsets_entry = write_array_atomic(directory / f"{name}{OFFSETS_SUFFIX}", offsets)
    return {"tokens": int(offsets[-1]), "tokens_file": tokens_entry, "offsets_file": offsets_entry}


def build_cycle(
    line: DataLine, plan: dict[str, Any], directory: Path, progress: ProgressCallback
) -> dict[str, Any]:
    """Tokenize the plan's documents into shards in `directory`; returns the manifest (not yet written).

    Each stratum is encoded in chunks into a spill file, then the strata are interleaved into the
    source's shard by streaming copies: memory holds a few files' documents, not the cycle.
    """
    index = plan["cycle"]
    dtype = token_dtype(line.vocab_size)
    piece = line.recipe.piece_at(plan["start_tokens"])
    total_bytes = sum(s["bytes"] for src in plan["sources"].values() for s in src["strata"].values()) or 1
    done_bytes = 0
    sources_info: dict[str, Any] = {}
    for name in line.sources:
        spec = line.recipe.source(name)
        cache = _FileCache(line, name)
        strata = sorted(plan["sources"][name]["strata"].items())
        spills = [directory / f".spill-{name}-{number}" for number in range(len(strata))]
        lengths: list[np.ndarray] = []
        strata_info: dict[str, Any] = {}
        invalid_utf8: dict[str, int] = {}
        for (stratum, stratum_plan), spill in zip(strata, spills):
            progress(done_bytes / total_bytes, f"cycle {index}: tokenizing {name}/{stratum}")
            ranges = stratum_plan["ranges"]
            lengths.append(_tokenize_stratum(line, cache, ranges, spec.control_markers, spill, invalid_utf8))
            strata_info[stratum] = {"documents": len(lengths[-1]), "tokens": int(lengths[-1].sum())}
            done_bytes += stratum_plan["bytes"]
        progress(done_bytes / total_bytes, f"cycle {index}: writing the {name} shard")
        shard = _write_merged_shard(directory, name, spills, lengths, dtype)
        for spill in spills:
            spill.unlink()
        sources_info[name] = {
            "weight": piece.weights.get(name, 0),
            "tokens": shard["tokens"],
            "documents": int(sum(len(stratum_lengths) for stratum_lengths in lengths)),
            "strata": strata_info,
            "tokens_file": shard["tokens_file"],
            "offsets_file": shard["offsets_file"],
        }
        if invalid_utf8:  # only then: a clean cycle's manifest is the bytes it always was
            sources_info[name][INVALID_UTF8_KEY] = invalid_utf8
    manifest: dict[str, Any] = {
        "format": MANIFEST_FORMAT,
        "cycle": index,
        "start_tokens": plan["start_tokens"],
        "last": plan["last"],
        "source_order": list(line.sources),
        "token_dtype": dtype.str,
        "eos_id": line.eos_id,
        "tokenizer_sha256": line.tokenizer_sha256,
        "tokens": int(sum(info["tokens"] for info in sources_info.values())),
        "sources": sources_info,
        "plan": plan,
    }
    reader = Cycle(directory, manifest, "", line.recipe.segments_per_cycle)
    # Digests at the lengths where every source of the cycle has a window (a small cycle has none at 4096).
    manifest["order_digests"] = {
        f"T{seq_len}/seed{line.recipe.seed}": reader.order_digest(seq_len, line.recipe.seed)
        for seq_len in DIGEST_SEQ_LENS
        if all(reader.windows(name, seq_len) for name, info in sources_info.items() if info["weight"])
    }
    progress(1.0, f"cycle {index}: shards written")
    return manifest


def _partial_directory(line: DataLine, index: int) -> Path:
    directory = line.path / "cycles" / f".tmp-c{index:04d}-{os.getpid()}"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    return directory


def prepare_cycle(line: DataLine, index: int, progress: ProgressCallback | None = None) -> dict[str, Any] | None:
    """Make cycle `index` ready (plan, download, tokenize, shards, manifest); a no-op when it is.
    Returns the manifest of a cycle prepared now (None: it was ready, or its shards were rebuilt)."""
    progress = progress or _ignore_progress
    final = line.cycle_dir(index)
    if manifest_placed(final):
        if line.is_consumed(index):
            return None
        problem = line.cycle_problem(index)  # one read of the manifest for a cycle that is ready
        if problem is None:
            return None
        load_manifest(final)  # a damaged manifest stops here, with how to recover it
        # Said before the work, so the log tells why a prepared cycle is tokenized again.
        progress(0.0, f"cycle {index}: {problem}; rebuilding its shards from the manifest")
        rebuild_cycle(line, index, progress)
        return None
    _check_leftovers(line, index, None)  # before the work: most refusals need no tokenizing
    remove_stale_partials(line)
    plan = ensure_plan(line, index)
    partial = _partial_directory(line, index)
    manifest = build_cycle(line, plan, partial, progress)
    write_json_atomic(partial / MANIFEST_NAME, manifest)
    if _move_into_place(line, index, partial, manifest):
        release_finished_files(line, plan)
    return manifest


def invalid_utf8_bytes(manifest: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Source -> file -> the bytes of the cycle's documents that were not UTF-8 (replaced by U+FFFD);
    {} for a manifest of a clean cycle (or one too garbled to say: its damage is said elsewhere)."""
    sources = manifest.get("sources")
    if not isinstance(sources, dict):
        return {}
    return {name: dict(info[INVALID_UTF8_KEY]) for name, info in sources.items()
            if isinstance(info, dict) and isinstance(info.get(INVALID_UTF8_KEY), dict)}  # fmt: skip


def _shard_names(line: DataLine) -> set[str]:
    """The files `build_cycle` writes into a cycle directory, whatever the cycle's plan."""
    return {f"{name}{suffix}" for name in line.sources for suffix in (TOKENS_SUFFIX, OFFSETS_SUFFIX)}


def _differing_shards(directory: Path, manifest: dict[str, Any]) -> list[str]:
    """The shards in `directory` whose bytes are not the ones `manifest` records (missing ones aside)."""
    return [entry["name"] for entry in shard_files(manifest)
            if (directory / entry["name"]).exists() and shard_problem(directory, entry, manifest) is not None]

def _check_leftovers(line: DataLine, index: int, manifest: dict[str, Any] | None) -> None:
    """DataLineError (one line) unless cycle `index`'s directory, when there is one without a
    manifest, holds nothing but the cycle's shards (and, given the `manifest` just built, those
    byte for byte): only then may the new cycle take their place.

    Such a directory is what a manifest moved aside or deleted leaves (a cycle is renamed into
    place with its manifest). Its cycle was never consumed (a mark needs a manifest) but a trainer
    may have read part of it: a file the preparer cannot prove it makes again byte for byte may be
    the only copy of what was trained, so it is never deleted or replaced; its user decides.
    """
    final = line.cycle_dir(index)
    if not final.is_dir():
        return
    if (final / CONSUMED_MARK).exists():
        raise DataLineError(
            f"{final}: cycle {index} is marked {CONSUMED_MARK} but has no {MANIFEST_NAME}, the only record of "
            f"what it held; {restore_advice(index)}"
        )
    shard_names = _shard_names(line)
    others = sorted(path.name for path in final.iterdir() if path.name not in shard_names)
    differing = [] if manifest is None else _differing_shards(final, manifest)
    if others:
        problem = f"holds {', '.join(others)}, which {'is' if len(others) == 1 else 'are'} not its shards"
    elif differing:
        one = len(differing) == 1
        problem = (
            f"its {', '.join(differing)} {'differs' if one else 'differ'} from the cycle prepared again "
            f"from its plan (a trainer may have read {'it' if one else 'them'})"
        )
    else:
        return
    raise DataLineError(
        f"{final}: cycle {index} has no {MANIFEST_NAME} and {problem}; restore its {MANIFEST_NAME} "
        f"(from a backup), or move what it holds out of the directory and the preparer prepares the cycle again"
    )


def _move_into_place(line: DataLine, index: int, partial: Path, manifest: dict[str, Any]) -> bool:
    """Rename the finished `partial` directory to the cycle's; False when another process finished
    the cycle first (its bytes are the same as ours)."""
    final = line.cycle_dir(index)
    try:
        os.replace(partial, final)
    except OSError:
        if not final.is_dir():
            raise
    else:
        fsync_directory(final.parent)
        return True
    try:
        if (final / MANIFEST_NAME).is_file():
            return False
        _check_leftovers(line, index, manifest)
        # What is there is this cycle's shards, byte for byte: the new files go over them, the
        # manifest last (its presence marks the cycle complete; a kill before it leaves shards the
        # next try finds the same again).
        for entry in shard_files(manifest):
            os.replace(partial / entry["name"], final / entry["name"])
        os.replace(partial / MANIFEST_NAME, final / MANIFEST_NAME)
        fsync_directory(final)
        return True
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def release_finished_files(line: DataLine, plan: dict[str, Any]) -> None:
    """Let sources delete downloads that no later cycle reads (the plan's cursors have passed them)."""
    for name in line.sources:
        source = line.source(name)
        for stratum, cursor in plan["end"][name].items():
            stratum_files = [file for file in source.files if file.stratum == stratum]
            for file in stratum_files[: cursor["file"]]:
                source.release(file)


def release_unneeded_files(line: DataLine, plan: dict[str, Any]) -> None:
    """After a rebuild: let sources delete the downloads of the plan's files that no cycle still to
    be prepared reads (`files_still_read`).

    A rebuild of an early cycle (`data rebuild`, a cycle a rollback reopened) fetches its files
    again, long after the cycles that read them released them; the next cycle prepared would
    release them, but a line that has finished (or has no preparer running) has none.
    """
    needed = files_still_read(line)
    for name, indices in plan_files(plan).items():
        source = line.source(name)
        for file_index in sorted(indices - needed[name]):
            source.release(source.files[file_index])


def files_still_read(line: DataLine) -> dict[str, set[int]]:
    """Source -> the files a cycle still to be prepared reads: every planned cycle not consumed
    whose shards are not all there (not prepared yet, reopened, a manifest to restore), and the
    next cycle to be planned, which goes on from where the newest plan left each stratum (every
    file, on a line with no plan yet)."""
    needed: dict[str, set[int]] = {name: set() for name in line.sources}
    known = line.known_cycles()
    for index in known:
        if line.is_consumed(index) or shards_there(line, index):
            continue
        plan = load_plan(line, index)
        for name, indices in plan_files(plan).items() if plan is not None else ():
            needed[name] |= indices
    planned = [index for index in known if plan_path(line, index).is_file()]
    newest = load_plan(line, planned[-1]) if planned else None
    if newest is None:
        return {name: set(range(len(line.source(name).files))) for name in line.sources}
    if not newest["last"]:
        for name in line.sources:
            files = line.source(name).files
            for stratum, cursor in newest["end"][name].items():
                stratum_files = [number for number, file in enumerate(files) if file.stratum == stratum]
                needed[name].update(stratum_files[cursor["file"] :])
    return needed


def shards_there(line: DataLine, index: int) -> bool:
    """Whether cycle `index` has its manifest and every shard it names (a stat each, no hashing)."""
    directory = line.cycle_dir(index)
    try:
        manifest, _ = load_manifest(directory)
    except DataLineError:
        return False
    return all((directory / entry["name"]).is_file() for entry in shard_files(manifest))


def rebuild_cycle(line: DataLine, index: int, progress: ProgressCallback | None = None) -> None:
    """Rebuild a cycle's shards from its permanent manifest and check them byte for byte.

    Raises DataLineError naming the shard whose bytes differ; on success the shards are back in
    the cycle directory, and the downloads it made that no cycle still to be prepared reads are
    deleted. A consumed cycle stays consumed (its mark records the line that trained it; only a
    rollback reopens a cycle): its shards, rebuilt to check or read them, go at the preparer's
    next round, as every consumed cycle's.
    """
    progress = progress or _ignore_progress
    final = line.cycle_dir(index)
    manifest, _ = load_manifest(final)
    remove_stale_partials(line)
    partial = _partial_directory(line, index)
    try:
        rebuilt = build_cycle(line, manifest["plan"], partial, progress)
        expected = {entry["name"]: entry["sha256"] for entry in shard_files(manifest)}
        for entry in shard_files(rebuilt):
            if expected.get(entry["name"]) != entry["sha256"]:
                raise DataLineError(
                    f"{final / entry['name']}: rebuilt shard differs from the manifest "
                    f"(sha256 {entry['sha256'][:12]}... != {str(expected.get(entry['name']))[:12]}...)"
                )
        for entry in shard_files(rebuilt):
            os.replace(partial / entry["name"], final / entry["name"])
        fsync_directory(final)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    release_unneeded_files(line, manifest["plan"])


def restore_manifest(
    line: DataLine, index: int, damage: ManifestDamaged, progress: ProgressCallback | None = None
) -> Path:
    """Write cycle `index`'s damaged or missing manifest again from the cycle's plan, only where the
    shards in its directory prove it; returns the plan's path.

    Nothing in a data line records a manifest's bytes (no index of cycles; the consumed mark holds
    a pid and a line; preparer.json no hashes): the shards are its only witness. The manifest is a
    function of the permanent plan it embeds, the data line's pinned config and its shards' bytes,
    so when the cycle tokenized again from the plan gives every shard still there byte for byte,
    the manifest of that build is the one they were written with: what the cycle holds cannot
    change. (Should a field derived from them differ, one an older nsconsole computed otherwise, a
    checkpoint that read the cycle mid-way holds the manifest's sha256 and the trainer refuses to
    resume on another: never a silent change.) Anything else (a consumed cycle,
    whose shards are deleted; a shard missing or different; no plan) is refused with DataLineError
    saying how to recover, and nothing is written. The downloads it made go as a rebuild's do
    (`release_unneeded_files`).
    """
    progress = progress or _ignore_progress
    final = line.cycle_dir(index)
    if line.is_consumed(index):
        raise DataLineError(
            f"{damage.problem}; cycle {index} was consumed and its shards deleted, so {restore_advice(index)}"
        )
    if (final / MANIFEST_NAME).is_dir():
        raise DataLineError(str(damage))  # its remedy: move it aside first (nothing is written over a directory)
    plan = load_plan(line, index)
    if plan is None:
        raise DataLineError(
            f"{damage.problem}; {plan_path(line, index)} is missing too; {restore_advice(index)}"
        )
    missing = sorted(name for name in _shard_names(line) if not (final / name).is_file())
    if missing:
        raise DataLineError(
            f"{damage.problem}; its shard{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
            f"{'are' if len(missing) > 1 else 'is'} missing, so nothing proves a manifest written again from "
            f"its plan; {restore_advice(index)}"
        )
    remove_stale_partials(line)
    partial = _partial_directory(line, index)
    try:
        manifest = build_cycle(line, plan, partial, progress)
        differing = _differing_shards(final, manifest)
        if differing:
            raise DataLineError(
                f"{damage.problem}; the cycle tokenized again from {plan_path(line, index)} differs from its "
                f"{', '.join(differing)} there, so nothing proves what it held; {restore_advice(index)}"
            )
        write_json_atomic(final / MANIFEST_NAME, manifest)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    verify_shards(final, load_manifest(final)[0])  # the file as written, read back
    release_unneeded_files(line, plan)
    return plan_path(line, index)


def delete_consumed_shards(line: DataLine) -> list[int]:
    """Delete the shards of every consumed cycle (manifests stay); returns the cycles cleaned now."""
    cleaned = []
    cycles = line.path / "cycles"
    for directory in sorted(cycles.glob("c[0-9][0-9][0-9][0-9]")) if cycles.is_dir() else []:
        if not (directory / CONSUMED_MARK).exists() or not (directory / MANIFEST_NAME).is_file():
            continue
        if {path.name for path in directory.iterdir()} <= {CONSUMED_MARK, MANIFEST_NAME}:
            continue  # cleaned before
        manifest, _ = load_manifest(directory)
        removed = False
        for entry in shard_files(manifest):
            path = directory / entry["name"]
            if path.exists():
                path.unlink()
                removed = True
        if removed:
            cleaned.append(int(directory.name[1:]))
    return cleaned
