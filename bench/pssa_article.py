"""The PSSA article's comparison, reproduced through the project's own lines, in one command.

Both 1.5M models (`pssa-1.5m`, 1,544,704 parameters; `transformer-1.5m`, 1,541,120) train on the
same tokens in the same order: a byte-level BPE of vocab 2048 trained on the corpus's training
documents, a data line from one recipe and a second one made identical to it (`data init --like`:
a data line is consumed by the line that trains on it; the two lines' cycle manifests and
held-out rows are checked byte for byte here), 512 target tokens per update (8 rows of 64), AdamW
at lr 0.003 along a 30,000-update cosine without warm-up (the article's; a shorter --tokens trains
its start), betas (0.9, 0.999), weight decay 0.01, clip 1.0, the same seed for the weights and the
sample order. Each line runs `nsconsole run LINE --no-supervisor` on the CPU, one after the other
in this invocation (the same machine state; concurrent runs would share the cores and time each
other's contention). The article trained on WikiText-103; without a network the default corpus is
Python's standard library (the demo line's), or --corpus DIR (a directory of .txt, .jsonl or
.parquet documents, e.g. WikiText-103 exported).

Prints one JSON row per model: training cross-entropy at each 10 % of the tokens (the mean over
that tenth's updates), held-out cross-entropy at the end (`val_64/mix`: every held-out row of the
data line, validated once after the last update), tokens/s (the tokens over the updates' own time:
forward, backward and AdamW, without validation and checkpoints), and a last row comparing them.
The article: PSSA 1,716 vs 415 tokens/s on 2 vCPUs (4.1x), held-out 3.997 vs 4.429 after 12.7M
tokens.

    python bench/pssa_article.py [--tokens 12.7e6] [--seed 42] [--out DIR] [--corpus DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# The repository root first: run as a script, bench/ would lead sys.path and its kernels.py
# would shadow the kernels package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from datalines.corpus import file_documents  # noqa: E402
from datalines.creation import init_data_line  # noqa: E402
from datalines.dataline import DataLine  # noqa: E402
from datalines.errors import DataLineError  # noqa: E402
from datalines.identical import init_like_line  # noqa: E402
from datalines.planning import ensure_plan  # noqa: E402
from datalines.preparer import prepare_cycle  # noqa: E402
from datalines.recipe import parse_recipe  # noqa: E402
from datalines.sources import open_source  # noqa: E402
from datalines.tokenizer import EMBEDDED_EOS_TOKEN, train_byte_level_bpe  # noqa: E402
from datalines.validation import build_validation  # noqa: E402
from engine.config.run import RunConfig  # noqa: E402
from engine.errors import LineError  # noqa: E402
from engine.models.presets import preset_names  # noqa: E402
from engine.ops.new import NewLineOptions, new_line  # noqa: E402

MODELS = ("pssa-1.5m", "transformer-1.5m")
VOCAB, CHUNK, ROWS = 2048, 64, 8
TOKENS_PER_UPDATE = CHUNK * ROWS
COSINE_UPDATES = 30_000
ARTICLE_TOKENS = 12_700_000
CYCLE_TOKENS = 1_000_000
ARTICLE = {
    "pssa-1.5m": {"tokens_per_s": 1716, "heldout_ce": 3.997},
    "transformer-1.5m": {"tokens_per_s": 415, "heldout_ce": 4.429},
}


class BenchError(Exception):
    """A run that cannot be made as asked (one line)."""


def recipe(args: argparse.Namespace) -> dict[str, Any]:
    if args.corpus is None:
        source: dict[str, Any] = {"name": "stdlib", "kind": "embedded"}
        if args.include:
            source["include"] = args.include
    else:
        source = {"name": "corpus", "kind": "local", "path": str(args.corpus.absolute())}
    source["heldout_fraction"] = args.heldout_fraction
    return {
        "seed": args.seed,
        "segments_per_cycle": 8,
        "at_corpus_end": "last_cycle",
        "validation_tokens": args.validation_tokens,
        "sources": [source],
        "schedule": [{"from_tokens": 0, "shares": {source["name"]: 1.0}}],
    }


def train_tokenizer(raw: dict[str, Any], work: Path) -> Path:
    """The byte-level BPE of vocab 2048 on the training documents (never the held-out ones)."""
    parsed = parse_recipe(raw, "bench recipe")
    spec = parsed.sources[0]
    source = open_source(spec, work, None)
    texts = (text for file in source.files for text in file_documents(source, file, parsed.seed).training)
    path = work / "tokenizer.json"
    path.write_text(train_byte_level_bpe(texts, VOCAB, [EMBEDDED_EOS_TOKEN]), encoding="utf-8")
    return path


def prepare(line: DataLine, tokens: int) -> None:
    """Plan and prepare the cycles that hold `tokens` training tokens, or refuse: one line."""
    index, planned = 0, 0
    while planned < tokens + TOKENS_PER_UPDATE * 2:  # cycles end within a document of their size
        plan = ensure_plan(line, index)
        prepare_cycle(line, index)
        planned += line.cycle(index).num_samples(CHUNK) * CHUNK
        if plan["last"]:
            break
        index += 1
    if planned < tokens:
        raise BenchError(
            f"{line.path}: the corpus holds about {planned:,} training tokens at vocab {VOCAB}, fewer than "
            f"--tokens {tokens:,}; give --corpus DIR with more text (e.g. WikiText-103 as .txt or .parquet) "
            "or a smaller --tokens"
        )


def make_data_lines(args: argparse.Namespace, out: Path, count: int) -> list[Path]:
    """`count` identical data lines, one per model: the first from the recipe, the others `--like` it."""
    raw = recipe(args)
    (out / "recipe.json").write_text(json.dumps(raw, indent=1))
    tokenizer = train_tokenizer(raw, out)
    cycle_tokens = max(min(args.tokens, CYCLE_TOKENS), 8 * 4096)  # > 4097: the preparer's digests
    first = init_data_line(out / "data-0", out / "recipe.json", 0, cycle_tokens, tokenizer)
    lines = [first] + [init_like_line(out / f"data-{index}", first.path) for index in range(1, count)]
    for line in lines:
        prepare(line, args.tokens)
        build_validation(line, [CHUNK])
    # What makes the comparison fair, checked: every cycle's manifest (shard hashes, sample-order
    # digests) and every held-out row file are the same bytes in every line.
    files = [path.relative_to(first.path) for path in sorted(first.path.glob("cycles/*/manifest.json"))]
    files += [path.relative_to(first.path) for path in sorted(first.validation_dir(CHUNK).iterdir())]
    for line in lines[1:]:
        for name in files:
            if (line.path / name).read_bytes() != (first.path / name).read_bytes():
                raise BenchError(f"{line.path / name}: differs from {first.path / name}")
    return [line.path for line in lines]


def make_line(root: Path, preset: str, data: Path, args: argparse.Namespace) -> Path:
    options = NewLineOptions(
        preset=preset, data=data, peak_lr=3e-3, tokens_per_update=TOKENS_PER_UPDATE, seq_len=CHUNK, device="cpu"
    )
    config = new_line(root, options).to_dict()
    updates = args.tokens // TOKENS_PER_UPDATE
    config["plan"][0]["tokens"] = updates * TOKENS_PER_UPDATE
    config["lr"]["pieces"] = [
        {"kind": "decay", "until": COSINE_UPDATES * TOKENS_PER_UPDATE, "to": 0.0, "shape": "cosine"}
    ]
    config["optimizer"].update({"betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01, "clip": 1.0})
    config["seeds"] = {"model": args.seed, "data": args.seed}
    config["validation"].update({"every_updates": updates, "rows_per_source": 10**6})
    config["validation"]["samples"]["prompts"] = 0
    config["checkpoints"].update({"every_updates": updates, "keep_last": 1, "keep_cycle_ends": 1})
    config["guards"]["min_free_disk_gb"] = 0.1
    config["wandb"]["mode"] = "disabled"
    config["print_every"] = max(1, updates // 20)
    checked = RunConfig.from_dict(config)
    checked.validate(source=str(root / "run.json"))
    checked.save(root / "run.json")
    return root


def train(line: Path) -> tuple[float, list[float]]:
    """Run the line's trainer alone in a process; its wall time in seconds and the host's 1-minute
    load average before and after (other processes on a shared host slow it down)."""
    load = [os.getloadavg()[0]]
    started = time.perf_counter()
    with open(line / "bench.out", "w") as output:
        done = subprocess.run(
            [sys.executable, "-m", "nsconsole", "run", str(line), "--no-supervisor"],
            stdout=output, stderr=subprocess.STDOUT, check=False,
        )  # fmt: skip
    if done.returncode != 0:
        tail = (line / "bench.out").read_text().strip().splitlines()[-1:]
        raise BenchError(f"{line}: the trainer exited {done.returncode}: {' '.join(tail)}")
    wall = time.perf_counter() - started
    return wall, [*load, os.getloadavg()[0]]


def summary(line: Path, preset: str, wall_s: float, load: list[float]) -> dict[str, Any]:
    rows = [json.loads(text) for text in (line / "rows.jsonl").read_text().splitlines()]
    tokens = rows[-1]["tokens"]
    tenths: list[float | None] = []
    for tenth in range(1, 11):
        low, high = tokens * (tenth - 1) / 10, tokens * tenth / 10
        losses = [row["loss"] for row in rows if low < row["tokens"] <= high and math.isfinite(row["loss"])]
        tenths.append(round(sum(losses) / len(losses), 4) if losses else None)
    update_seconds = sum(row["tokens_per_update"] / row["tokens_per_s"] for row in rows)
    # The last validation: the stage ends on its tokens, which an update short of rows (a cycle's
    # last) can put an update or two past `every_updates`' last multiple.
    validated = [row for row in rows if f"val_{CHUNK}/mix" in row]
    heldout_row = validated[-1] if validated else {}
    heldout = heldout_row.get(f"val_{CHUNK}/mix")
    return {
        "model": preset,
        "tokens": tokens,
        "updates": len(rows),
        "train_ce_each_tenth": tenths,
        "heldout_ce": None if heldout is None else round(heldout, 4),
        "heldout_bpb": heldout_row.get(f"val_{CHUNK}/bpb/mix"),
        "heldout_at_update": heldout_row.get("update"),
        "tokens_per_s": round(tokens / update_seconds, 1),
        "wall_s": round(wall_s, 1),
        "load_1min_before_after": [round(value, 2) for value in load],
        "article": ARTICLE.get(preset),
    }


def token_count(text: str) -> int:
    """--tokens: a whole, finite count of at least one update (12.7e6 is read as 12,700,000)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value < TOKENS_PER_UPDATE:
        raise argparse.ArgumentTypeError(f"must be finite and at least one update ({TOKENS_PER_UPDATE}), got {text}")
    return int(value)


def preset_list(text: str) -> list[str]:
    """--models: known presets, checked before the tokenizer and the data lines take minutes."""
    models = text.split(",")
    unknown = [name for name in models if name not in preset_names()]
    if unknown:
        raise argparse.ArgumentTypeError(f"not a preset: {', '.join(unknown)} (known: {', '.join(preset_names())})")
    return models


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=token_count, default=ARTICLE_TOKENS, help="tokens each model trains (12.7e6)")
    parser.add_argument("--seed", type=int, default=42, help="weights' and sample order's seed (the article's 42)")
    parser.add_argument("--out", type=Path, help="directory for the data and training lines (default: a new temp dir)")
    parser.add_argument("--corpus", type=Path, help="a directory of .txt/.jsonl/.parquet documents (default: stdlib)")
    parser.add_argument("--include", action="append", help="narrow the stdlib to these globs (tests)")
    parser.add_argument("--heldout-fraction", type=float, default=0.02, help="documents held out (0.02)")
    parser.add_argument("--validation-tokens", type=int, default=100_000, help="held-out tokens validated (100,000)")
    parser.add_argument(
        "--models", type=preset_list, default=list(MODELS), help="presets, comma-separated, trained in turn"
    )
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="pssa-article-"))
    if out.exists() and any(out.iterdir()):
        parser.error(f"--out {out}: not empty (each run makes its lines afresh)")
    out.mkdir(parents=True, exist_ok=True)
    models = args.models
    try:
        data = make_data_lines(args, out, len(models))
        results = []
        for preset, data_line in zip(models, data, strict=True):
            line = make_line(out / preset, preset, data_line, args)
            results.append(summary(line, preset, *train(line)))
            print(json.dumps({**results[-1], "data": str(data_line), "seed": args.seed}), flush=True)
    except (BenchError, DataLineError, LineError) as error:
        # A bad corpus, recipe setting or line: the one line the project's commands print.
        print(f"pssa_article: {error}", file=sys.stderr)
        return 2
    if len(results) == 2:
        first, second = results
        print(json.dumps({
            "compare": f"{first['model']} vs {second['model']}",
            "speedup": round(first["tokens_per_s"] / second["tokens_per_s"], 2),
            "heldout_ce_gap": None if None in (first["heldout_ce"], second["heldout_ce"])
            else round(second["heldout_ce"] - first["heldout_ce"], 4),
            "article": {"speedup": 4.13, "heldout_ce_gap": 0.432},
            "out": str(out),
        }), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
