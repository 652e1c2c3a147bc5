"""The checkpoint format without tensors: names, `latest`, listing, verification, retention.

A checkpoint directory `<line>/checkpoints/u<update:08d>/` holds

    model.safetensors      fp32 weights by parameter name (loadable without this package's layout)
    optimizer.safetensors  the flat AdamW moments (`exp_avg`, `exp_avg_sq`), the step, the EMA slot
    extra.safetensors      the model's extra state (PSSA memory banks) and the RNG states (`rng/...`)
    state.json             update, tokens, data position, rows count, kept reason(s), code version, layout
    run.json               the line's full configuration as it was at this update
    tokenizer.json         the tokenizer the weights were trained with (a checkpoint is self-contained)
    meta.json              written last: the blake2b and size of every other file

`latest` (a one-line file naming the directory) is replaced by an atomic rename only after the
directory is complete and renamed into place (`engine.checkpoints.tensors` writes and loads the
tensors). After each write the retention rule runs: the checkpoint `latest` names, the kept ones
(line start, stage ends, cycle ends -- the newest `keep_cycle_ends` of those that end a cycle only,
when it is set), the pinned ones (a rollback's target, a queued branch's cycle end) and the newest `keep_last`
rolling ones stay. Nothing
here imports torch, so branch, rollback, status and the supervisor can read checkpoints' files.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

from engine.atomic import write_text_atomic
from engine.errors import CheckpointError
from engine.layout import LineLayout

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


LINE_START_KEPT = "line-start"
"""The `kept` reason of a line's first checkpoint."""
BRANCH_START_KEPT = "branch-start"
"""The `kept` reason of a branch's first checkpoint (its fork point)."""
_CYCLE_END_KEPT = re.compile(r"^cycle-end (\d+)$")


def cycle_end_kept(cycle: int) -> str:
    """The `kept` reason of the checkpoint that ends data cycle `cycle` (an exact fork point)."""
    return f"cycle-end {cycle}"


def stage_end_kept(stage: str) -> str:
    """The `kept` reason of the checkpoint that ends the plan's stage `stage`."""
    return f"stage-end {stage}"


def kept_reasons(kept: object) -> tuple[str, ...]:
    """The reasons a state.json's `kept` holds: one string, or a list of them where one update ended
    a stage of the plan and a data cycle at once (`["stage-end decay", "cycle-end 3"]`: the checkpoint
    is both); () for a rolling checkpoint (null) or a value of neither shape."""
    if isinstance(kept, str):
        return (kept,)
    if isinstance(kept, list) and all(isinstance(reason, str) for reason in kept):
        return tuple(kept)
    return ()


def kept_text(kept: object) -> str | None:
    """A state.json's `kept` as people read it (`stage-end decay, cycle-end 3`); None: rolling."""
    return ", ".join(kept_reasons(kept)) or None


def cycle_of_kept(kept: object) -> int | None:
    """The cycle whose end a state.json's `kept` names (a cycle-end reason, alone or beside a
    stage end); None when it names none."""
    for reason in kept_reasons(kept):
        match = _CYCLE_END_KEPT.match(reason)
        if match:
            return int(match.group(1))
    return None


def checkpoint_name(update: int) -> str:
    return f"u{update:08d}"


def update_of(directory: Path) -> int | None:
    """The update number of a checkpoint directory's name, None for anything else."""
    match = _DIR_PATTERN.match(directory.name)
    return int(match.group(1)) if match else None


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


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


def write_bytes_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def blake2b_of(path: Path) -> str:
    digest = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def json_bytes(value: Any) -> bytes:
    return (json.dumps(value, indent=1, sort_keys=True) + "\n").encode()


def write_latest(checkpoints_dir: Path, name: str) -> None:
    """Point `latest` at `name` atomically and durably."""
    write_text_atomic(checkpoints_dir / LATEST_NAME, name + "\n")


def read_latest(checkpoints_dir: Path) -> str | None:
    """The directory name `latest` holds, None when there is no `latest` or it names nothing valid."""
    try:
        name = (checkpoints_dir / LATEST_NAME).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):  # missing, a directory, unreadable, not text
        return None
    return name if _DIR_PATTERN.match(name) else None


LATEST_SHOWN_CHARS = 40
"""What a `latest` that names no checkpoint is quoted by, at most (it may hold anything)."""


def latest_name_problem(checkpoints_dir: Path) -> str:
    """Why `latest` names no checkpoint (`read_latest` gave None), in one line: missing, unreadable,
    or what it holds, quoted, is not a checkpoint's name."""
    path = checkpoints_dir / LATEST_NAME
    try:
        text = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return f"{path}: missing"
    except UnicodeDecodeError:
        return f"{path}: not text, so not a checkpoint's name (u and 8 digits)"
    except OSError as error:
        return f"{path}: unreadable ({error.strerror})"
    if not text:
        return f"{path}: empty, so it names no checkpoint"
    shown = json.dumps(text[:LATEST_SHOWN_CHARS]) + ("..." if len(text) > LATEST_SHOWN_CHARS else "")
    return f"{path}: holds {shown}, not a checkpoint's name (u and 8 digits)"


def latest_file_problem(checkpoints_dir: Path) -> str | None:
    """What stops `latest` from being replaced (it is not a regular file), in one line; else None.

    The trainer replaces `latest` by a rename after every checkpoint: over a directory (or
    anything else) that rename fails, so a start refuses it rather than fail after training.
    """
    path = checkpoints_dir / LATEST_NAME
    if not os.path.lexists(path) or (path.is_file() and not path.is_symlink()):
        return None
    kind = "a symbolic link" if path.is_symlink() else "a directory" if path.is_dir() else "not a regular file"
    return f"{path}: {kind}, not the file naming the newest checkpoint; move it away (the checkpoints are kept)"


CHECKPOINT_DISK_MARGIN = 1.5
"""Free disk a checkpoint write needs, as a multiple of its expected size: the trainer does not
start one with less (it would fail half-way), and `nsconsole check` says so before a start."""


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


def no_such_checkpoint(directory: Path) -> str:
    """The one line for a checkpoint directory that is not there (never written, or removed by
    retention), naming the checkpoints its line has instead."""
    available = [path.name for path in list_checkpoints(directory.parent)]
    return f"{directory}: no such checkpoint (the line has {', '.join(available) or 'none'})"


_Accepted = TypeVar("_Accepted")


class NoGoodCheckpoint(CheckpointError):
    """Checkpoints exist, and a start would take none of them (`search_resume_point`)."""

    def __init__(self, checkpoints_dir: Path, problems: list[str]):
        super().__init__(f"{checkpoints_dir}: no good checkpoint: " + "; ".join(problems))
        self.problems = problems
        """What is wrong with `latest` and with each checkpoint, newest first, one line each."""


def search_resume_point(
    checkpoints_dir: Path, accept: Callable[[Path], _Accepted]
) -> tuple[_Accepted | None, list[str]]:
    """How a start picks the checkpoint it resumes from (`engine.checkpoints.tensors.find_resume_point`
    with `accept` loading it): the one `latest` names, or, where that is missing or `accept` raises
    `CheckpointError` on it, the newest before it that `accept` takes. Returns what `accept` gave
    (None: no checkpoint yet) and one line per thing skipped on the way, newest first: `latest`
    naming a missing checkpoint or none, each damaged checkpoint's file and problem. Raises
    `CheckpointError` when checkpoints exist but `accept` takes none of them. Checkers pass a
    cheaper `accept` (the hashes, or only the sizes, `verify_checkpoint`), never a loop of their own."""
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
        problems.append(latest_name_problem(checkpoints_dir))
    for directory in reversed(candidates):
        try:
            return accept(directory), problems
        except CheckpointError as error:
            problems.append(str(error))
    if candidates:
        raise NoGoodCheckpoint(checkpoints_dir, problems)
    return None, problems


def _with_state(directory: Path) -> Path:
    """`directory`, when its state.json reads (what the line's position is read from)."""
    if read_checkpoint_state(directory) is None:
        raise CheckpointError(f"{directory / STATE_NAME}: missing or unreadable (a damaged checkpoint)")
    return directory


def resume_candidate(checkpoints_dir: Path) -> Path | None:
    """The checkpoint a start resumes from, as far as its state.json says (a start's choice,
    `search_resume_point`, taking every checkpoint whose state.json reads; None when there is none).
    What the commands read the line's position from; `sized_resume_point` and
    `verified_resume_point` look further."""
    try:
        return search_resume_point(checkpoints_dir, _with_state)[0]
    except CheckpointError:
        return None


def _sized(directory: Path) -> Path:
    verify_checkpoint(_with_state(directory), hashes=False)
    return directory


def sized_resume_point(checkpoints_dir: Path) -> tuple[Path | None, list[str]]:
    """A start's choice (`search_resume_point`) taking a checkpoint whose state.json reads and whose
    meta.json lists every file at its size (a truncated or missing file, an unreadable meta.json
    are skipped), without hashing them: what `nsconsole status` can afford. A checkpoint corrupted
    at its size is seen by `verify_line_checkpoints` alone. Returns the checkpoint (None: none is
    left) and what was skipped, one line each."""
    try:
        return search_resume_point(checkpoints_dir, _sized)
    except NoGoodCheckpoint as error:
        return None, error.problems


def resume_clause(resumed: Path, latest: str | None) -> str:
    """What a start does where `latest`'s checkpoint is missing or damaged: the checkpoint it
    resumes from instead (`search_resume_point`)."""
    return f"a start resumes from {resumed.name}, the newest" + (" before it" if latest is not None else "")


def no_checkpoint_left_problem(layout: LineLayout) -> str | None:
    """Why a line without a checkpoint to resume from must not start afresh (None: it may): `latest`
    names a checkpoint, or rows.jsonl holds rows, so the line has trained and its checkpoints were
    removed (by hand: retention keeps the line's start and `latest`). A fresh start would cut
    rows.jsonl back to nothing and train the line again from update 0 over data it consumed."""
    if resume_candidate(layout.checkpoints) is not None:
        return None
    latest = read_latest(layout.checkpoints)
    try:
        rows_bytes = layout.rows_jsonl.stat().st_size
    except OSError:
        rows_bytes = 0
    if latest is None and rows_bytes == 0:
        return None
    trained = f"{layout.checkpoints / LATEST_NAME} names {latest}" if latest is not None else (
        f"{layout.rows_jsonl} holds {rows_bytes:,} bytes of rows")
    return (
        f"{layout.checkpoints}: no checkpoint to resume from is left, but the line has trained ({trained}); a fresh "
        "start would erase rows.jsonl and train from update 0 again, so it is refused: put the "
        "checkpoints back, or to start the line over move checkpoints/ and rows.jsonl away"
    )


def branched_from(layout: LineLayout) -> str | None:
    """The line a branch was forked from, None for a trunk: `engine.ops.branch` writes it into the
    state of the branch's first checkpoint, which retention keeps."""
    checkpoints = list_checkpoints(layout.checkpoints)
    if not checkpoints:
        return None
    state = read_checkpoint_state(checkpoints[0]) or {}
    origin = state.get("branched_from")
    if state.get("kept") != BRANCH_START_KEPT or not isinstance(origin, dict):
        return None
    return str(origin["line"]) if isinstance(origin.get("line"), str) else None


def _kept(directory: Path) -> object:
    """The `kept` value recorded in a checkpoint's state.json (None: rolling, or unreadable)."""
    try:
        return json.loads((directory / STATE_NAME).read_text()).get("kept")
    except (OSError, ValueError, AttributeError):
        return None


PINNED_NAME = "pinned"
"""`checkpoints/pinned`: checkpoints retention must keep whatever else happens, one a line: a
checkpoint's name, or a kept reason, `cycle-end N`; a `#` starts a note. Its writers: a supervisor's
rollback pins its target (`u00000030  # rollback`) from the moment it is chosen until the rollback
is done or refused; a supervisor's fork queue pins `cycle-end N` (the end of a cycle a queued branch
forks at) from the moment the branch is queued, before that checkpoint exists, until the branch is
made or fails. Both are a running supervisor's, so a supervisor's start takes back what a killed one
left (`restore_queue_pins`). A checkpoint's name without that note (a user keeping a checkpoint for
good) is kept as it is, and so is a line that is not a pin."""
ROLLBACK_PIN_NOTE = "rollback"
_pins_lock = threading.Lock()  # one process's threads (a supervisor's RPC and fork worker) pin in turn


def _pin_lines(checkpoints_dir: Path) -> list[str]:
    """The pin file's lines, stripped, blank ones left out (none when there is no pin file);
    CheckpointError naming it when it cannot be read: it is not rewritten then, and nothing in it lost."""
    path = checkpoints_dir / PINNED_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    except UnicodeDecodeError:
        raise CheckpointError(f"{path}: not UTF-8 text; make it one pin a line, or remove it") from None
    except OSError as error:
        raise CheckpointError(f"{path}: unreadable ({error.strerror})") from None
    return [line.strip() for line in text.splitlines() if line.strip()]


def _pin_of(line: str) -> str | None:
    """What a line of the pin file pins (a checkpoint's name or `cycle-end N`), None for anything else."""
    pin = line.split("#", 1)[0].strip()
    return pin if _DIR_PATTERN.match(pin) or _CYCLE_END_KEPT.match(pin) else None


def _is_rollback_pin(line: str, name: str | None = None) -> bool:
    """Whether a line of the pin file is `pin_checkpoint`'s (of checkpoint `name`, when given)."""
    pin, _, note = (part.strip() for part in line.partition("#"))
    return note == ROLLBACK_PIN_NOTE and _DIR_PATTERN.match(pin) is not None and name in (None, pin)


def read_pinned(checkpoints_dir: Path) -> set[str]:
    """The pins: checkpoints' names and kept reasons (none when there is no pin file or it is unreadable)."""
    try:
        lines = _pin_lines(checkpoints_dir)
    except CheckpointError:
        return set()
    return {pin for pin in map(_pin_of, lines) if pin is not None}


def pin_file_problems(checkpoints_dir: Path) -> list[str]:
    """What is wrong with the pin file, one line each: unreadable, or lines that pin nothing (a hand
    edit's typo); empty when nothing is."""
    path = checkpoints_dir / PINNED_NAME
    try:
        lines = _pin_lines(checkpoints_dir)
    except CheckpointError as error:
        return [str(error)]
    return [f"{path}: {json.dumps(line)} pins nothing (a pin is a checkpoint's name, u and 8 digits, or "
            "`cycle-end N`); ignored" for line in lines if _pin_of(line) is None]


def _change_pins(
    checkpoints_dir: Path, keep: Callable[[str], bool] | None = None, add: str | None = None
) -> list[str]:
    """Rewrite the pin file atomically with the lines `keep(line)` keeps (all, without it) and `add`
    (unless a line pins it already); returns the lines dropped."""
    with _pins_lock:
        lines = _pin_lines(checkpoints_dir)
        kept = [line for line in lines if keep is None or keep(line)]
        if add is not None and add.split("#", 1)[0].strip() not in map(_pin_of, kept):
            kept.append(add)
        if kept:
            checkpoints_dir.mkdir(parents=True, exist_ok=True)  # a queue may come before the first checkpoint
            write_text_atomic(checkpoints_dir / PINNED_NAME, "".join(f"{line}\n" for line in kept))
        else:
            (checkpoints_dir / PINNED_NAME).unlink(missing_ok=True)
        return [line for line in lines if line not in kept]


def pin_checkpoint(checkpoints_dir: Path, name: str) -> None:
    """Keep checkpoint `name`, a rollback's target, from retention until `unpin_checkpoint`."""
    _change_pins(checkpoints_dir, add=f"{name}  # {ROLLBACK_PIN_NOTE}")


def unpin_checkpoint(checkpoints_dir: Path, name: str) -> None:
    """Take back `pin_checkpoint`'s pin (a pin of the same checkpoint written by hand stays)."""
    _change_pins(checkpoints_dir, keep=lambda line: not _is_rollback_pin(line, name))


def pin_cycle_end(checkpoints_dir: Path, cycle: int) -> None:
    """Keep the kept checkpoint of `cycle`'s end, once it is written, from retention
    (`checkpoints.keep_cycle_ends`) until `unpin_cycle_end`: a queued branch forks there."""
    _change_pins(checkpoints_dir, add=cycle_end_kept(cycle))


def unpin_cycle_end(checkpoints_dir: Path, cycle: int) -> None:
    _change_pins(checkpoints_dir, keep=lambda line: _pin_of(line) != cycle_end_kept(cycle))


def restore_queue_pins(checkpoints_dir: Path, cycles: set[int]) -> list[str]:
    """At a supervisor's start: pin the ends of `cycles` (those its restored fork queue waits for)
    and drop every other `cycle-end N` pin and every rollback's pin; returns the lines dropped.

    Those pins are a running supervisor's alone (no rollback runs and no fork is queued while no
    supervisor runs the line), so one left here was left by a supervisor killed between the pin and
    its end: a fork made at once or queued but never saved in supervisor.json, or a rollback. Kept,
    it would keep its checkpoint from retention for good. Checkpoints' names pinned by hand stay.
    """
    def still_needed(line: str) -> bool:
        cycle = cycle_of_kept(_pin_of(line))
        return not _is_rollback_pin(line) and (cycle is None or cycle in cycles)

    dropped = _change_pins(checkpoints_dir, keep=still_needed)
    for cycle in sorted(cycles):
        pin_cycle_end(checkpoints_dir, cycle)
    return dropped


def apply_retention(
    checkpoints_dir: Path, keep_last: int, abandoned_after: int | None = None, keep_cycle_ends: int | None = None
) -> list[str]:
    """Remove what the retention rule does not keep; returns the removed directory names.

    Kept: the checkpoint `latest` names, the pinned ones (`pin_checkpoint`, `pin_cycle_end`), every checkpoint
    whose state.json has a `kept` reason -- but for those kept as cycle ends alone, only the newest
    `keep_cycle_ends` when it is set -- and the newest `keep_last` rolling ones. Removed: older rolling checkpoints,
    older cycle ends past `keep_cycle_ends` and, when `abandoned_after` is given (the update a
    resume started from), every checkpoint after it other than `latest` -- the continuation that
    resume abandoned (e.g. a corrupted newest one).
    """
    latest = read_latest(checkpoints_dir)
    pinned = read_pinned(checkpoints_dir)
    rolling: list[Path] = []
    cycle_ends: list[Path] = []
    removable: list[Path] = []
    for directory in list_checkpoints(checkpoints_dir):
        update = update_of(directory)
        assert update is not None
        if directory.name in pinned:
            continue
        if directory.name != latest and abandoned_after is not None and update > abandoned_after:
            removable.append(directory)
            continue
        kept = _kept(directory)
        reasons = kept_reasons(kept)
        if pinned.intersection(reasons):
            continue
        if kept is None:
            rolling.append(directory)
        elif reasons and all(_CYCLE_END_KEPT.match(reason) for reason in reasons):
            # Only a cycle end: one that also ends a stage (or has a reason this code does not
            # know) is kept for good.
            cycle_ends.append(directory)
    # `latest` is normally the newest rolling checkpoint and counts among the `keep_last`.
    removable += _older_than_newest(rolling, keep_last, latest)
    if keep_cycle_ends is not None:
        removable += _older_than_newest(cycle_ends, keep_cycle_ends, latest)
    for directory in removable:
        shutil.rmtree(directory, ignore_errors=True)
    return [directory.name for directory in removable]


def _older_than_newest(directories: list[Path], keep: int, latest: str | None) -> list[Path]:
    """Of `directories` (oldest first), all but the newest `keep` and the one `latest` names."""
    older = directories[: max(len(directories) - keep, 0)]
    return [directory for directory in older if directory.name != latest]


def read_checkpoint_state(directory: Path) -> dict[str, Any] | None:
    """A checkpoint's state.json, None when it is missing or unreadable (verify before trusting it)."""
    try:
        state = json.loads((directory / STATE_NAME).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def verify_checkpoint(directory: Path, *, hashes: bool = True) -> None:
    """Check every file against meta.json (present, size, blake2b); raise `CheckpointError` naming it.
    `hashes=False`: present and of its size only, without reading the files (a truncated or missing
    one, not one corrupted at its size)."""
    meta_path = directory / META_NAME
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if not isinstance(meta, dict):
            raise ValueError(f"a JSON {type(meta).__name__}, not an object")
        files = meta["files"]
        if not isinstance(files, dict) or not all(isinstance(entry, dict) for entry in files.values()):
            raise ValueError("files is not an object of {name: {bytes, blake2b}}")
    except FileNotFoundError:
        raise CheckpointError(f"{meta_path}: missing (an incomplete checkpoint)") from None
    except (OSError, ValueError, KeyError, UnicodeDecodeError) as error:
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
        if hashes and blake2b_of(path) != expected.get("blake2b"):
            raise CheckpointError(f"{path}: blake2b mismatch (corrupted)")


def verify_line_checkpoints(line_dir: Path) -> list[str]:
    """Every problem with a line's checkpoints, one line each (empty list: all good)."""
    return checked_line_checkpoints(line_dir)[0]


def checked_line_checkpoints(line_dir: Path) -> tuple[list[str], Path | None]:
    """Every problem with a line's checkpoints, one line each, and the checkpoint a start resumes
    from (None: none), the start's own choice (`search_resume_point`) over these hashes. Where that
    is not the one `latest` names, the last thing the start skips says which it resumes from."""
    checkpoints_dir = Path(line_dir) / "checkpoints"
    problems: list[str] = []
    directories = list_checkpoints(checkpoints_dir)
    latest = read_latest(checkpoints_dir)
    latest_problem = latest_file_problem(checkpoints_dir)
    if latest_problem is not None:
        problems.append(latest_problem)
    elif directories and latest is None:
        problems.append(latest_name_problem(checkpoints_dir))
    elif latest is not None and not (checkpoints_dir / latest).is_dir():
        problems.append(f"{checkpoints_dir / LATEST_NAME}: names {latest}, which is missing")
    damaged: dict[Path, str] = {}
    for directory in directories:
        try:
            verify_checkpoint(directory)
        except CheckpointError as error:
            damaged[directory] = str(error)
    problems += damaged.values()

    def verified(directory: Path) -> Path:
        if directory in damaged:
            raise CheckpointError(damaged[directory])  # hashed once above: a checkpoint can be GiBs
        return directory

    try:
        resumed, skipped = search_resume_point(checkpoints_dir, verified)
    except NoGoodCheckpoint as error:
        resumed, skipped = None, error.problems
    if skipped and skipped[-1] in problems:
        instead = "no good checkpoint before it is left (a start is refused)" if resumed is None else (
            resume_clause(resumed, latest))
        problems[problems.index(skipped[-1])] += f"; {instead}"
    if checkpoints_dir.is_dir():
        problems += [
            f"{path}: an interrupted write (discarded at the next start)"
            for path in sorted(checkpoints_dir.iterdir())
            if path.name.endswith(PARTIAL_SUFFIX)
        ]
    return problems, resumed
