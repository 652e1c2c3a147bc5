"""A trainer's start-up (engine.training.startup): the breakdown a relaunched line writes to run.log and
startup.jsonl, and the line's compile caches, set for the trainer's life and reused by its relaunch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.lines import copy_data_line, data_template_fixture, make_line

from engine.training import startup as startup_module
from engine.training import trainer as trainer_module
from engine.training.startup import (
    COMPILE,
    IMPORT,
    CompileCaches,
    StartupClock,
    append_startup_record,
)
from engine.training.trainer import Trainer

REPOSITORY = Path(__file__).resolve().parents[3]
CACHE_VARIABLES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")

data_template = data_template_fixture()


@pytest.fixture
def line(tmp_path: Path, data_template: Path) -> Path:
    return make_line(tmp_path, copy_data_line(data_template, tmp_path))


def records(line: Path) -> list[dict]:
    return [json.loads(text) for text in (line / "startup.jsonl").read_text().splitlines()]


def startup_lines(line: Path) -> list[str]:
    return [text for text in (line / "run.log").read_text().splitlines() if " trainer: start-up: " in text]


def launch(line: Path, stop_at: int) -> subprocess.CompletedProcess[str]:
    """The line's trainer as its supervisor launches it (this test process as the parent)."""
    environment = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPOSITORY))
    argv = [sys.executable, "-m", "engine.training.main", str(line), "--parent", str(os.getpid()),
            "--stop-at", str(stop_at)]  # fmt: skip
    return subprocess.run(argv, cwd=REPOSITORY, env=environment, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_relaunched_trainer_writes_where_its_start_up_went(line: Path) -> None:
    for stop_at in (1, 2):
        done = launch(line, stop_at)
        assert done.returncode == 0, done.stderr
    first, second = records(line)
    assert (first["update"], second["update"]) == (1, 2)
    for record in (first, second):
        seconds = record["seconds"]
        assert list(seconds)[0] == IMPORT and seconds[IMPORT] > 0  # the interpreter and torch's import
        # Laps and segments cover the start-up once each: their sum is the total.
        assert sum(seconds.values()) == pytest.approx(record["total_s"], abs=0.01)
        assert record["cache"] == str(line / "cache") and record["device"] == "cpu"
        assert COMPILE not in seconds  # nothing compiles on the CPU path
    assert "checkpoint write" in first["seconds"]  # a new line's update-0 checkpoint
    assert "checkpoint write" not in second["seconds"]  # a relaunch loads one instead
    assert second["seconds"]["checkpoint load"] > 0
    assert (line / "cache" / "inductor").is_dir()  # torch makes it at its first use (importing dynamo)
    texts = startup_lines(line)
    assert len(texts) == 2
    assert "start-up: " in texts[1] and " s to update 2: import " in texts[1]
    assert f"checkpoint load {second['seconds']['checkpoint load']:.1f} s" in texts[1]
    assert f"compile caches in {line / 'cache'}" in texts[1]


def tiny_compiled_sum(x: torch.Tensor) -> torch.Tensor:
    return (torch.sin(x) * x.exp()).sum(dim=-1)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="inductor's CPU backend needs a C++ compiler")
def test_a_relaunch_reuses_the_lines_compiled_kernels(line: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside the trainer (at its model build, before its first update) a small function compiled on
    the CPU: the first launch compiles and writes the line's cache, the relaunch loads it, with the
    same bits; the caches are the line's while the trainer runs, and the environment is put back."""
    import torch._dynamo
    import torch._dynamo.utils

    seen: list[dict] = []
    build_model = trainer_module.build_model

    def build_and_compile(*args, **kwargs):
        compiled = torch.compile(tiny_compiled_sum, dynamic=False, options={"deterministic": True})
        x = torch.linspace(-2.0, 2.0, 96, dtype=torch.float32).reshape(3, 32)
        with torch.no_grad():
            out = compiled(x)
        inductor = dict(torch._dynamo.utils.counters["inductor"])
        seen.append({"env": {name: os.environ.get(name) for name in CACHE_VARIABLES}, "out": out, "inductor": inductor})
        return build_model(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "build_model", build_and_compile)
    def fresh_process() -> None:
        """A relaunch is a fresh process: nothing compiled in memory. Before the trainer starts its
        clock: a reset also zeroes Dynamo's compile-time totals, which the clock reads as it goes
        (inside a lap, after other tests of this process compiled, the lap's compile time came out
        negative and was dropped)."""
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()

    before = {name: os.environ.get(name) for name in CACHE_VARIABLES}
    fresh_process()
    assert Trainer(line, stop_at=1, echo=None).run() == 0
    assert {name: os.environ.get(name) for name in CACHE_VARIABLES} == before
    fresh_process()
    assert Trainer(line, stop_at=2, echo=None).run() == 0

    cold, warm = seen
    for launch_seen in seen:
        assert launch_seen["env"] == {
            "TORCHINDUCTOR_CACHE_DIR": str(line / "cache" / "inductor"),
            "TRITON_CACHE_DIR": str(line / "cache" / "triton"),
        }
    assert cold["inductor"].get("fxgraph_cache_miss", 0) >= 1 and not cold["inductor"].get("fxgraph_cache_hit")
    assert warm["inductor"].get("fxgraph_cache_hit", 0) >= 1 and not warm["inductor"].get("fxgraph_cache_miss")
    assert torch.equal(cold["out"], warm["out"])  # the cached kernel computes the fresh one's bits
    first, second = records(line)
    assert first["seconds"][COMPILE] > 0  # the compiling is counted apart from the model build
    assert second["compile_counts"]["fx_graph_cache_hits"] >= 1
    assert "FX graph cache" in startup_lines(line)[1]


class FakeCompiler:
    """torch.compile's seconds so far, advanced by the test."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self) -> float:
        return self.seconds


def test_clock_counts_each_second_once(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(startup_module.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(startup_module.time, "time", lambda: 1000.0)
    compiler = FakeCompiler()
    clock = StartupClock(process_began=994.0, compiled=compiler)  # 6 s before the trainer
    now[0] += 2.0
    clock.lap("set-up")
    with clock.segment("warm-up and capture"):
        now[0] += 1.0
        compiler.seconds += 4.0
        now[0] += 4.0  # compiling
        with clock.segment("probe rows"):
            now[0] += 3.0
            compiler.seconds += 1.0  # of which compiling
        now[0] += 0.5
    now[0] += 0.25
    breakdown = clock.finish()
    assert breakdown.seconds == {
        IMPORT: 6.0,
        "set-up": 2.0,
        "probe rows": 2.0,
        COMPILE: 5.0,
        "warm-up and capture": 1.5,
        "first update": 0.25,
    }
    assert breakdown.total_s == pytest.approx(16.75)
    with clock.segment("validation"):  # a finished clock times nothing more
        now[0] += 9.0
    clock.lap("later")
    assert clock.seconds == breakdown.seconds


def test_caches_past_their_bound_are_emptied_and_the_environment_put_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(startup_module, "CACHE_LIMIT_BYTES", 1000)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere/else")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    caches = CompileCaches(tmp_path / "cache")
    stale = tmp_path / "cache" / "inductor" / "stale"
    stale.mkdir(parents=True)
    (stale / "kernel.so").write_bytes(b"x" * 600)
    said: list[str] = []
    caches.use(clean=True, log=said.append)
    assert stale.exists() and not said  # under the bound: kept
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "cache" / "triton")
    caches.release()
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ and os.environ["TRITON_CACHE_DIR"] == "/somewhere/else"

    (stale / "other.so").write_bytes(b"x" * 600)
    caches.use(clean=False, log=said.append)  # not this process's to clean (another rank's)
    assert stale.exists() and not said
    caches.release()
    caches.use(clean=True, log=said.append)
    assert not stale.exists() and os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "cache" / "triton")
    assert len(said) == 1 and "emptied" in said[0] and str(tmp_path / "cache") in said[0]
    caches.release()


def test_startup_records_keep_the_newest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(startup_module, "STARTUP_RECORDS_KEPT", 3)
    path = tmp_path / "startup.jsonl"
    for update in range(1, 6):
        append_startup_record(path, {"update": update})
    assert [json.loads(text)["update"] for text in path.read_text().splitlines()] == [3, 4, 5]
