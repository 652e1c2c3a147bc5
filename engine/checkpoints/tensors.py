"""Checkpoints' tensors: the snapshot, the background writer and the loader.

The directory's files and `latest` are described in `engine.checkpoints.format`. Writing: the
training loop hands over a `CheckpointSnapshot` (host copies, taken between updates) and goes on;
a thread writes `u<N>.partial/`, fsyncs every file and the directory, renames it to `u<N>/`,
fsyncs `checkpoints/`, and only then replaces `latest` by an atomic rename. A crash at any point
leaves either the old `latest` or the new one, never a half-written checkpoint behind `latest`;
`.partial` directories are discarded at the next start. After each write the retention rule
runs (`engine.checkpoints.format.apply_retention`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from engine.atomic import fsync_directory
from engine.checkpoints.disk_budget import gib_text
from engine.checkpoints.format import (
    EXTRA_FILE,
    FORMAT_VERSION,
    META_NAME,
    MODEL_FILE,
    OPTIMIZER_FILE,
    PARTIAL_SUFFIX,
    RUN_JSON_FILE,
    STATE_NAME,
    TOKENIZER_FILE,
    apply_retention,
    blake2b_of,
    checkpoint_name,
    code_version,
    fsync_file,
    json_bytes,
    latest_file_problem,
    read_latest,
    search_resume_point,
    verify_checkpoint,
    write_bytes_durably,
    write_latest,
)
from engine.errors import CheckpointError, DiskFull, disk_full_error


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
    """JSON trainer state: tokens, data position, rows count, counters, `kept` reason (or None), and
    `wandb`: the line's W&B run at this checkpoint (`run_id`, `acknowledged_step`; None when disabled)."""
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


# ---------------------------------------------------------------------------------------------
# durable file operations


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
    _save_tensors(snapshot.weights, partial / MODEL_FILE)
    _save_tensors(snapshot.optimizer, partial / OPTIMIZER_FILE)
    _save_tensors(snapshot.extra, partial / EXTRA_FILE)
    for tensor_file in (MODEL_FILE, OPTIMIZER_FILE, EXTRA_FILE):
        fsync_file(partial / tensor_file)
    state = dict(snapshot.state, update=snapshot.update, format=FORMAT_VERSION, code_version=code_version())
    write_bytes_durably(partial / STATE_NAME, json_bytes(state))
    write_bytes_durably(partial / RUN_JSON_FILE, snapshot.run_json)
    write_bytes_durably(partial / TOKENIZER_FILE, snapshot.tokenizer_json)

    files = {
        path.name: {"blake2b": blake2b_of(path), "bytes": path.stat().st_size}
        for path in sorted(partial.iterdir())
    }
    write_bytes_durably(partial / META_NAME, json_bytes({"format": FORMAT_VERSION, "files": files}))
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


_OS_ERROR = re.compile(r"\(os error (\d+)\)")
"""How safetensors' Rust writer names the OS error under its I/O error (`... (os error 28) ...`)."""


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """One safetensors file. A write the OS refused is raised as the OSError it was: safetensors
    raises its own error, whose text alone says `No space left on device (os error 28)`, and a full
    disk must read as one (the line stops for the operator; it does not fail)."""
    try:
        save_file({key: tensor.detach().contiguous().clone() for key, tensor in tensors.items()}, path)
    except SafetensorError as error:
        found = _OS_ERROR.search(str(error))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from error


class CheckpointWriter:
    """Writes snapshots in one background thread, one at a time, so the loop never waits on disk.

    `save` returns at once unless the previous write is still running (then it waits for it: at
    most one snapshot is held in memory besides the live state). An error in the thread is
    raised by the next `save` or `wait`. `latest` moves only after the new directory's rename is
    durable; then the retention rule runs. `before_latest` (e.g. fsync rows.jsonl) runs in the
    thread before `latest` moves, so what `latest` promises is on disk.
    """

    def __init__(
        self,
        checkpoints_dir: Path,
        keep_last: int,
        abandoned_after: int | None = None,
        keep_cycle_ends: int | None = None,
    ):
        self.checkpoints_dir = checkpoints_dir
        self.keep_last = keep_last
        self.keep_cycle_ends = keep_cycle_ends
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
            apply_retention(self.checkpoints_dir, self.keep_last, self.abandoned_after, self.keep_cycle_ends)
            # The abandoned continuation is gone after the first retention pass.
            self.abandoned_after = None
            self.last_written = final
        except BaseException as error:  # noqa: BLE001 - handed to the loop's thread
            # A half-written directory is never a checkpoint (no rename, `latest` untouched);
            # removing it now gives a full disk its space back.
            name = checkpoint_name(snapshot.update) + PARTIAL_SUFFIX
            shutil.rmtree(self.checkpoints_dir / name, ignore_errors=True)
            free = shutil.disk_usage(self.checkpoints_dir).free
            # ENOSPC or EDQUOT, whatever the free bytes read now: the inodes ran out, a quota was
            # reached, or space came back once the partial write was removed. A write that did not
            # fail so, on a disk with too little room for it, was cut short by the disk too.
            if disk_full_error(error) is not None or free < snapshot.nbytes:
                room = f"{gib_text(free)} free, it needs about {gib_text(snapshot.nbytes)}"
                if free >= snapshot.nbytes:  # the bytes were there: what ran out was not
                    room = f"{gib_text(free)} free, enough for its {gib_text(snapshot.nbytes)}: its inodes or a quota ran out"
                error = DiskFull(
                    f"{self.checkpoints_dir}: the disk filled while checkpoint {name.removesuffix(PARTIAL_SUFFIX)} "
                    f"was written ({room}; {error}); the newest complete one is "
                    f"{read_latest(self.checkpoints_dir) or 'none yet'}; free some space and run the line again"
                )
            self._error = error


# ---------------------------------------------------------------------------------------------
# verifying and loading


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as error:
        raise CheckpointError(f"{path}: unreadable ({error})") from None


def _load_some_tensors(path: Path, keys: Collection[str]) -> dict[str, torch.Tensor]:
    """Those of `keys` that the file holds, and nothing else read into memory."""
    try:
        with safe_open(path, framework="pt") as handle:
            stored = set(handle.keys())  # a safetensors file's index, read without its tensors
            return {key: handle.get_tensor(key) for key in keys if key in stored}
    except (SafetensorError, OSError, ValueError) as error:
        raise CheckpointError(f"{path}: unreadable ({error})") from None


def load_checkpoint(directory: Path, optimizer_keys: Collection[str] | None = None) -> Checkpoint:
    """Verify and load a checkpoint (tensors on the CPU). `optimizer_keys`: only those of the
    optimizer's tensors (None: all): a reader that samples or evaluates needs no AdamW moments,
    two thirds of a checkpoint's tensors (8 of its 12 bytes a parameter: sampling a 2B model
    from 8 GiB of memory, not 24)."""
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
        optimizer=_load_tensors(directory / OPTIMIZER_FILE) if optimizer_keys is None
        else _load_some_tensors(directory / OPTIMIZER_FILE, optimizer_keys),
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
    """Load the checkpoint `latest` names; when it is bad, the newest good one before it
    (`search_resume_point`, which `nsconsole check` and `status` read the same choice from).

    Raises `CheckpointError` when `latest` is not a regular file (the next checkpoint could not
    replace it) and when checkpoints exist but none of them is good (training from scratch over a
    line's history would silently lose it).
    """
    latest_problem = latest_file_problem(checkpoints_dir)
    if latest_problem is not None:
        raise CheckpointError(latest_problem)
    checkpoint, problems = search_resume_point(checkpoints_dir, load_checkpoint)
    return ResumePoint(checkpoint, problems)
