"""`data init`: create a data line from a recipe, or the embedded demo line from Python's stdlib.

Init pins every input (hub commit shas, every file's sha256, the tokenizer's sha256), measures
the calibration and writes `tokenizer.json` and then `dataline.json` (last: its presence marks
a finished init). Nothing is written when a check fails.

The tokenizer is `--tokenizer`, else the recipe's, else the host's default (host.json
`tokenizer`). With `calibration_from` (`--calibration-from`, else host.json's) naming another data
line, a source whose pins (the same files), tokenizer, strata and control markers equal that
line's takes that line's calibration instead of measuring it again (for a hub source, measuring
reads its strata's first files), so lines on the same data plan with the same rates; dataline.json
records which sources took it from where.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from datalines.calibration import calibrate_source, stratum_tokens
from datalines.corpus import file_documents
from datalines.dataline import CONFIG_FORMAT, CONFIG_NAME, TOKENIZER_NAME, DataLine
from datalines.errors import DataLineError
from datalines.files import read_json, write_bytes_atomic, write_json_atomic
from datalines.planning import ensure_plan
from datalines.recipe import (
    Recipe,
    check_recipe_keys,
    check_schedule_on_cycles,
    parse_recipe,
    read_recipe_file,
    with_paths_from,
)
from datalines.sources import Source, open_source
from datalines.tokenizer import EMBEDDED_EOS_TOKEN, PlainTextTokenizer, load_tokenizer, train_byte_level_bpe

EMBEDDED_VOCAB = 8192
EMBEDDED_CYCLE_TOKENS = 1_000_000
EMBEDDED_RECIPE: dict[str, Any] = {
    "seed": 0,
    "segments_per_cycle": 8,
    "at_corpus_end": "last_cycle",
    "validation_tokens": 200_000,
    # 2 % rather than 1 %: the stdlib is small, and validation needs some tens of thousands of tokens.
    "sources": [{"name": "stdlib", "kind": "embedded", "heldout_fraction": 0.02}],
    "schedule": [{"from_tokens": 0, "shares": {"stdlib": 1.0}}],
}


def check_new_work(work: Path) -> None:
    """Refuse a --work where no new data line can be made: one is there already, or it (or the
    closest of its parents that exists) is a file, which making the directory would fail on."""
    if (work / CONFIG_NAME).exists():
        raise DataLineError(f"{work / CONFIG_NAME}: a data line already exists here; choose another --work")
    existing = next(path for path in (work, *work.parents) if path.exists())
    if not existing.is_dir():
        raise DataLineError(f"{existing}: not a directory, so --work {work} cannot be made; choose another --work")


def _check_init_arguments(work: Path, cycle_tokens: int) -> None:
    """Refuse, before anything is read or trained, a line that exists or a cycle size that cannot be."""
    check_new_work(work)
    if cycle_tokens < 1:
        raise DataLineError(f"--cycle-tokens must be >= 1, got {cycle_tokens}")


@contextmanager
def nothing_left_on_failure(work: Path) -> Iterator[None]:
    """A failed init takes away what it made: pinning and calibrating a hub source download files
    (each stratum's first ones: gigabytes on a real dataset) into `work`, and a refusal after that
    left them in a directory no line owns; `--like` writes dataline.json before it plans, and one
    left behind refuses the retry. A directory the user made stays, with what was in it."""
    before = set(os.listdir(work)) if work.is_dir() else None
    try:
        yield
    except BaseException:
        if before is None:
            shutil.rmtree(work, ignore_errors=True)
        else:
            for name in set(os.listdir(work)) - before:
                _remove(work / name)
        raise


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _write_line(
    work: Path,
    recipe: Recipe,
    tokenizer: PlainTextTokenizer,
    eos_id: int,
    cycle_tokens: int,
    opened: dict[str, Source] | None = None,
    calibration_from: Path | None = None,
) -> DataLine:
    """Pin (sources in `opened` are already pinned), calibrate (or reuse `calibration_from`'s) and
    write the line's files."""
    if not 0 <= eos_id < tokenizer.vocab_size:
        raise DataLineError(
            f"{tokenizer.where}: --eos-id {eos_id} is outside the vocab of {tokenizer.vocab_size}"
        )
    check_schedule_on_cycles(recipe, cycle_tokens, "recipe")
    other = _calibrated_line(calibration_from) if calibration_from is not None else None
    work.mkdir(parents=True, exist_ok=True)
    pins: dict[str, Any] = {}
    calibration: dict[str, Any] = {}
    reused: list[str] = []
    opened_sources: dict[str, Source] = {}
    for spec in recipe.sources:
        tokenizer.marker_ids(spec.control_markers)
        source = (opened or {}).get(spec.name) or open_source(spec, work, None)
        opened_sources[spec.name] = source
        pins[spec.name] = source.pins
        taken = _reusable_calibration(other, source, tokenizer) if other is not None else None
        if taken is not None:
            calibration[spec.name] = taken
            reused.append(spec.name)
        else:
            calibration[spec.name] = calibrate_source(source, tokenizer, recipe.seed)
    if recipe.at_corpus_end == "error":
        _check_a_cycle_fits(recipe, cycle_tokens, opened_sources, calibration)
    config: dict[str, Any] = {
        "format": CONFIG_FORMAT,
        "eos_id": eos_id,
        "cycle_tokens": cycle_tokens,
        "tokenizer": {"sha256": tokenizer.sha256, "vocab_size": tokenizer.vocab_size},
        "recipe": recipe.to_json(),
        "pins": pins,
        "calibration": calibration,
    }
    if reused:
        config["calibration_from"] = {"line": str(calibration_from), "sources": reused}
    write_bytes_atomic(work / TOKENIZER_NAME, tokenizer.json_text.encode("utf-8"))
    write_json_atomic(work / CONFIG_NAME, config)
    return DataLine(work)


CYCLE_FIT_MARGIN = 1.25
"""A source is refused at init when even this many times its estimated tokens fall short of its
share of one cycle (estimates are off by some percent: EOS tokens, strata measured on their first files)."""


def _check_a_cycle_fits(
    recipe: Recipe, cycle_tokens: int, sources: dict[str, Source], calibration: dict[str, Any]
) -> None:
    """In `at_corpus_end: error` mode, refuse a cycle size that a source cannot fill even once (a
    local corpus under a cycle of 2e10): the preparer would wait for disk for shards of a cycle that
    could never be planned, then stop with `SourceExhausted`."""
    for name, share in recipe.shares_at(0).items():
        spec = recipe.source(name)
        tokens = sum(stratum_tokens(sources[name], calibration[name]).values()) * (1 - spec.heldout_fraction)
        target = cycle_tokens * share
        if share > 0 and tokens * CYCLE_FIT_MARGIN < target:
            raise DataLineError(
                f"--cycle-tokens {cycle_tokens:,}: source {name} holds about {tokens:,.0f} tokens to train on "
                f"(its files' bytes at its calibrated rates), short of its share of one cycle ({target:,.0f} "
                f"at {share:.3g}); choose a smaller --cycle-tokens, or `\"at_corpus_end\": \"last_cycle\"` in the "
                f"recipe to end the line where its data ends"
            )


def _calibrated_line(path: Path) -> dict[str, Any]:
    """The dataline.json of the line `path` names (its directory or that file), to reuse its calibration."""
    config_path = path if path.name == CONFIG_NAME else path / CONFIG_NAME
    config = read_json(config_path)
    if not isinstance(config, dict) or not all(
        isinstance(config.get(key), dict) for key in ("pins", "calibration", "tokenizer", "recipe")
    ):
        raise DataLineError(f"{config_path}: not a data line's config (calibration_from)")
    return config


def _reusable_calibration(
    other: dict[str, Any], source: Source, tokenizer: PlainTextTokenizer
) -> dict[str, Any] | None:
    """The other line's calibration of this source when it measured the same thing: the same
    files (pins), tokenizer, strata and control markers; else None (measure it here)."""
    name = source.spec.name
    specs = {spec.get("name"): spec for spec in other["recipe"].get("sources", []) if isinstance(spec, dict)}
    calibration = other["calibration"].get(name)
    same = (
        _without_times(other["pins"].get(name)) == _without_times(source.pins)
        and other["tokenizer"].get("sha256") == tokenizer.sha256
        and isinstance(calibration, dict)
        and set(calibration) == set(source.strata())
        and list(specs.get(name, {}).get("control_markers", [])) == list(source.spec.control_markers)
    )
    return calibration if same else None


def _without_times(pins: Any) -> Any:
    """A source's pins without the files' modification times: a file touched, or copied back, holds
    the same bytes (its sha256 says so), and a line pinned before times were recorded has none."""
    if not isinstance(pins, dict) or not isinstance(pins.get("files"), list):
        return pins
    files = [{key: value for key, value in file.items() if key != "mtime_ns"} if isinstance(file, dict) else file
             for file in pins["files"]]  # fmt: skip
    return {**pins, "files": files}


def init_data_line(
    work: Path,
    recipe_file: Path,
    eos_id: int,
    cycle_tokens: int,
    tokenizer_file: Path | None,
    default_tokenizer: Path | None = None,
    calibration_from: Path | None = None,
) -> DataLine:
    """Create a data line from a recipe JSON file (see `datalines.recipe` for the format): the
    tokenizer is `tokenizer_file`, else the recipe's, else `default_tokenizer` (the host's)."""
    _check_init_arguments(work, cycle_tokens)
    raw = read_recipe_file(recipe_file)
    recipe = with_paths_from(parse_recipe(raw, str(recipe_file)), recipe_file.parent)
    check_recipe_keys(raw, str(recipe_file))
    if tokenizer_file is None:
        named = raw.get("tokenizer")
        if isinstance(named, str):
            tokenizer_file = (recipe_file.parent / named).resolve()
        elif default_tokenizer is not None:
            tokenizer_file = default_tokenizer
        else:
            raise DataLineError(
                f"{recipe_file}: recipe.tokenizer is not set, no --tokenizer was given and host.json names none"
            )
    tokenizer = load_tokenizer(tokenizer_file)
    with nothing_left_on_failure(work):
        return _write_line(work, recipe, tokenizer, eos_id, cycle_tokens, calibration_from=calibration_from)


def init_embedded_line(work: Path, cycle_tokens: int = EMBEDDED_CYCLE_TOKENS) -> DataLine:
    """The demo line: the stdlib's sources, a BPE trained on them now, cycles of `cycle_tokens`.

    Every cycle is planned at once (the corpus is local and small), so `last_cycle()` is known
    from the start and the demo finishes cleanly where the corpus ends.
    """
    _check_init_arguments(work, cycle_tokens)
    recipe = parse_recipe(EMBEDDED_RECIPE, "embedded recipe")
    spec = recipe.sources[0]
    source = open_source(spec, work, None)
    training_texts = (
        text for file in source.files for text in file_documents(source, file, recipe.seed).training
    )
    tokenizer_json = train_byte_level_bpe(training_texts, EMBEDDED_VOCAB, [EMBEDDED_EOS_TOKEN])
    tokenizer = PlainTextTokenizer(tokenizer_json, "embedded tokenizer")
    eos_id = tokenizer.full.token_to_id(EMBEDDED_EOS_TOKEN)
    line = _write_line(work, recipe, tokenizer, eos_id, cycle_tokens, {spec.name: source})
    index = 0
    while not ensure_plan(line, index)["last"]:
        index += 1
    return line
