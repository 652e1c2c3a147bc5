"""The metric set is versioned: the names each model family writes to rows.jsonl are recorded in
metric_names.json beside this file, with the METRICS_VERSION they belong to, and a change of
those names fails here until the version is bumped and the list re-recorded.

The names come from real lines: each tiny preset trains two updates through the trainer and
validates at the second (EMA and the long-row probe on), so the recording holds exactly what a
training row and a validating row carry. Counts that depend on the preset or the line's lengths
are normalised (`layer00` -> `layer<NN>`, `bin3` -> `bin<k>`, `val_32` -> `val_<L>`, ...), so
the list names kinds of readings, not how many of them a preset has.

Re-record (after bumping METRICS_VERSION in engine/metrics.py):

    NSCONSOLE_RECORD_METRIC_NAMES=1 python -m pytest -q tests/engine/models/test_metric_names.py
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from helpers.lines import SEQ_LEN, copy_data_line, data_template_fixture, make_line

from engine.config.run import SAMPLES_KEY
from engine.metrics import METRICS_VERSION
from engine.ops.lines import inspect_data_line
from engine.training.trainer import Trainer

RECORDING = Path(__file__).with_name("metric_names.json")
RECORD_VARIABLE = "NSCONSOLE_RECORD_METRIC_NAMES"
RECORD_COMMAND = f"{RECORD_VARIABLE}=1 python -m pytest -q tests/engine/models/test_metric_names.py"
PRESETS = ("transformer-tiny", "pssa-tiny", "ns-tiny")
LONG_SEQ_LEN = 2 * SEQ_LEN
SOURCE = "text"
"""The test data line's one source (helpers.lines)."""

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread

data_template = data_template_fixture(prepare=1)


def normalised(name: str) -> str:
    """The name with its preset- and line-dependent numbers replaced by placeholders."""
    name = re.sub(rf"(^|/)val_{SEQ_LEN}/", r"\1val_<L>/", name)
    name = re.sub(rf"(^|/)val_{LONG_SEQ_LEN}/", r"\1val_<P>/", name)
    name = re.sub(rf"/{SOURCE}$", "/<source>", name)
    name = re.sub(r"\b(layer|block)\d{2}\b", r"\1<NN>", name)
    return re.sub(r"(head|bin|seg)\d+(?=$|[_/])", r"\1<k>", name)


def emitted_names(root: Path, template: Path, preset: str) -> dict[str, list[str]]:
    """The normalised names of a training row and those a validating row adds, from a real line."""
    facts = inspect_data_line(template)
    overrides = {"vocab_size": facts.vocab_size}
    if preset.startswith("ns-"):
        overrides["eos_id"] = facts.eos_id  # as `nsconsole new` sets it for models with clocks
    changes = {
        "model": {"preset": preset, "overrides": overrides},
        "validation.every_updates": 2,
        "validation.rows_per_source": 2,
        "validation.long_seq_len": LONG_SEQ_LEN,
        "ema": {"horizon_tokens": 1024, "from_tokens": 0},
        "wandb.mode": "disabled",
        "print_every": 100,
    }
    line = make_line(root, copy_data_line(template, root), **changes)
    assert Trainer(line, stop_at=2, echo=None).run() == 0
    training, validating = (json.loads(text) for text in (line / "rows.jsonl").read_text().splitlines())
    train = {normalised(name) for name in training}
    return {
        "train": sorted(train),
        # The samples are text, not a metric (tests/engine/training/test_samples.py holds them).
        "validation": sorted({normalised(name) for name in validating if name != SAMPLES_KEY} - train),
    }


def differences(recorded: dict[str, dict[str, list[str]]], current: dict[str, dict[str, list[str]]]) -> list[str]:
    """One line per preset and row kind whose names differ: what was added and what removed."""
    lines = []
    for preset, kinds in current.items():
        for kind, names in kinds.items():
            before = set(recorded.get(preset, {}).get(kind, []))
            added, removed = sorted(set(names) - before), sorted(before - set(names))
            if added or removed:
                lines.append(f"{preset} {kind} row: added {added}, removed {removed}")
    return lines


def test_the_metric_names_change_only_with_the_metrics_version(tmp_path: Path, data_template: Path) -> None:
    current = {preset: emitted_names(tmp_path / preset, data_template, preset) for preset in PRESETS}
    recording = json.loads(RECORDING.read_text()) if RECORDING.exists() else None
    same_version = recording is not None and recording["metrics_version"] == METRICS_VERSION
    changed = differences(recording["presets"], current) if same_version else []
    if changed:
        pytest.fail(
            f"the metric names changed while METRICS_VERSION is still {METRICS_VERSION}: "
            f"{'; '.join(changed)}. Bump METRICS_VERSION in engine/metrics.py (and say there what "
            f"changed), then re-record {RECORDING} with `{RECORD_COMMAND}`"
        )
    if os.environ.get(RECORD_VARIABLE) == "1":
        document = {"metrics_version": METRICS_VERSION, "recorded_with": RECORD_COMMAND, "presets": current}
        RECORDING.write_text(json.dumps(document, indent=1) + "\n")
        return
    if not same_version:
        found = "no recording" if recording is None else f"a recording of version {recording['metrics_version']}"
        pytest.fail(
            f"{RECORDING}: {found}, but METRICS_VERSION is {METRICS_VERSION}: re-record it with `{RECORD_COMMAND}`"
        )
