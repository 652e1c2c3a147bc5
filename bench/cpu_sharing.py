"""Two CPU training processes on one host: each with every core's thread, or the cores shared.

Why (engine/training/cpu_share.py): torch's CPU threads spin while they wait for work, so two
processes that each run a team of every core mostly spin against each other. This runs
`bench/models_cpu.py` (the PSSA article's two 1.5M models, 8 x 64 tokens an update) in three
phases, one after the other: alone with every core (`alone`), two side by side with every core
each (`full`), and two side by side with `cores // 2` threads each (`shared`, what two CPU lines'
trainers run). Prints each process's JSON row (with its `phase`), then per phase the tokens per
second of all its processes together.

    python bench/cpu_sharing.py [--updates 15] [--warmup 2] [--cores N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent / "models_cpu.py"


def side_by_side(processes: int, threads: int, updates: int, warmup: int) -> list[dict]:
    """`processes` runs of models_cpu.py at once, `threads` each: their rows."""
    command = [sys.executable, str(BENCH), "--updates", str(updates), "--warmup", str(warmup), "--threads", str(threads)]
    running = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True) for _ in range(processes)]
    rows = []
    for index, process in enumerate(running):
        out, _ = process.communicate()
        if process.returncode != 0:
            raise SystemExit(f"models_cpu.py exited with {process.returncode}")
        rows += [json.loads(line) | {"process": index} for line in out.splitlines() if line.startswith("{")]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--cores", type=int, default=None, help="threads of a team of every core (torch's default)")
    args = parser.parse_args()
    if args.cores is None:
        import torch

        args.cores = torch.get_num_threads()
    phases = {"alone": (1, args.cores), "full": (2, args.cores), "shared": (2, max(1, args.cores // 2))}
    for phase, (processes, threads) in phases.items():
        rows = side_by_side(processes, threads, args.updates, args.warmup)
        for row in rows:
            print(json.dumps(row | {"bench": "cpu_sharing", "phase": phase}), flush=True)
        total = {}
        for row in rows:
            total[row["model"]] = total.get(row["model"], 0.0) + row["tokens_per_s"]
        summary = {"bench": "cpu_sharing", "phase": phase, "processes": processes, "threads_each": threads,
                   "load_1min": round(os.getloadavg()[0], 2)}  # fmt: skip
        summary |= {f"{model}_tokens_per_s_all": round(value, 1) for model, value in total.items()}
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
