"""The embedded demo line: what `nsconsole --run` trains on a fresh machine with no data and no network.

Data: the Python standard library's source (`nsconsole data init --embedded`: strata by top-level
package, a byte-level BPE of vocab 8192 trained on the spot, about 3M tokens in three cycles of
about 1M). Model: `ns-tiny` (0.6M parameters), rows of 256 tokens, 16 rows per update. Schedule:
a short warmup, then a linear decay that ends where the corpus does, so the line finishes by itself
after every token was trained once (minutes on a 2-core CPU); linear, because a branch continues
the trunk's schedule exactly only from a point inside a constant or linear piece, and the quick
start branches the demo at its cycle ends. Validation and checkpoints every 100 updates, so the
console has curves and probes to show early.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.config.host import DEFAULT_WORK_ROOT
from engine.config.run import CheckpointConfig, LengthConfig, LRConfig, LRPiece, RunConfig, ValidationConfig
from engine.layout import LineLayout
from engine.ops.new import NewLineOptions, new_line

DEMO_PRESET = "ns-tiny"
DEMO_SEQ_LEN = 256
DEMO_LONG_SEQ_LEN = 512
DEMO_ROWS_PER_UPDATE = 16
DEMO_PEAK_LR = 3e-3
DEMO_WARMUP_TOKENS = 100_000
DEMO_EVERY_UPDATES = 100


@dataclass(frozen=True)
class DemoPaths:
    """Where the demo's two directories live."""

    data: Path
    """The demo data line."""
    line: Path
    """The demo training line."""


def demo_paths(work_root: str | None) -> DemoPaths:
    """`<work_root>/demo-data` and `<work_root>/demo`; without a work root, under ~/.nsconsole/lines."""
    root = Path(work_root or DEFAULT_WORK_ROOT).expanduser()
    return DemoPaths(data=root / "demo-data", line=root / "demo")


def ensure_demo_line(paths: DemoPaths, echo=print) -> Path:
    """Create the demo data line and training line where missing; return the training line.

    Idempotent: an existing data line is reused (it is pinned, so the same inputs give the same
    line), an existing training line is left as it is, so `nsconsole --run` resumes it.
    """
    # Imported here: the console reads `demo_paths` and must not load numpy and pyarrow for it.
    from datalines import open_data_line
    from datalines.creation import init_embedded_line
    from datalines.validation import build_validation

    if not (paths.data / "dataline.json").is_file():
        echo(f"creating the demo data line in {paths.data} (the Python standard library, a BPE trained now)")
        init_embedded_line(paths.data)
    data_line = open_data_line(paths.data)
    # Validation rows at the training length and at ns-tiny's longest context (the long-row probe).
    missing = [length for length in (DEMO_SEQ_LEN, DEMO_LONG_SEQ_LEN) if not (paths.data / "val" / f"T{length}").is_dir()]
    if missing:
        build_validation(data_line, missing)
    layout = LineLayout(paths.line)
    if layout.run_json.is_file():
        return paths.line
    echo(f"creating the demo training line in {paths.line} ({DEMO_PRESET})")
    config = new_line(
        paths.line,
        NewLineOptions(
            preset=DEMO_PRESET,
            data=paths.data,
            peak_lr=DEMO_PEAK_LR,
            tokens_per_update=DEMO_SEQ_LEN * DEMO_ROWS_PER_UPDATE,
            seq_len=DEMO_SEQ_LEN,
        ),
    )
    # The line was created a moment ago and never started: its configuration is still its first.
    config = _demo_schedule(config, _corpus_tokens(data_line))
    config.validate(source=str(layout.run_json))
    config.save(layout.accepted_run_json)
    config.save(layout.run_json)
    return paths.line


def _corpus_tokens(data_line) -> int:
    """The tokens the demo line will train: its planned cycles end where the corpus does."""
    last = data_line.last_cycle()
    if last is None:
        raise AssertionError("the embedded data line plans its last cycle at init")
    return data_line.cycle_start_tokens(last) + data_line.cycle_tokens


def _demo_schedule(config: RunConfig, corpus_tokens: int) -> RunConfig:
    """Warmup, a linear decay to 10 % of the peak at the corpus's end (a branch may fork anywhere in
    it), and a constant tail after it."""
    config.lengths = [LengthConfig(DEMO_SEQ_LEN, micro_batch_rows=DEMO_ROWS_PER_UPDATE)]
    config.lr = LRConfig(
        peak=DEMO_PEAK_LR,
        pieces=[
            LRPiece("warmup", DEMO_WARMUP_TOKENS, 1.0),
            LRPiece("decay", float(corpus_tokens), 0.1, "linear"),
            LRPiece("constant", None, 0.1),
        ],
    )
    config.checkpoints = CheckpointConfig(every_updates=DEMO_EVERY_UPDATES, keep_last=2)
    config.validation = ValidationConfig(every_updates=DEMO_EVERY_UPDATES, rows_per_source=16)
    config.guards.min_free_disk_gb = 1.0
    config.wandb.mode = "disabled"
    return config
