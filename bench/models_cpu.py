"""CPU training throughput of the PSSA article's two 1.5M models, side by side in one run.

The article's setting: 512 target tokens per update (8 rows of a 64-token chunk), AdamW at
lr 0.003, vocab 2048, 2 threads. PSSA carries its recurrent state from update to update (each
row continues) and writes its memory banks as in training; the transformer attends within the
chunk. Prints one JSON row per model: tokens/s over the timed updates, the median update time,
the parameter count. The article measured 1,716 tokens/s (PSSA) and 415 (transformer) on 2 vCPUs.

    python bench/models_cpu.py [--updates 20] [--warmup 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

# The repository root first: run as a script, bench/ would lead sys.path and its kernels.py
# would shadow the kernels package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.models.build import build_model  # noqa: E402

ROWS, CHUNK, VOCAB = 8, 64, 2048


def measure(preset: str, updates: int, warmup: int, seed: int) -> dict:
    torch.manual_seed(seed)
    model = build_model(preset)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
    generator = torch.Generator().manual_seed(seed)
    carry = None
    timings = []
    for update in range(warmup + updates):
        row = torch.randint(0, VOCAB, (ROWS, CHUNK + 1), generator=generator)
        started = time.perf_counter()
        if hasattr(model, "set_update"):
            model.set_update(update)
        loss, carry = model(row[:, :-1], row[:, 1:], carry)
        mean = loss.sum() / loss.numel()
        optimizer.zero_grad(set_to_none=True)
        mean.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if update >= warmup:
            timings.append(time.perf_counter() - started)
    return {
        "bench": "models_cpu",
        "model": preset,
        "parameters": model.num_parameters(),
        "tokens_per_update": ROWS * CHUNK,
        "updates": updates,
        "tokens_per_s": round(ROWS * CHUNK * len(timings) / sum(timings), 1),
        "median_update_ms": round(1000 * statistics.median(timings), 2),
        "last_loss": round(float(mean.detach()), 4),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=20, help="timed updates per model")
    parser.add_argument("--warmup", type=int, default=3, help="untimed updates first")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for preset in ("pssa-1.5m", "transformer-1.5m"):
        print(json.dumps(measure(preset, args.updates, args.warmup, args.seed)), flush=True)


if __name__ == "__main__":
    main()
