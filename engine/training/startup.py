"""A trainer's start-up: where its seconds go before the first update, and the compile caches that
let a relaunch of the same line skip most of them.

The breakdown. `StartupClock` splits the time from the process's start to the end of its first
update into laps the trainer marks (the interpreter and its imports, the set-up, the checkpoint
load, the model build, ...) and segments it wraps (the trainer's long phases, through
`TimedPhases`: a new line's start checkpoint, the probe rows before a capture, the warm-up and
capture of the CUDA graphs, a first eager update, a validation; and the opening of the first data
cycle, which hashes its shards). The seconds torch.compile spends inside any of them (Dynamo,
AOTAutograd, Inductor, Triton: torch's own count, `torch._dynamo.utils.calculate_time_spent`) are
taken out of it and summed as `compile`, so a warm-up that compiled for 40 s and ran for 3 reads
"compile 40 s, warm-up and capture 3 s". Each lap and segment holds its own time only: a segment
inside another (the probe rows run inside the capture) is not counted twice. At the end of the
first update the trainer writes the breakdown as one line of run.log and one JSON record of
`<line>/startup.jsonl` (the last STARTUP_RECORDS_KEPT launches), so a user sees where a minute
went and a benchmark reads it (bench/startup_gpu.py).

The compile caches. Inductor's FX graph cache, AOTAutograd's cache and Triton's kernel cache live
by default in /tmp (per user) and ~/.triton, which a reboot or another machine's home does not
keep, and which every line of the host shares. `CompileCaches` points them at the line's own
`cache/inductor` and `cache/triton` for the trainer's life (TORCHINDUCTOR_CACHE_DIR,
TRITON_CACHE_DIR) with the FX graph, AOTAutograd and autotuning caches on, so a relaunch of the
line -- a resume after a crash, a supervisor's restart, a GPU given back -- loads its kernels
instead of compiling them. The choices:

- not part of checkpoints: compiled kernels belong to a machine (GPU architecture, driver, torch
  and Triton versions); a checkpoint moved elsewhere compiles anew, and a rollback or retention
  never touches the cache;
- kept when the line stops or ends: a stopped line is relaunched, an ended one may be extended;
- bounded: neither cache evicts anything, and entries of torch versions or shapes no longer used
  would pile up, so a start that finds more than CACHE_LIMIT_BYTES empties the cache first (run.log
  says so); the line's own shapes need far less (tens to hundreds of MiB);
- determinism: a cache hit returns the code a compile of the same graph, inputs' shapes and
  inductor configuration wrote (the key holds them all), so a resumed line runs the kernels its
  uninterrupted twin compiled; with Inductor's deterministic option (the project's compiled pieces
  set it) a compile picks no kernel by timing, so a cold compile writes the same kernels too.
  tests/engine/training/test_startup.py holds a cached compile's results to a cold one's, bit for bit.

Torch-free: torch's modules are read only when they are already loaded (a trainer on the CPU never
loads torch._dynamo).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.atomic import write_text_atomic
from engine.protocol.facts import Stage
from engine.training.phase_beat import PhaseBeats
from engine.units import GIB

CACHE_LIMIT_BYTES = 4 * GIB
"""A line's compile caches past this at a start are emptied first (they never evict on their own)."""
STARTUP_RECORDS_KEPT = 200
"""startup.jsonl keeps the records of this many launches, the newest."""
COMPILE = "compile"
"""The breakdown's name for torch.compile's seconds, wherever they were spent."""
IMPORT = "import"
"""The lap from the process's start to the trainer's construction (the interpreter, torch)."""
FIRST_UPDATE = "first update"
"""The first update's own time, less the phases inside it (a capture, a validation)."""

PHASE_SEGMENTS: dict[str, str] = {
    Stage.CHECKPOINTING: "checkpoint write",
    Stage.PROBING: "probe rows",
    Stage.CAPTURING: "warm-up and capture",
    Stage.COMPILING: FIRST_UPDATE,  # a first eager update on CUDA: compiling, then running
    Stage.VALIDATING: "validation",
}
"""The breakdown's name for each trainer phase (engine.training.phase_beat) timed in a start-up."""

CACHE_SWITCHES = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}
"""Environment that turns Inductor's FX graph cache and AOTAutograd's cache on (read when torch's
inductor and functorch configs are imported; `CompileCaches` also sets the loaded ones)."""
CACHE_CONFIG = {
    "torch._inductor.config": ("fx_graph_cache", "autotune_local_cache"),
    "torch._functorch.config": ("enable_autograd_cache",),
}
"""The same switches as config attributes, set on the config modules already loaded."""


def compile_seconds() -> float:
    """torch.compile's seconds in this process so far: frames (Dynamo, AOTAutograd, Inductor,
    Triton) and the backward graphs compiled at their first backward; 0 while Dynamo is unloaded."""
    utils = sys.modules.get("torch._dynamo.utils")
    spent = getattr(utils, "calculate_time_spent", None)
    return float(spent().get("total_wall_time", 0.0)) if spent is not None else 0.0


def compile_counts() -> dict[str, int]:
    """The compile caches' hits and misses in this process so far (empty while Dynamo is unloaded)."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return {}
    counters = utils.counters
    inductor, autograd = counters["inductor"], counters["aot_autograd"]
    counts = {
        "fx_graph_cache_hits": inductor["fxgraph_cache_hit"],
        "fx_graph_cache_misses": inductor["fxgraph_cache_miss"],
        "autograd_cache_hits": autograd["autograd_cache_hit"],
        "autograd_cache_misses": autograd["autograd_cache_miss"],
    }
    return {name: int(value) for name, value in counts.items()}


def directory_bytes(path: Path) -> int:
    """Bytes of the files under `path` (0 when it does not exist); files vanishing meanwhile are skipped."""
    total = 0
    for folder, _dirs, files in os.walk(path):
        for name in files:
            with suppress(FileNotFoundError):
                total += os.lstat(os.path.join(folder, name)).st_size
    return total


@dataclass
class Breakdown:
    """Where a start-up's seconds went (`StartupClock.finish`)."""

    seconds: dict[str, float]
    """Each lap's and segment's own seconds, in the order they first ran; `compile` among them."""
    total_s: float
    """From the process's start (or the clock's, without it) to the end of the first update."""
    compile_counts: dict[str, int] = field(default_factory=dict)
    """The compile caches' hits and misses (`compile_counts`)."""

    def line(self, update: int, cache: Path | None, cache_bytes: int) -> str:
        """The run.log line: `start-up: 71.3 s to update 1: import 6.1 s, ...; compile caches ...`."""
        parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.seconds.items())
        text = f"start-up: {self.total_s:.1f} s to update {update}: {parts}"
        counts = self.compile_counts
        if counts.get("fx_graph_cache_hits") or counts.get("fx_graph_cache_misses"):
            text += (f"; FX graph cache {counts['fx_graph_cache_hits']} hits, "
                     f"{counts['fx_graph_cache_misses']} misses")  # fmt: skip
        if cache is not None:
            text += f"; compile caches in {cache} ({cache_bytes / 2**20:.1f} MiB)"
        return text

    def record(self, update: int, device: str, cache: Path | None, cache_bytes: int) -> dict[str, Any]:
        """The startup.jsonl record."""
        return {
            "time": time.time(),
            "update": update,
            "device": device,
            "total_s": round(self.total_s, 3),
            "seconds": {name: round(seconds, 3) for name, seconds in self.seconds.items()},
            "compile_counts": self.compile_counts,
            "cache": str(cache) if cache is not None else None,
            "cache_bytes": cache_bytes,
        }


class StartupClock:
    """Laps and segments of a start-up, until `finish` (see the module docstring).

    `lap(name)`: the time since the previous lap, less the segments and compiling inside it, is
    `name`'s. `segment(name)`: a block's own time (less segments nested in it and its compiling).
    After `finish` both do nothing: the clock times one start-up.
    """

    def __init__(self, process_began: float | None = None, compiled: Callable[[], float] = compile_seconds) -> None:
        """`process_began`: the process's start (seconds since the epoch), timed as `import`;
        `compiled`: torch.compile's seconds so far (a test's stand-in)."""
        self._compiled = compiled
        self.seconds: dict[str, float] = {}
        self.done = False
        self._began = time.perf_counter()
        self._lap_began = self._began
        self._lap_compiled = compiled()
        self._inside = [0.0, 0.0]
        """Wall and compile seconds of the top-level segments since the last lap."""
        self._open: list[list[float]] = []
        """Per open segment: wall and compile seconds of the segments nested in it."""
        self._before = 0.0
        if process_began is not None:
            self._before = max(0.0, time.time() - process_began)
            self._add(IMPORT, self._before)

    def _add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + max(0.0, seconds)

    def _split(self, name: str, wall: float, compiled: float) -> None:
        """`wall` seconds of `name`'s own, `compiled` of them compiling (never more than the wall)."""
        compiled = min(max(0.0, compiled), max(0.0, wall))
        if compiled > 0:
            self._add(COMPILE, compiled)
        self._add(name, wall - compiled)

    def lap(self, name: str) -> None:
        """Close the lap begun at the previous one (or the clock's start) as `name`'s."""
        if self.done:
            return
        now, compiled = time.perf_counter(), self._compiled()
        wall = now - self._lap_began - self._inside[0]
        self._split(name, wall, compiled - self._lap_compiled - self._inside[1])
        self._lap_began, self._lap_compiled, self._inside = now, compiled, [0.0, 0.0]

    @contextmanager
    def segment(self, name: str) -> Iterator[None]:
        """Time the block as `name`'s (see the class docstring)."""
        if self.done:
            yield
            return
        began, compiled = time.perf_counter(), self._compiled()
        nested = [0.0, 0.0]
        self._open.append(nested)
        try:
            yield
        finally:
            self._open.pop()
            wall, spent = time.perf_counter() - began, self._compiled() - compiled
            self._split(name, wall - nested[0], spent - nested[1])
            enclosing = self._open[-1] if self._open else self._inside
            enclosing[0] += wall
            enclosing[1] += spent

    def finish(self, last_lap: str = FIRST_UPDATE) -> Breakdown:
        """Close the last lap and stop the clock; the breakdown."""
        self.lap(last_lap)
        self.done = True
        total = self._before + time.perf_counter() - self._began
        return Breakdown(dict(self.seconds), total, compile_counts())


class TimedPhases:
    """The trainer's phase beats (engine.training.phase_beat), each phase also a segment of the
    start-up's clock (named by PHASE_SEGMENTS) until the clock finishes."""

    def __init__(self, beats: PhaseBeats, clock: StartupClock) -> None:
        self.beats = beats
        self.clock = clock

    @contextmanager
    def phase(self, stage: str, update: int, **details: object) -> Iterator[None]:
        """`PhaseBeats.phase`, timed."""
        with self.clock.segment(PHASE_SEGMENTS.get(stage, str(stage))), self.beats.phase(stage, update, **details):
            yield


class CompileCaches:
    """The line's compile caches for this process's life (see the module docstring): `use` points
    torch.compile and Triton at them, `release` puts the environment back (a trainer run in a
    process that lives on: a test, `nsconsole run --foreground`)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.inductor = directory / "inductor"
        self.triton = directory / "triton"
        self._saved_environment: dict[str, str | None] = {}
        self._saved_config: list[tuple[Any, str, Any]] = []

    def environment(self) -> dict[str, str]:
        """The variables `use` sets."""
        return {"TORCHINDUCTOR_CACHE_DIR": str(self.inductor), "TRITON_CACHE_DIR": str(self.triton), **CACHE_SWITCHES}

    def use(self, clean: bool, log: Callable[[str], None]) -> None:
        """Point the caches at the line's; `clean`: this process keeps the bound (one rank of a
        group: the others start compiling after it, at the start's barrier)."""
        if clean:
            held = directory_bytes(self.directory)
            if held > CACHE_LIMIT_BYTES:
                shutil.rmtree(self.directory, ignore_errors=True)
                log(f"compile caches: {self.directory} held {held / GIB:.1f} GiB, more than "
                    f"{CACHE_LIMIT_BYTES / GIB:.0f} GiB; emptied, this start compiles anew")  # fmt: skip
        # No mkdir here: inductor and Triton make their folders at their first write, so a start
        # refused before it compiles anything leaves nothing behind.
        for name, value in self.environment().items():
            self._saved_environment.setdefault(name, os.environ.get(name))
            os.environ[name] = value
        for module_name, attributes in CACHE_CONFIG.items():
            module = sys.modules.get(module_name)
            for attribute in attributes if module is not None else ():
                self._saved_config.append((module, attribute, getattr(module, attribute)))
                setattr(module, attribute, True)

    def release(self) -> None:
        """Put back the environment and the config `use` changed."""
        for name, value in self._saved_environment.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        for module, attribute, value in reversed(self._saved_config):
            setattr(module, attribute, value)
        self._saved_environment, self._saved_config = {}, []

    def size(self) -> int:
        """The caches' bytes on disk now."""
        return directory_bytes(self.directory)


def append_startup_record(path: Path, record: dict[str, Any]) -> None:
    """Append a launch's record to startup.jsonl, keeping the newest STARTUP_RECORDS_KEPT."""
    text = json.dumps(record) + "\n"  # in the order the seconds were spent
    try:
        kept = path.read_text(encoding="utf-8").splitlines(keepends=True)
    except FileNotFoundError:
        kept = []
    if len(kept) < STARTUP_RECORDS_KEPT:
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(text)
        return
    write_text_atomic(path, "".join(kept[-(STARTUP_RECORDS_KEPT - 1) :]) + text)
