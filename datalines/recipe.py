"""The recipe of a data line: its sources, their shares over tokens, held-out fractions, markers.

The recipe JSON (`nsconsole data init --recipe FILE`):

    {"tokenizer": "tokenizer.json",            # optional; `--tokenizer` overrides it
     "seed": 0,                                # document shuffles and the sample order
     "segments_per_cycle": 8,                  # windows of a source are shuffled within a segment
     "at_corpus_end": "error",                 # or "last_cycle": plan the last cycle where data ends
     "validation_tokens": 1000000,             # per source, from the held-out documents
     "sources": [
       {"name": "web", "kind": "hub", "repo": "org/dataset", "revision": "main", "data_dir": "data",
        "include": ["**/*.parquet"], "text_field": "text", "strata": "subdirs",
        "heldout_fraction": 0.01, "control_markers": ["<|im_start|>", "<|im_end|>"]},
       {"name": "code", "kind": "local", "path": "/data/code", "strata": "files"},
       {"name": "stdlib", "kind": "embedded"}],
     "schedule": [
       {"from_tokens": 0, "shares": {"web": 0.7, "code": 0.3}},
       {"from_tokens": 4e9, "shares": {"web": 0.5, "code": 0.5}}]}

The schedule is append-only: a piece starts on a cycle boundary and applies to every cycle that
starts at or after it, until the next piece.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from datalines.errors import DataLineError
from datalines.files import JSONObject, read_json
from datalines.heldout import DEFAULT_HELDOUT_FRACTION

SOURCE_KINDS = ("hub", "local", "embedded")
STRATA_MODES = ("subdirs", "files")
CORPUS_END_MODES = ("error", "last_cycle")
SHARE_RESOLUTION = 1_000_000
"""Shares are resolved to integer weights of 1e-6 so the sample order is exact integer arithmetic."""

_NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class SourceSpec:
    """One source of a data line, as the recipe declares it."""

    name: str
    """Lower-case name (letters, digits, `_.-`); used in file names and metric names."""
    kind: str
    """`hub` (a Hugging Face dataset repo), `local` (a directory) or `embedded` (Python's stdlib)."""
    location: str = ""
    """The hub repo id (`org/name`) or the local directory (a relative one is taken from the recipe
    file's directory, as its `tokenizer`); empty for `embedded`."""
    revision: str = "main"
    """Hub only: the branch, tag or commit, pinned to its commit sha at init."""
    data_dir: str = ""
    """Hub only: the repo folder holding the data; strata are its subdirectories (or files)."""
    include: tuple[str, ...] = ()
    """Glob patterns of the files to read (relative to the source root); empty: every readable file."""
    text_field: str = "text"
    """The parquet column / jsonl field holding a document's text."""
    strata: str = "subdirs"
    """`subdirs`: a stratum per top-level subdirectory; `files`: a stratum per file."""
    heldout_fraction: float = DEFAULT_HELDOUT_FRACTION
    """The fraction of every file's documents held out (by text hash) and never trained on."""
    control_markers: tuple[str, ...] = ()
    """Strings that encode as the tokenizer's added tokens of the same text (e.g. `<|im_start|>`)."""


@dataclass(frozen=True)
class SharePiece:
    """One piece of the append-only schedule: the shares in force from `from_tokens` on."""

    from_tokens: int
    """The data line's token count at which this piece starts (a multiple of the cycle tokens)."""
    weights: dict[str, int] = field(default_factory=dict)
    """Source name -> integer weight (share x 1e6); sources not named have weight 0."""

    def shares(self) -> dict[str, float]:
        total = sum(self.weights.values())
        return {name: weight / total for name, weight in self.weights.items()}


@dataclass(frozen=True)
class Recipe:
    """Everything a data line is built from, apart from the pins taken at init."""

    sources: tuple[SourceSpec, ...]
    """The sources in recipe order (the order of `DataLine.sources`)."""
    schedule: tuple[SharePiece, ...]
    """Shares over tokens; the first piece starts at 0."""
    seed: int = 0
    """Seeds the document shuffles and the sample order."""
    segments_per_cycle: int = 8
    """Each source's windows are read in a random order within each of these segments of a cycle."""
    at_corpus_end: str = "error"
    """`error`: a source running out raises `SourceExhausted`; `last_cycle`: the last cycle takes the rest."""
    validation_tokens: int = 1_000_000
    """Held-out tokens per source turned into validation rows (split over strata by their shares)."""

    def source(self, name: str) -> SourceSpec:
        for spec in self.sources:
            if spec.name == name:
                return spec
        raise KeyError(name)

    def piece_at(self, tokens: float) -> SharePiece:
        current = self.schedule[0]
        for piece in self.schedule:
            if piece.from_tokens <= tokens:
                current = piece
        return current

    def shares_at(self, tokens: float) -> dict[str, float]:
        shares = self.piece_at(tokens).shares()
        return {spec.name: shares.get(spec.name, 0.0) for spec in self.sources}

    def to_json(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "segments_per_cycle": self.segments_per_cycle,
            "at_corpus_end": self.at_corpus_end,
            "validation_tokens": self.validation_tokens,
            "sources": [_source_to_json(spec) for spec in self.sources],
            "schedule": [
                {
                    "from_tokens": piece.from_tokens,
                    "shares": {name: weight / SHARE_RESOLUTION for name, weight in piece.weights.items()},
                }
                for piece in self.schedule
            ],
        }


def _source_to_json(spec: SourceSpec) -> dict[str, Any]:
    data: dict[str, Any] = {
        "name": spec.name,
        "kind": spec.kind,
        "include": list(spec.include),
        "text_field": spec.text_field,
        "strata": spec.strata,
        "heldout_fraction": spec.heldout_fraction,
        "control_markers": list(spec.control_markers),
    }
    if spec.kind == "hub":
        data["repo"] = spec.location
        data["revision"] = spec.revision
        data["data_dir"] = spec.data_dir
    elif spec.kind == "local":
        data["path"] = spec.location
    return data


class JsonFields:
    """Typed access to one JSON object's fields, each error naming the file and the key path
    (`label`: the object's path in the file; "" for the file's top level)."""

    def __init__(self, data: Any, where: str, label: str) -> None:
        if not isinstance(data, dict):
            raise DataLineError(f"{where}: {label} must be an object")
        self.data, self.where, self.label = data, where, label

    def fail(self, key: str, problem: str) -> DataLineError:
        # A top-level field is named alone (`cycle_tokens`), not `.cycle_tokens`.
        return DataLineError(f"{self.where}: {(self.label + key).lstrip('.')} {problem}")

    def string(self, key: str, default: str | None = None) -> str:
        value = self.data.get(key, default)
        if not isinstance(value, str) or not value:
            raise self.fail(f".{key}", f"must be a non-empty string, got {value!r}")
        return value

    def integer(self, key: str, default: int | None, minimum: int) -> int:
        """The field, an integer >= `minimum`; `default` where it is absent (None: it must be there)."""
        if default is None and key not in self.data:
            raise self.fail(f".{key}", "is missing")
        value = self.data.get(key, default)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.fail(f".{key}", f"must be an integer >= {minimum}, got {value!r}")
        return value

    def mapping(self, key: str) -> dict[str, Any]:
        """The field, a JSON object that must be there."""
        value = self.data.get(key)
        if not isinstance(value, dict):
            raise self.fail(f".{key}", "is missing" if value is None else f"must be an object, got {value!r}")
        return value

    def strings(self, key: str) -> tuple[str, ...]:
        value = self.data.get(key, [])
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
            raise self.fail(f".{key}", f"must be a list of non-empty strings, got {value!r}")
        return tuple(value)

    def choice(self, key: str, default: str, choices: tuple[str, ...]) -> str:
        value = self.data.get(key, default)
        if value not in choices:
            raise self.fail(f".{key}", f"must be one of {', '.join(choices)}, got {value!r}")
        return value


def parse_recipe(data: Any, where: str) -> Recipe:
    """Validate a recipe JSON value; `where` (the file name) starts every error message."""
    top = JsonFields(data, where, "recipe")
    raw_sources = data.get("sources")
    if not isinstance(raw_sources, list) or not raw_sources:
        raise top.fail(".sources", "must be a non-empty list")
    sources = tuple(_parse_source(raw, where, index) for index, raw in enumerate(raw_sources))
    names = [spec.name for spec in sources]
    if len(set(names)) != len(names):
        raise top.fail(".sources", f"names must be unique, got {names}")
    schedule = _parse_schedule(data.get("schedule"), where, names)
    return Recipe(
        sources=sources,
        schedule=schedule,
        seed=top.integer("seed", 0, 0),
        segments_per_cycle=top.integer("segments_per_cycle", 8, 1),
        at_corpus_end=top.choice("at_corpus_end", "error", CORPUS_END_MODES),
        validation_tokens=top.integer("validation_tokens", 1_000_000, 1),
    )


def read_recipe_file(path: Path) -> Any:
    """A recipe file's JSON, refusing a key given twice in one object (one line naming the file and
    the key): JSON keeps the last value without a word, and in a recipe two `shares`, or a source
    with a key given twice, is an edit's mistake (a key added above the one it meant to replace)."""
    document = read_json(path, object_pairs_hook=JSONObject.from_pairs)
    repeated = _repeated_key(document, "")
    if repeated is not None:
        raise DataLineError(f"{path}: key {repeated} appears twice (JSON would keep only the last)")
    return document


def _repeated_key(value: Any, path: str) -> str | None:
    """The path of the first key given twice in `value` (`schedule[0].shares`; a top-level one as
    `recipe.seed`, as the unknown keys are named); None when there is none."""
    if isinstance(value, JSONObject):
        if value.repeated is not None:
            return f"{path or 'recipe'}.{value.repeated}"
        children = [(f"{path}.{key}" if path else key, item) for key, item in value.items()]
    elif isinstance(value, list):
        children = [(f"{path}[{index}]", item) for index, item in enumerate(value)]
    else:
        return None
    return next((found for where, item in children if (found := _repeated_key(item, where)) is not None), None)


RECIPE_FILE_KEYS = ("tokenizer", "seed", "segments_per_cycle", "at_corpus_end", "validation_tokens", "sources",
                    "schedule")
SOURCE_KEYS = ("name", "kind", "include", "text_field", "strata", "heldout_fraction", "control_markers")
SOURCE_KIND_KEYS = {"hub": ("repo", "revision", "data_dir"), "local": ("path",), "embedded": ()}
PIECE_KEYS = ("from_tokens", "shares")


def check_recipe_keys(data: dict[str, Any], where: str) -> None:
    """Refuse a key of a recipe file that nothing reads (a parsed recipe: `parse_recipe` first): a
    misspelt `heldout_fracton` would otherwise leave the default in force without a word."""
    _check_keys(data, RECIPE_FILE_KEYS, where, "recipe", "the recipe's")
    for index, source in enumerate(data["sources"]):
        kind = source["kind"]
        _check_keys(source, SOURCE_KEYS + SOURCE_KIND_KEYS[kind], where, f"sources[{index}]", f"a {kind} source's")
    for index, piece in enumerate(data["schedule"]):
        _check_keys(piece, PIECE_KEYS, where, f"schedule[{index}]", "a schedule piece's")


def _check_keys(data: dict[str, Any], known: tuple[str, ...], where: str, label: str, owner: str) -> None:
    unknown = [key for key in data if key not in known]
    if unknown:
        raise DataLineError(f"{where}: unknown key {label}.{unknown[0]} ({owner} keys: {', '.join(known)})")


def _parse_source(raw: Any, where: str, index: int) -> SourceSpec:
    fields = JsonFields(raw, where, f"sources[{index}]")
    name = fields.string("name")
    if not _NAME_PATTERN.match(name):
        raise fields.fail(
            ".name", f"must be lower-case letters, digits and _.- (it names files), got {name!r}"
        )
    kind = fields.choice("kind", "", SOURCE_KINDS)
    location = ""
    if kind == "hub":
        location = fields.string("repo")
    elif kind == "local":
        location = fields.string("path")
    fraction = raw.get("heldout_fraction", DEFAULT_HELDOUT_FRACTION)
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction < 1:
        raise fields.fail(".heldout_fraction", f"must be a number in [0, 1), got {fraction!r}")
    return SourceSpec(
        name=name,
        kind=kind,
        location=location,
        revision=fields.string("revision", "main") if kind == "hub" else "main",
        data_dir=str(raw.get("data_dir", "")).strip("/") if kind == "hub" else "",
        include=fields.strings("include"),
        text_field=fields.string("text_field", "text"),
        strata=fields.choice("strata", "subdirs", STRATA_MODES),
        heldout_fraction=float(fraction),
        control_markers=fields.strings("control_markers"),
    )


def _parse_schedule(raw: Any, where: str, names: list[str]) -> tuple[SharePiece, ...]:
    if not isinstance(raw, list) or not raw:
        raise DataLineError(f"{where}: recipe.schedule must be a non-empty list of {{from_tokens, shares}}")
    pieces: list[SharePiece] = []
    for index, item in enumerate(raw):
        fields = JsonFields(item, where, f"schedule[{index}]")
        start = item.get("from_tokens")
        if not _is_finite_number(start) or start < 0 or start != int(start):
            raise fields.fail(".from_tokens", f"must be a whole number of tokens >= 0, got {start!r}")
        start = int(start)
        if index == 0 and start != 0:
            raise fields.fail(".from_tokens", f"of the first piece must be 0, got {start}")
        if pieces and start <= pieces[-1].from_tokens:
            raise fields.fail(
                ".from_tokens", f"must grow along the schedule, got {start} after {pieces[-1].from_tokens}"
            )
        shares = item.get("shares")
        if not isinstance(shares, dict) or not shares:
            raise fields.fail(".shares", "must be an object of source name -> share")
        weights: dict[str, int] = {}
        for name, share in shares.items():
            if name not in names:
                raise fields.fail(f".shares.{name}", f"names no source (sources: {', '.join(names)})")
            if not _is_finite_number(share) or share < 0:
                raise fields.fail(f".shares.{name}", f"must be a finite number >= 0, got {share!r}")
            if share > 0:
                weights[name] = round(float(share) * SHARE_RESOLUTION)
        if not weights or min(weights.values()) == 0:
            raise fields.fail(".shares", "must give at least one source a share of 1e-6 or more")
        pieces.append(SharePiece(from_tokens=start, weights=weights))
    return tuple(pieces)


def _is_finite_number(value: Any) -> bool:
    """A JSON number that is a finite float: Python's json reads `NaN`, `Infinity` and `1e400` as
    floats and `1` with 400 zeros as an int, which no share or token count can be (and int() or
    float() of them raises)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def with_paths_from(recipe: Recipe, directory: Path) -> Recipe:
    """The recipe with each local source's relative `path` taken from `directory` (the recipe
    file's, as its `tokenizer`), not from wherever the command runs."""
    sources = tuple(
        replace(spec, location=str((directory / spec.location).absolute()))
        if spec.kind == "local" and not Path(spec.location).expanduser().is_absolute()
        else spec
        for spec in recipe.sources
    )
    return replace(recipe, sources=sources)


def check_schedule_on_cycles(recipe: Recipe, cycle_tokens: int, where: str) -> None:
    """Every schedule piece must start on a cycle boundary (a cycle has one set of shares)."""
    for index, piece in enumerate(recipe.schedule):
        if piece.from_tokens % cycle_tokens:
            raise DataLineError(
                f"{where}: schedule[{index}].from_tokens {piece.from_tokens} is not a multiple of the "
                f"cycle tokens {cycle_tokens}"
            )
