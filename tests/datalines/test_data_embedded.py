"""The embedded demo line end to end, through the command line: init, val, preparer, reader, consumption."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from datalines import open_data_line
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
    totals = []
    for index in range(last + 1):
        assert line.cycle_ready(index)
        cycle = line.cycle(index)
        info = cycle.manifest["sources"]["stdlib"]
        totals.append(info["tokens"])
        # Every cycle holds the large packages (strata) of the library.
        present = {stratum for stratum, counts in info["strata"].items() if counts["tokens"]}
        assert {"asyncio", "email", "modules", "concurrent"} <= present
        batch = cycle.samples(256, 0, 8, seed=1)
        assert batch.shape == (8, 257) and batch.max() < line.vocab_size
    assert all(0.7e6 < tokens < 1.4e6 for tokens in totals[:-1])
    assert 0.5e6 < totals[-1] < 2.5e6  # the last cycle takes the rest of the corpus
    text = line.tokenizer.decode(line.cycle(0).samples(256, 0, 1, seed=1)[0].tolist())
    assert len(text) > 300  # real Python source, about 4 characters a token

    for index in range(last + 1):
        line.mark_consumed(index)
    assert main(["data", "run-preparer", "--work", str(demo), "--once"]) == 0
    assert read_status(demo)["state"] == "finished"
    for index in range(last + 1):
        assert sorted(path.name for path in line.cycle_dir(index).iterdir()) == ["consumed", "manifest.json"]
