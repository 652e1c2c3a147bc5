"""CPU training throughput of the PSSA article's two 1.5M models, side by side in one run.

The article's setting: 512 target tokens per update (8 rows of a 64-token chunk), AdamW at
lr 0.003, vocab 2048, 2 threads. PSSA carries its recurrent state from update to update (each
row continues) and writes its memory banks as in training; the transformer attends within the
chunk. The models take turns, one update each per round, so a machine whose load changes during
the run (other processes on a shared host) slows both alike. Prints one JSON row per model:
tokens/s over the timed updates, the median and fastest update, the parameter count, and the
host's load average before and after. The article measured 1,716 tokens/s (PSSA) and 415
(transformer) on 2 vCPUs.

Each process keeps its freed memory as a CPU trainer does (`engine.training.cpu_heap`: no page
faults for the update's large temporaries); `--default-heap` leaves glibc's defaults.

On a host shared with other work the wall clock measures the others too. `--cpu-time` times
each update by this process's CPU time instead (with `--threads 1`, where no worker thread
spins: then it is what one core spends on the update, whatever else runs).

    python bench/models_cpu.py [--updates 20] [--warmup 3] [--threads 2] [--cpu-time] [--default-heap]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

# The repository root first: run as a script, bench/ would lead sys.path and its kernels.py
# would shadow the kernels package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.models.base import LanguageModel  # noqa: E402
from engine.models.build import build_model  # noqa: E402
from engine.training.cpu_heap import keep_freed_memory  # noqa: E402

ROWS, CHUNK, VOCAB = 8, 64, 2048
PRESETS = ("pssa-1.5m", "transformer-1.5m")


@dataclass
class Trainee:
    """One model's training state across the interleaved rounds."""

    preset: str
    model: LanguageModel
    optimizer: torch.optim.Optimizer
    generator: torch.Generator
    carry: torch.Tensor | None = None
    last_loss: float = float("nan")
    timings: list[float] = field(default_factory=list)

    @classmethod
    def build(cls, preset: str, seed: int) -> Trainee:
        torch.manual_seed(seed)
        model = build_model(preset)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
        return cls(preset, model, optimizer, torch.Generator().manual_seed(seed))

    def update(self, index: int, clock: Callable[[], float]) -> float:
        """One training update on fresh random rows; returns its time in seconds by `clock`."""
        row = torch.randint(0, VOCAB, (ROWS, CHUNK + 1), generator=self.generator)
        started = clock()
        if hasattr(self.model, "set_update"):
            self.model.set_update(index)
        loss, self.carry = self.model(row[:, :-1], row[:, 1:], self.carry)
        mean = loss.sum() / loss.numel()
        self.optimizer.zero_grad(set_to_none=True)
        mean.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        elapsed = clock() - started
        self.last_loss = float(mean.detach())
        return elapsed

    def row(self, clock: str, heap: str, load_before: float, load_after: float) -> dict:
        tokens = ROWS * CHUNK
        return {
            "bench": "models_cpu",
            "model": self.preset,
            "parameters": self.model.num_parameters(),
            "tokens_per_update": tokens,
            "updates": len(self.timings),
            "tokens_per_s": round(tokens * len(self.timings) / sum(self.timings), 1),
            "median_update_ms": round(1000 * statistics.median(self.timings), 2),
            "fastest_update_ms": round(1000 * min(self.timings), 2),
            "last_loss": round(self.last_loss, 4),
            "threads": torch.get_num_threads(),
            "clock": clock,
            "heap": heap,
            "load_1min_before": round(load_before, 2),
            "load_1min_after": round(load_after, 2),
            "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine(),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=20, help="timed updates per model")
    parser.add_argument("--warmup", type=int, default=3, help="untimed updates first")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu-time", action="store_true", help="time updates by process CPU time, not wall time")
    parser.add_argument("--default-heap", action="store_true", help="glibc's malloc defaults (page faults each update)")
    args = parser.parse_args()
    if args.cpu_time and args.threads != 1:
        parser.error("--cpu-time needs --threads 1 (worker threads spin while they wait, which CPU time counts)")
    torch.set_num_threads(args.threads)
    heap = "default" if args.default_heap or not keep_freed_memory() else "kept"
    clock, clock_name = (time.process_time, "cpu") if args.cpu_time else (time.perf_counter, "wall")
    trainees = [Trainee.build(preset, args.seed) for preset in PRESETS]
    load_before = os.getloadavg()[0]
    for index in range(args.warmup + args.updates):
        for trainee in trainees:
            elapsed = trainee.update(index, clock)
            if index >= args.warmup:
                trainee.timings.append(elapsed)
    load_after = os.getloadavg()[0]
    for trainee in trainees:
        print(json.dumps(trainee.row(clock_name, heap, load_before, load_after)), flush=True)


if __name__ == "__main__":
    main()
