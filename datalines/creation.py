"""`data init`: create a data line from a recipe, or the embedded demo line from Python's stdlib.

Init pins every input (hub commit shas, every file's sha256, the tokenizer's sha256), measures
the calibration and writes `tokenizer.json` and then `dataline.json` (last: its presence marks
a finished init). Nothing is written when a check fails.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from datalines.calibration import calibrate_source
from datalines.corpus import file_documents
from datalines.dataline import CONFIG_FORMAT, CONFIG_NAME, TOKENIZER_NAME, DataLine
from datalines.errors import DataLineError
from datalines.files import read_json, write_bytes_atomic, write_json_atomic
from datalines.planning import ensure_plan
from datalines.recipe import Recipe, check_schedule_on_cycles, parse_recipe
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


def _check_init_arguments(work: Path, cycle_tokens: int) -> None:
    """Refuse, before anything is read or trained, a line that exists or a cycle size that cannot be."""
    if (work / CONFIG_NAME).exists():
        raise DataLineError(f"{work / CONFIG_NAME}: a data line already exists here; choose another --work")
    if cycle_tokens < 1:
        raise DataLineError(f"--cycle-tokens must be >= 1, got {cycle_tokens}")


def _write_line(
    work: Path,
    recipe: Recipe,
    tokenizer: PlainTextTokenizer,
    eos_id: int,
    cycle_tokens: int,
    opened: dict[str, Source] | None = None,
) -> DataLine:
    """Pin (sources in `opened` are already pinned), calibrate and write the line's files."""
    if not 0 <= eos_id < tokenizer.vocab_size:
        raise DataLineError(
            f"{tokenizer.where}: --eos-id {eos_id} is outside the vocab of {tokenizer.vocab_size}"
        )
    check_schedule_on_cycles(recipe, cycle_tokens, "recipe")
    work.mkdir(parents=True, exist_ok=True)
    pins: dict[str, Any] = {}
    calibration: dict[str, Any] = {}
    for spec in recipe.sources:
        tokenizer.marker_ids(spec.control_markers)
        source = (opened or {}).get(spec.name) or open_source(spec, work, None)
        pins[spec.name] = source.pins
        calibration[spec.name] = calibrate_source(source, tokenizer, recipe.seed)
    write_bytes_atomic(work / TOKENIZER_NAME, tokenizer.json_text.encode("utf-8"))
    write_json_atomic(
        work / CONFIG_NAME,
        {
            "format": CONFIG_FORMAT,
            "eos_id": eos_id,
            "cycle_tokens": cycle_tokens,
            "tokenizer": {"sha256": tokenizer.sha256, "vocab_size": tokenizer.vocab_size},
            "recipe": recipe.to_json(),
            "pins": pins,
            "calibration": calibration,
        },
    )
    return DataLine(work)


def init_data_line(
    work: Path, recipe_file: Path, eos_id: int, cycle_tokens: int, tokenizer_file: Path | None
) -> DataLine:
    """Create a data line from a recipe JSON file (see `datalines.recipe` for the format)."""
    _check_init_arguments(work, cycle_tokens)
    raw = read_json(recipe_file)
    recipe = parse_recipe(raw, str(recipe_file))
    if tokenizer_file is None:
        named = raw.get("tokenizer")
        if not isinstance(named, str):
            raise DataLineError(f"{recipe_file}: recipe.tokenizer is not set and no --tokenizer was given")
        tokenizer_file = (recipe_file.parent / named).resolve()
    return _write_line(work, recipe, load_tokenizer(tokenizer_file), eos_id, cycle_tokens)


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
