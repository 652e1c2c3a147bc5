"""Checkpoints: `<line>/checkpoints/u<update:08d>/`, written in the background, hashed, renamed atomically.

A checkpoint directory holds

    model.safetensors      fp32 weights by parameter name (loadable without this package's layout)
    optimizer.safetensors  the flat AdamW moments (`exp_avg`, `exp_avg_sq`), the step, the EMA slot
    extra.safetensors      the model's extra state (PSSA memory banks) and the RNG states (`rng/...`)
    state.json             update, tokens, data position, rows count, kept reason, code version, layout
    run.json               the line's full configuration as it was at this update
    tokenizer.json         the tokenizer the weights were trained with (a checkpoint is self-contained)
    meta.json              written last: the blake2b and size of every other file

Writing: the training loop hands over a `CheckpointSnapshot` (host copies, taken between updates)
and goes on; a thread writes `u<N>.partial/`, fsyncs every file and the directory, renames it to
`u<N>/`, fsyncs `checkpoints/`, and only then replaces `latest` (a one-line file naming the
directory) by an atomic rename. A crash at any point leaves either the old `latest` or the new
one, never a half-written checkpoint behind `latest`; `.partial` directories are discarded at
the next start. After each write the retention rule runs: the checkpoint `latest` names, the
kept ones (line start, cycle ends, length changes) and the newest `keep_last` rolling ones stay.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import threading
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from engine.atomic import fsync_directory, write_text_atomic
from engine.errors import CheckpointError, DiskFull

FORMAT_VERSION = 1
LATEST_NAME = "latest"
META_NAME = "meta.json"
STATE_NAME = "state.json"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
EXTRA_FILE = "extra.safetensors"
RUN_JSON_FILE = "run.json"
TOKENIZER_FILE = "tokenizer.json"
PARTIAL_SUFFIX = ".partial"
_DIR_PATTERN = re.compile(r"^u(\d{8})$")
_HASH_CHUNK_BYTES = 1 << 22


def checkpoint_name(update: int) -> str:
    return f"u{update:08d}"


def update_of(directory: Path) -> int | None:
    """The update number of a checkpoint directory's name, None for anything else."""
    match = _DIR_PATTERN.match(directory.name)
    return int(match.group(1)) if match else None


@dataclass
class CheckpointSnapshot:
    """Everything a checkpoint holds, as host (CPU) tensors and plain JSON values.

    The loop builds it between two updates (copies, so training may go on writing the live
    buffers) and hands it to `CheckpointWriter.save`.
    """

    update: int
    """Optimizer updates completed (finite or skipped) at this checkpoint."""
    weights: dict[str, torch.Tensor]
    """fp32 parameters by qualified name."""
    optimizer: dict[str, torch.Tensor]
    """Flat optimizer state: `exp_avg`, `exp_avg_sq`, `step` and, when kept, `ema`."""
    extra: dict[str, torch.Tensor]
    """Model extra state and RNG states (keys prefixed `rng/`)."""
    state: dict[str, Any]
    """JSON trainer state: tokens, data position, rows count, counters, `kept` reason (or None)."""
    run_json: bytes
    """The line's run.json, byte for byte."""
    tokenizer_json: bytes
    """The tokenizer JSON the line trains with."""

    @property
    def nbytes(self) -> int:
        """Bytes of its tensors and documents: about its size on disk."""
        tensors = (*self.weights.values(), *self.optimizer.values(), *self.extra.values())
        return sum(t.numel() * t.element_size() for t in tensors) + len(self.run_json) + len(self.tokenizer_json)


@dataclass(kw_only=True)
class Checkpoint(CheckpointSnapshot):
    """A verified checkpoint loaded from disk: what was saved, and where it lies."""

    directory: Path
    """The checkpoint's directory."""


@cache
def code_version() -> str:
    """`git describe` of the source tree when it is a checkout, else the installed package version."""
    source_root = Path(__file__).resolve().parents[2]
    try:
        described = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--tags"],
            cwd=source_root,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        if described:
            return f"git:{described}"
    except (OSError, subprocess.SubprocessError):
        pass
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"nsconsole {version('nsconsole')}"
    except PackageNotFoundError:
        return "unknown"


# ---------------------------------------------------------------------------------------------
# durable file operations


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


def _write_bytes_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _blake2b_of(path: Path) -> str:
    digest = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _json_bytes(value: Any) -> bytes:
    return (json.dumps(value, indent=1, sort_keys=True) + "\n").encode()


def write_latest(checkpoints_dir: Path, name: str) -> None:
    """Point `latest` at `name` atomically and durably."""
    write_text_atomic(checkpoints_dir / LATEST_NAME, name + "\n")


def read_latest(checkpoints_dir: Path) -> str | None:
    """The directory name `latest` holds, None when there is no `latest` or it names nothing valid."""
    try:
        name = (checkpoints_dir / LATEST_NAME).read_text().strip()
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    return name if _DIR_PATTERN.match(name) else None


CHECKPOINT_DISK_MARGIN = 1.5
"""Free disk a checkpoint write needs, as a multiple of its expected size: the trainer does not
start one with less (it would fail half-way), and `nsconsole check` says so before a start."""


def expected_checkpoint_bytes(checkpoints_dir: Path, parameters: int) -> int:
    """The next checkpoint's size on disk: the newest one's (the next is as large), or before any,
    fp32 weights, two moments and an average (16 bytes a parameter)."""
    name = read_latest(checkpoints_dir)
    newest = checkpoints_dir / name if name is not None else None
    if newest is None or not newest.is_dir():
        return 16 * parameters
    return sum(path.stat().st_size for path in newest.iterdir() if path.is_file())


# ---------------------------------------------------------------------------------------------
# writing


def write_checkpoint(checkpoints_dir: Path, snapshot: CheckpointSnapshot) -> Path:
    """Write `snapshot` as `u<update>/` durably and atomically; returns the final directory.

    `latest` is not touched here (see `CheckpointWriter`). A directory of the same name left
    by an abandoned continuation (a resume from an older checkpoint) is replaced.
    """
    checkpoints_dir.mkdir(parents=True, exist_ok=True)
    name = checkpoint_name(snapshot.update)
    final = checkpoints_dir / name
    partial = checkpoints_dir / (name + PARTIAL_SUFFIX)
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir()

    # safetensors refuses tensors that share storage (views of one flat buffer): clone each.
    save_file({key: tensor.detach().contiguous().clone() for key, tensor in snapshot.weights.items()},
              partial / MODEL_FILE)
    save_file({key: tensor.detach().contiguous().clone() for key, tensor in snapshot.optimizer.items()},
              partial / OPTIMIZER_FILE)
    save_file({key: tensor.detach().contiguous().clone() for key, tensor in snapshot.extra.items()},
              partial / EXTRA_FILE)
    for tensor_file in (MODEL_FILE, OPTIMIZER_FILE, EXTRA_FILE):
        _fsync_file(partial / tensor_file)
    state = dict(snapshot.state, update=snapshot.update, format=FORMAT_VERSION, code_version=code_version())
    _write_bytes_durably(partial / STATE_NAME, _json_bytes(state))
    _write_bytes_durably(partial / RUN_JSON_FILE, snapshot.run_json)
    _write_bytes_durably(partial / TOKENIZER_FILE, snapshot.tokenizer_json)

    files = {
        path.name: {"blake2b": _blake2b_of(path), "bytes": path.stat().st_size}
        for path in sorted(partial.iterdir())
    }
    _write_bytes_durably(partial / META_NAME, _json_bytes({"format": FORMAT_VERSION, "files": files}))
    fsync_directory(partial)

    if final.exists():
        # Same update number from an abandoned continuation: set it aside as a partial so a
        # crash right here leaves nothing that looks like a checkpoint.
        discarded = checkpoints_dir / (name + ".old" + PARTIAL_SUFFIX)
        os.replace(final, discarded)
        shutil.rmtree(discarded)
    os.replace(partial, final)
    fsync_directory(checkpoints_dir)
    return final


def discard_partial_writes(checkpoints_dir: Path) -> list[str]:
    """Remove `*.partial` directories and stray `latest` temporaries; returns their names."""
    if not checkpoints_dir.is_dir():
        return []
    removed = []
    for path in sorted(checkpoints_dir.iterdir()):
        if path.name.endswith(PARTIAL_SUFFIX) and path.is_dir():
            shutil.rmtree(path)
            removed.append(path.name)
        elif path.name.startswith(f".{LATEST_NAME}.") and path.name.endswith(".tmp"):
            path.unlink()  # an interrupted `latest` replacement
            removed.append(path.name)
    return removed


def list_checkpoints(checkpoints_dir: Path) -> list[Path]:
    """Checkpoint directories (complete renames only), oldest first."""
    if not checkpoints_dir.is_dir():
        return []
    found = [path for path in checkpoints_dir.iterdir() if path.is_dir() and update_of(path) is not None]
    return sorted(found, key=lambda path: update_of(path) or 0)


def _kept_reason(directory: Path) -> str | None:
    """The `kept` reason recorded in a checkpoint's state.json (None: rolling, or unreadable)."""
    try:
        return json.loads((directory / STATE_NAME).read_text()).get("kept")
    except (OSError, ValueError, AttributeError):
        return None


def apply_retention(checkpoints_dir: Path, keep_last: int, abandoned_after: int | None = None) -> list[str]:
    """Remove what the retention rule does not keep; returns the removed directory names.

    Kept: the checkpoint `latest` names, every checkpoint whose state.json has a `kept` reason,
    and the newest `keep_last` rolling ones. Removed: older rolling checkpoints and, when
    `abandoned_after` is given (the update a resume started from), every checkpoint after it
    other than `latest` -- the continuation that resume abandoned (e.g. a corrupted newest one).
    """
    latest = read_latest(checkpoints_dir)
    rolling: list[Path] = []
    removable: list[Path] = []
    for directory in list_checkpoints(checkpoints_dir):
        update = update_of(directory)
        assert update is not None
        if directory.name != latest and abandoned_after is not None and update > abandoned_after:
            removable.append(directory)
        elif _kept_reason(directory) is None:
            rolling.append(directory)
    # `latest` is normally the newest rolling checkpoint and counts among the `keep_last`.
    newest_rolling = set(rolling[-keep_last:]) if keep_last > 0 else set()
    removable += [
        directory for directory in rolling if directory not in newest_rolling and directory.name != latest
    ]
    for directory in removable:
        shutil.rmtree(directory, ignore_errors=True)
    return [directory.name for directory in removable]


class CheckpointWriter:
    """Writes snapshots in one background thread, one at a time, so the loop never waits on disk.

    `save` returns at once unless the previous write is still running (then it waits for it: at
    most one snapshot is held in memory besides the live state). An error in the thread is
    raised by the next `save` or `wait`. `latest` moves only after the new directory's rename is
    durable; then the retention rule runs. `before_latest` (e.g. fsync rows.jsonl) runs in the
    thread before `latest` moves, so what `latest` promises is on disk.
    """

    def __init__(self, checkpoints_dir: Path, keep_last: int, abandoned_after: int | None = None):
        self.checkpoints_dir = checkpoints_dir
        self.keep_last = keep_last
        self.abandoned_after = abandoned_after
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_written: Path | None = None

    def save(self, snapshot: CheckpointSnapshot, before_latest: Any = None) -> None:
        self.wait()
        self._thread = threading.Thread(
            target=self._write,
            args=(snapshot, before_latest),
            name=f"checkpoint-u{snapshot.update}",
            daemon=True,
        )
        self._thread.start()

    def save_and_wait(self, snapshot: CheckpointSnapshot, before_latest: Any = None) -> Path:
        self.save(snapshot, before_latest)
        self.wait()
        assert self.last_written is not None
        return self.last_written

    def wait(self) -> None:
        """Block until the write in flight (if any) is durable; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, (CheckpointError, DiskFull)):
                raise error
            raise CheckpointError(f"{self.checkpoints_dir}: checkpoint write failed: {error}") from error

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _write(self, snapshot: CheckpointSnapshot, before_latest: Any) -> None:
        try:
            final = write_checkpoint(self.checkpoints_dir, snapshot)
            if before_latest is not None:
                before_latest()
            write_latest(self.checkpoints_dir, final.name)
            apply_retention(self.checkpoints_dir, self.keep_last, self.abandoned_after)
            # The abandoned continuation is gone after the first retention pass.
            self.abandoned_after = None
            self.last_written = final
        except BaseException as error:  # noqa: BLE001 - handed to the loop's thread
            # A half-written directory is never a checkpoint (no rename, `latest` untouched);
            # removing it now gives a full disk its space back.
            name = checkpoint_name(snapshot.update) + PARTIAL_SUFFIX
            shutil.rmtree(self.checkpoints_dir / name, ignore_errors=True)
            free = shutil.disk_usage(self.checkpoints_dir).free
            if free < snapshot.nbytes:
                error = DiskFull(
                    f"{self.checkpoints_dir}: the disk filled while checkpoint {name.removesuffix(PARTIAL_SUFFIX)} "
                    f"was written ({free / 2**30:.2f} GiB free, it needs {snapshot.nbytes / 2**30:.2f} GiB; "
                    f"{error}); the newest complete one is {read_latest(self.checkpoints_dir) or 'none yet'}; "
                    "free some space and run the line again"
                )
            self._error = error


# ---------------------------------------------------------------------------------------------
# verifying and loading


def verify_checkpoint(directory: Path) -> None:
    """Check every file against meta.json (present, size, blake2b); raise `CheckpointError` naming it."""
    meta_path = directory / META_NAME
    try:
        meta = json.loads(meta_path.read_text())
        files = meta["files"]
        if not isinstance(files, dict):
            raise ValueError("files is not an object")
    except FileNotFoundError:
        raise CheckpointError(f"{meta_path}: missing (an incomplete checkpoint)") from None
    except (ValueError, KeyError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{meta_path}: unreadable ({error})") from None
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{meta_path}: format {meta.get('format')!r}, this code reads {FORMAT_VERSION}")
    for required in (MODEL_FILE, OPTIMIZER_FILE, EXTRA_FILE, STATE_NAME, RUN_JSON_FILE, TOKENIZER_FILE):
        if required not in files:
            raise CheckpointError(f"{meta_path}: does not list {required}")
    for name, expected in files.items():
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing")
        size = path.stat().st_size
        if size != expected.get("bytes"):
            expected_size = expected.get("bytes")
            raise CheckpointError(f"{path}: {size} bytes, meta.json says {expected_size} (truncated?)")
        if _blake2b_of(path) != expected.get("blake2b"):
            raise CheckpointError(f"{path}: blake2b mismatch (corrupted)")


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as error:
        raise CheckpointError(f"{path}: unreadable ({error})") from None


def load_checkpoint(directory: Path) -> Checkpoint:
    """Verify and load a checkpoint (tensors on the CPU)."""
    verify_checkpoint(directory)
    state_path = directory / STATE_NAME
    try:
        state = json.loads(state_path.read_text())
    except ValueError as error:
        raise CheckpointError(f"{state_path}: unreadable ({error})") from None
    return Checkpoint(
        directory=directory,
        update=int(state["update"]),
        weights=_load_tensors(directory / MODEL_FILE),
        optimizer=_load_tensors(directory / OPTIMIZER_FILE),
        extra=_load_tensors(directory / EXTRA_FILE),
        state=state,
        run_json=(directory / RUN_JSON_FILE).read_bytes(),
        tokenizer_json=(directory / TOKENIZER_FILE).read_bytes(),
    )


@dataclass
class ResumePoint:
    """The checkpoint a line resumes from and what was wrong with newer ones."""

    checkpoint: Checkpoint | None
    """The newest good checkpoint at or before `latest` (None: start fresh; no checkpoint yet)."""
    problems: list[str] = field(default_factory=list)
    """One line per newer checkpoint that was skipped (corrupted, truncated, missing files)."""


def find_resume_point(checkpoints_dir: Path) -> ResumePoint:
    """Load the checkpoint `latest` names; when it is bad, the newest good one before it.

    Raises `CheckpointError` when checkpoints exist but none of them is good (training from
    scratch over a line's history would silently lose it).
    """
    candidates = list_checkpoints(checkpoints_dir)
    latest = read_latest(checkpoints_dir)
    problems: list[str] = []
    if latest is not None:
        latest_update = int(latest[1:])
        if not (checkpoints_dir / latest).is_dir():
            problems.append(f"{checkpoints_dir / LATEST_NAME}: names {latest}, which is missing")
        # Checkpoints after `latest` belong to no continuation latest vouches for.
        candidates = [path for path in candidates if (update_of(path) or 0) <= latest_update]
    elif (checkpoints_dir / LATEST_NAME).exists():
        problems.append(f"{checkpoints_dir / LATEST_NAME}: unreadable")
    for directory in reversed(candidates):
        try:
            return ResumePoint(load_checkpoint(directory), problems)
        except CheckpointError as error:
            problems.append(str(error))
    if candidates:
        raise CheckpointError(f"{checkpoints_dir}: no good checkpoint: " + "; ".join(problems))
    return ResumePoint(None, problems)


def verify_line_checkpoints(line_dir: Path) -> list[str]:
    """Every problem with a line's checkpoints, one line each (empty list: all good)."""
    checkpoints_dir = Path(line_dir) / "checkpoints"
    problems: list[str] = []
    directories = list_checkpoints(checkpoints_dir)
    latest = read_latest(checkpoints_dir)
    if directories and latest is None:
        problems.append(f"{checkpoints_dir / LATEST_NAME}: missing or unreadable")
    elif latest is not None and not (checkpoints_dir / latest).is_dir():
        problems.append(f"{checkpoints_dir / LATEST_NAME}: names {latest}, which is missing")
    for directory in directories:
        try:
            verify_checkpoint(directory)
        except CheckpointError as error:
            problems.append(str(error))
    if checkpoints_dir.is_dir():
        problems += [
            f"{path}: an interrupted write (discarded at the next start)"
            for path in sorted(checkpoints_dir.iterdir())
            if path.name.endswith(PARTIAL_SUFFIX)
        ]
    return problems
