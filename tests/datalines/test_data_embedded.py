"""The embedded demo line end to end, through the command line: init, val, preparer, reader, consumption."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from datalines import open_data_line
from datalines.calibration import stratum_shares
from datalines.corpus import DocumentLengths
from datalines.dataline import DataLine
from datalines.planning import load_plan
from datalines.status import read_status
from nsconsole.cli import main

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("demo") / "line"
    assert main(["data", "init", "--work", str(work), "--embedded"]) == 0
    return work


def test_init_pins_the_stdlib_without_tests_and_plans_to_its_end(demo: Path) -> None:
    line = open_data_line(demo)
    assert line.vocab_size == 8192 and line.eos_id == 0 and line.sources == ["stdlib"]
    assert line.tokenizer.full.token_to_id("<|endoftext|>") == 0
    files = json.loads((demo / "dataline.json").read_text())["pins"]["stdlib"]["files"]
    paths = [file["path"] for file in files]
    assert len(paths) > 500 and "json/decoder.py" in paths and "os.py" in paths
    assert not [path for path in paths if "/test/" in f"/{path}" or "/tests/" in f"/{path}"]
    assert not [path for path in paths if "test_" in path]
    strata = {file["stratum"] for file in files}
    assert {"asyncio", "email", "json", "modules"} <= strata
    last = line.last_cycle()
    assert last is not None and 2 <= last <= 5  # the stdlib is a few million tokens, cycles are 1M


def test_init_refuses_an_existing_line(demo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["data", "init", "--work", str(demo), "--embedded"]) == 2
    assert "dataline.json: a data line already exists here" in capsys.readouterr().err


def test_val_then_preparer_then_reader(demo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["data", "val", "--work", str(demo), "--seq-len", "128", "--long-seq-len", "1024"]) == 0
    line = open_data_line(demo)
    rows = line.validation_rows(128)["stdlib"]
    assert rows.shape[1] == 129 and len(rows) > 100 and rows.dtype == np.int32
    assert len(line.validation_rows(1024)["stdlib"]) >= 10
    assert line.validation_weights() == {"stdlib": 1.0}

    last = line.last_cycle()
    assert last is not None
    assert main(["data", "run-preparer", "--work", str(demo), "--ahead", str(last + 1), "--once"]) == 0
    assert "ready: cycles 0.." in capsys.readouterr().out
    # A stratum whose documents are each at most half of its share of a cycle is in every cycle (one
    # with larger documents cannot be: documents are never split, so it skips a cycle now and then).
    documents = document_estimates(line)
    shares = stratum_shares(line.source("stdlib"), line.calibration["stdlib"])
    steady = {name for name, share in shares.items() if max(documents[name]) <= share * line.cycle_tokens / 2}
    assert "modules" in steady and len(steady) >= 3
    totals = []
    for index in range(last + 1):
        assert line.cycle_ready(index)
        cycle = line.cycle(index)
        info = cycle.manifest["sources"]["stdlib"]
        totals.append(info["tokens"])
        present = {stratum for stratum, counts in info["strata"].items() if counts["tokens"]}
        assert steady <= present, (index, steady - present)
        batch = cycle.samples(256, 0, 8, seed=1)
        assert batch.shape == (8, 257) and batch.max() < line.vocab_size
    assert all(0.7e6 < tokens < 1.4e6 for tokens in totals[:-1])
    assert 0.5e6 < totals[-1] < 2.5e6  # the last cycle takes the rest of the corpus
    text = line.tokenizer.decode(line.cycle(0).samples(256, 0, 1, seed=1)[0].tolist())
    assert len(text) > 300  # real Python source, about 4 characters a token

    for index in range(last + 1):
        line.mark_consumed(index)
    assert main(["data", "run-preparer", "--work", str(demo), "--once"]) == 0
    assert read_status(demo)[0]["state"] == "finished"
    for index in range(last + 1):
        assert sorted(path.name for path in line.cycle_dir(index).iterdir()) == ["consumed", "manifest.json"]


def document_estimates(line: DataLine) -> dict[str, list[float]]:
    """Stratum -> the planner's estimate of each training document's tokens (with its EOS)."""
    source = line.source("stdlib")
    lengths = DocumentLengths(source, line.recipe.seed)
    estimates: dict[str, list[float]] = {}
    for index, file in enumerate(source.files):
        rate = line.calibration["stdlib"][file.stratum]["tokens_per_text_byte"]
        estimates.setdefault(file.stratum, []).extend((lengths.of(index) * rate + 1).tolist())
    return estimates


def test_init_takes_cycle_tokens_and_plans_every_cycle_at_its_size(tmp_path: Path) -> None:
    work = tmp_path / "line"
    assert main(["data", "init", "--work", str(work), "--embedded", "--cycle-tokens", "2e5"]) == 0
    line = open_data_line(work)
    size = line.cycle_tokens
    assert size == 200_000
    last = line.last_cycle()
    assert last is not None and last >= 10
    plans = [load_plan(line, index) for index in range(last + 1)]
    planned = [plan["sources"]["stdlib"]["planned_tokens"] for plan in plans]
    estimates = [tokens for values in document_estimates(line).values() for tokens in values]
    assert sum(planned) == pytest.approx(sum(estimates))  # every training document once
    # The largest document that fits a cycle: a cycle ends short by less than half of one that waits.
    fitting = max(tokens for tokens in estimates if tokens < size)
    for index, plan in enumerate(plans[:-1]):
        documents = sum(end - start for entry in plan["sources"]["stdlib"]["strata"].values()
                        for _, start, end in entry["ranges"])
        assert size - fitting / 2 <= planned[index], (index, planned[index])
        assert planned[index] <= size + fitting / 2 or documents == 1, (index, planned[index])
    assert 0.5 * size <= planned[-1] <= 1.5 * size + fitting / 2
