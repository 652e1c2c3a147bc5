"""A data line on disk and the API the trainer uses: `open_data_line(path) -> DataLine`.

Layout of a data line directory:

    dataline.json          the recipe, every input pinned, calibration, tokenizer pin
    tokenizer.json         the tokenizer (sha256 pinned in dataline.json)
    plans/cNNNN.json       each cycle's plan (documents of every file it takes), permanent
    cycles/cNNNN/          manifest.json (permanent) + <source>.tokens / <source>.docs shards
    cycles/cNNNN/consumed  the trainer is done with the cycle; the preparer deletes its shards
    val/T<seq_len>/        validation rows per source (`nsconsole data val`)
    downloads/<source>/    hub files being read (deleted once every cycle reading them is prepared)
    preparer.json          the preparer's status (read by the supervisor)
    training_line.json     the training line that trains on it: the first to start (datalines.consumption)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from datalines.cycle import Cycle
from datalines.errors import DataLineError, InputChanged
from datalines.files import fsync_directory, read_json, sha256_bytes, write_bytes_atomic
from datalines.manifest import (
    CONSUMED_MARK,
    MANIFEST_NAME,
    ShardStamps,
    load_manifest,
    manifest_placed,
    shard_files,
    shard_stamps,
    verify_shards,
)
from datalines.recipe import JsonFields, Recipe, parse_recipe
from datalines.sources import Source, open_source
from datalines.tokenizer import PlainTextTokenizer

CONFIG_NAME = "dataline.json"
TOKENIZER_NAME = "tokenizer.json"
TRAINING_LINE_RECORD = "training_line.json"
CONFIG_FORMAT = 1
CONFIG_FIX = (
    "restore {path} as it was (a backup, or the copy in any data line made from it with `data init --like`): "
    "only `nsconsole data schedule` changes it, appending to its schedule"
)
"""How to recover from a dataline.json that no longer reads or changed by hand (a clause of a one-line error)."""


class DataLine:
    """An initialised data line; see the module docstring for its files."""

    def __init__(self, path: Path) -> None:
        self.path = path
        config_path = path / CONFIG_NAME
        self._config_stamp = _file_stamp(config_path)
        try:
            self._read_config(config_path)
        except DataLineError as error:
            if not config_path.is_file():
                raise  # no data line here: nothing to restore
            raise InputChanged(str(error), CONFIG_FIX.format(path=config_path)) from None
        self.sources: list[str] = [spec.name for spec in self.recipe.sources]
        tokenizer_path = path / TOKENIZER_NAME
        tokenizer_fix = (f"restore {tokenizer_path}, the tokenizer the data line was made with (its sha256 is "
                         f"pinned in {CONFIG_NAME})")  # fmt: skip
        try:
            self.tokenizer_json: str = tokenizer_path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:  # not UTF-8: damaged, as the sha256 would say
            raise InputChanged(f"{tokenizer_path}: cannot be read ({error})", tokenizer_fix) from None
        self.tokenizer_sha256 = sha256_bytes(self.tokenizer_json.encode("utf-8"))
        if self.tokenizer_sha256 != self._tokenizer_pin_sha256:
            raise InputChanged(
                f"{tokenizer_path}: sha256 differs from the pin in {CONFIG_NAME} (changed since init)", tokenizer_fix
            )
        self._tokenizer: PlainTextTokenizer | None = None
        self._sources: dict[str, Source] = {}
        self._verified: dict[int, tuple[str, ShardStamps]] = {}
        """Cycle -> (manifest sha256, shard stamps) when its shards' hashes were last found right."""
        self._damaged: dict[int, tuple[str, ShardStamps, str]] = {}
        """Cycle -> (manifest sha256, shard stamps, the problem) when they were last found wrong:
        a waiting process looks again every few seconds, and hashes again only what moved."""

    def _read_config(self, config_path: Path) -> None:
        """Read dataline.json: the recipe, EOS, cycle size, calibration, pins and the tokenizer's pin."""
        config = read_json(config_path)
        where = str(config_path)
        if not isinstance(config, dict) or config.get("format") != CONFIG_FORMAT:
            raise DataLineError(f"{where}: not a data line config of format {CONFIG_FORMAT}")
        # Each field read typed: a wrong one (edited by hand) is named with what it must be.
        fields = JsonFields(config, where, "")
        tokenizer = JsonFields(fields.mapping("tokenizer"), where, "tokenizer")
        self.config: dict[str, Any] = config
        self.recipe: Recipe = parse_recipe(config.get("recipe"), where)
        self.eos_id: int = fields.integer("eos_id", None, 0)
        self.cycle_tokens: int = fields.integer("cycle_tokens", None, 1)
        self.calibration: dict[str, dict[str, dict[str, float]]] = fields.mapping("calibration")
        self._pins: dict[str, dict[str, Any]] = fields.mapping("pins")
        self._tokenizer_pin_sha256 = tokenizer.string("sha256")
        self.vocab_size: int = tokenizer.integer("vocab_size", None, 1)

    def refresh_recipe(self) -> bool:
        """Take up a schedule grown since this line was opened: `data schedule` appends a piece to
        dataline.json while a preparer or a trainer runs for weeks on the line, and a cycle planned
        after it must get the new shares. True when the recipe changed. A dataline.json changed in
        anything but its schedule's end is refused (DataLineError), the line as it was kept."""
        config_path = self.path / CONFIG_NAME
        stamp = _file_stamp(config_path)
        if stamp == self._config_stamp:
            return False
        fix = CONFIG_FIX.format(path=config_path)
        try:
            config = read_json(config_path)
            where = str(config_path)
            if not isinstance(config, dict) or not isinstance(config.get("recipe"), dict):
                raise DataLineError(f"{where}: not a data line config of format {CONFIG_FORMAT}")
            recipe = parse_recipe(config["recipe"], where)
        except DataLineError as error:
            raise InputChanged(str(error), fix) from None
        schedule, grown = self.config["recipe"]["schedule"], config["recipe"].get("schedule")
        if (_without_schedule(config) != _without_schedule(self.config) or not isinstance(grown, list)
                or grown[: len(schedule)] != schedule):
            raise InputChanged(
                f"{where}: changed in more than its schedule's end since {self.path} was opened "
                f"(only `nsconsole data schedule` changes a data line's config; restore it)",
                fix,
            )
        changed = recipe != self.recipe
        self.config, self.recipe, self._config_stamp = config, recipe, stamp
        return changed

    # --- inputs ---------------------------------------------------------------------------
    @property
    def tokenizer(self) -> PlainTextTokenizer:
        if self._tokenizer is None:
            self._tokenizer = PlainTextTokenizer(self.tokenizer_json, str(self.path / TOKENIZER_NAME))
        return self._tokenizer

    def source(self, name: str) -> Source:
        if name not in self._sources:
            self._sources[name] = open_source(self.recipe.source(name), self.path, self._pins[name])
        return self._sources[name]

    # --- shares and cycles ----------------------------------------------------------------
    def shares(self, at_tokens: float) -> dict[str, float]:
        """The recipe shares in force at that token count of the line."""
        return self.recipe.shares_at(at_tokens)

    def cycle_start_tokens(self, index: int) -> int:
        """The line's token count at the start of cycle `index` (cycles are `cycle_tokens` long nominally)."""
        return index * self.cycle_tokens

    def cycle_dir(self, index: int) -> Path:
        return self.path / "cycles" / f"c{index:04d}"

    def is_consumed(self, index: int) -> bool:
        return (self.cycle_dir(index) / CONSUMED_MARK).exists()

    def reopen(self, index: int) -> bool:
        """Clear a cycle's consumed mark (a rollback trains it again); False when it was not consumed.

        The manifest is permanent, so the preparer rebuilds the cycle's deleted shards from it and
        checks them byte for byte: the line reads exactly the samples it read before.
        """
        directory = self.cycle_dir(index)
        try:
            (directory / CONSUMED_MARK).unlink()
        except FileNotFoundError:
            return False
        fsync_directory(directory)
        return True

    def cycle_ready(self, index: int) -> bool:
        """Prepared and complete: the manifest exists and every shard matches it."""
        return self.cycle_problem(index) is None

    def cycle_problem(self, index: int) -> str | None:
        """Why cycle `index` cannot be read now (not prepared, consumed, its manifest damaged, shards
        missing or damaged: the message names every such file); None when it is ready.

        Hashes are checked again whenever a shard's stamp (inode, size, times) moved since the last
        check, so a shard damaged or rewritten after a first check is seen by the next look of a
        long-lived process (the preparer, the trainer waiting for it) at the cost of a stat."""
        directory = self.cycle_dir(index)
        if self.is_consumed(index):
            return f"{directory}: cycle {index} was consumed"
        if not manifest_placed(directory):
            return f"{directory}: cycle {index} is not prepared yet"
        try:
            self._verify(index)
        except DataLineError as error:
            return str(error)
        return None

    def _verify(self, index: int) -> tuple[dict[str, Any], str, ShardStamps]:
        directory = self.cycle_dir(index)
        manifest, manifest_sha = load_manifest(directory)
        stamps = shard_stamps(directory, manifest)
        if self._verified.get(index) == (manifest_sha, stamps):
            return manifest, manifest_sha, stamps
        self._verified.pop(index, None)
        damaged = self._damaged.get(index)
        if damaged is not None and damaged[:2] == (manifest_sha, stamps):
            raise DataLineError(damaged[2])
        try:
            verify_shards(directory, manifest)
        except DataLineError as error:
            self._damaged[index] = (manifest_sha, stamps, str(error))
            raise
        self._damaged.pop(index, None)
        self._verified[index] = (manifest_sha, stamps)
        return manifest, manifest_sha, stamps

    def cycle(self, index: int, verify: bool = True) -> Cycle:
        """The prepared cycle; DataLineError if it is not prepared, incomplete or already consumed.

        `verify=False` checks the manifest only (a resume compares it with its checkpoint's before
        the shards are there again); such a cycle hashes its shards at its first `verify_unchanged`.
        """
        directory = self.cycle_dir(index)
        if self.is_consumed(index):
            raise DataLineError(f"{directory}: cycle {index} was consumed and its shards deleted")
        if not manifest_placed(directory):
            raise DataLineError(f"{directory}: cycle {index} is not prepared yet")
        if not verify:
            manifest, manifest_sha = load_manifest(directory)
            return Cycle(directory, manifest, manifest_sha, self.recipe.segments_per_cycle)
        manifest, manifest_sha, stamps = self._verify(index)
        return Cycle(directory, manifest, manifest_sha, self.recipe.segments_per_cycle, stamps)

    def last_cycle(self) -> int | None:
        """The final cycle once planning has reached the corpus end; None while it is not known."""
        plans = self.path / "plans"
        if not plans.is_dir():
            return None
        for path in sorted(plans.glob("c[0-9][0-9][0-9][0-9].json")):
            if read_json(path).get("last"):
                return int(path.stem[1:])
        return None

    def cycle_state(self, index: int) -> str:
        """`consumed`, `ready`, `empty`, `reopened`, `damaged`, `planned` or `unplanned`.

        `reopened`: the manifest is kept and none of its shards is there: a consumed cycle (its
        shards deleted) that a rollback reopened, which the preparer rebuilds byte for byte from the
        manifest. `damaged`: the manifest is kept, some shards are missing or wrong (the preparer
        rebuilds those too). `empty`: prepared, but a source
        with a share in it has not one token and its target, so no trainer can read it; the planner
        never plans such a cycle, but a line planned by an older nsconsole may hold one, and it must
        not pass for ready.
        """
        if self.is_consumed(index):
            return "consumed"
        directory = self.cycle_dir(index)
        if manifest_placed(directory):
            if not self.cycle_ready(index):
                try:
                    manifest, _sha256 = load_manifest(directory)
                except DataLineError:
                    return "damaged"
                present = [entry["name"] for entry in shard_files(manifest) if (directory / entry["name"]).exists()]
                return "damaged" if present else "reopened"
            cycle = self.cycle(index)
            weighted = [name for name in cycle.source_names if cycle.manifest["sources"][name]["weight"]]
            return "empty" if any(cycle.windows(name, 1) == 0 for name in weighted) else "ready"
        return "planned" if (self.path / "plans" / f"c{index:04d}.json").is_file() else "unplanned"

    def known_cycles(self) -> list[int]:
        """Every cycle planned or prepared so far."""
        names = [path.stem for path in (self.path / "plans").glob("c[0-9][0-9][0-9][0-9].json")]
        names += [path.name for path in (self.path / "cycles").glob("c[0-9][0-9][0-9][0-9]")]
        return sorted({int(name[1:]) for name in names})

    def mark_consumed(self, index: int, by: str | os.PathLike[str] | None = None) -> None:
        """The trainer is done with the cycle: the preparer deletes its shards (the manifest stays).
        `by`: the training line that consumed it, recorded in the mark (datalines.consumption)."""
        from datalines.consumption import consumed_mark  # it imports this module

        directory = self.cycle_dir(index)
        if not (directory / MANIFEST_NAME).is_file():
            raise DataLineError(f"{directory}: cycle {index} was never prepared, cannot mark it consumed")
        write_bytes_atomic(directory / CONSUMED_MARK, consumed_mark(by))

    # --- validation -----------------------------------------------------------------------
    def validation_dir(self, seq_len: int) -> Path:
        return self.path / "val" / f"T{seq_len}"

    def validation_rows(self, seq_len: int) -> dict[str, np.ndarray]:
        """Source -> (rows, seq_len + 1) int32 held-out rows, as `nsconsole data val` built them."""
        directory = self.validation_dir(seq_len)
        index_path = directory / "index.json"
        if not index_path.is_file():
            raise DataLineError(
                f"{index_path}: no validation rows of length {seq_len}; "
                f"run `nsconsole data val --work {self.path} --seq-len {seq_len}`"
            )
        index = read_json(index_path)
        rows: dict[str, np.ndarray] = {}
        for name, entry in index["sources"].items():
            path = directory / entry["name"]
            try:
                data = path.read_bytes()
            except OSError as error:
                raise DataLineError(f"{path}: validation rows cannot be read ({error})") from None
            if sha256_bytes(data) != entry["sha256"]:
                raise DataLineError(f"{path}: validation rows differ from {index_path} (corrupted)")
            rows[name] = np.frombuffer(data, dtype="<i4").reshape(entry["rows"], seq_len + 1).astype(np.int32)
        return rows

    def validation_weights(self, at_tokens: float = 0.0) -> dict[str, float]:
        """Recipe weights of the sources for val_<L>/mix (the shares in force at `at_tokens`, with
        the schedule as `data schedule` left it: a trainer opens the line once for weeks)."""
        self.refresh_recipe()
        return {name: share for name, share in self.shares(at_tokens).items() if share > 0}


def _without_schedule(config: dict[str, Any]) -> dict[str, Any]:
    recipe = {key: value for key, value in config["recipe"].items() if key != "schedule"}
    return {**config, "recipe": recipe}


def _file_stamp(path: Path) -> tuple[int, int, int] | None:
    """What changes when a file is replaced or rewritten (inode, size, mtime); None when it is missing."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return (stat.st_ino, stat.st_size, stat.st_mtime_ns)


def open_data_line(path: str | os.PathLike[str]) -> DataLine:
    """Open an initialised data line; DataLineError naming the file when something is wrong."""
    return DataLine(Path(path))
