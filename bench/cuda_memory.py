"""A training update's activation memory on CUDA, measured, beside the estimate a start is judged by.

`engine.models.memory_budget` estimates what a line's training needs before anything is allocated,
and a start is refused when even the estimate's lower end exceeds the GPU. This measures, in one
process, what the trainer's eager update (bf16 autocast, the model's recomputation, the chunked
cross-entropy: `engine.training.step.EagerEngine`) allocates beyond the state it holds between
updates (weights, gradients, AdamW moments), for each preset, recomputation and micro-batch: one
JSON row each, with the estimate's activations and their ratio to the measured peak.

The update measured is the second of its shape: the first compiles, picks kernels and allocates
the workspaces that stay. Weights are initialised on the GPU (memory does not depend on their values).

    python bench/cuda_memory.py --presets ns-2b,ns-1p3b,transformer-2b --seq-len 4096 --rows 1,2 \\
        --recompute none,dendritic,all [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.models.build import build_model, checked_config  # noqa: E402
from engine.models.memory_budget import activation_bytes  # noqa: E402
from engine.models.presets import family_of  # noqa: E402
from engine.ops.bench import BENCH_ADAMW, BENCH_LR, BENCH_WEIGHT_DECAY  # noqa: E402
from engine.training.optim import FlatAdamW  # noqa: E402
from engine.training.step import EagerEngine  # noqa: E402
from engine.units import GIB  # noqa: E402


def measure(preset: str, seq_len: int, rows_list: list[int], recomputes: list[str], device: torch.device) -> list[dict]:
    """One row per (recompute, rows): the measured activation peak and the estimate's."""
    torch.manual_seed(0)
    with device:
        model = build_model(preset)
    optimizer = FlatAdamW(model, BENCH_ADAMW, device)
    config, family = checked_config(preset), family_of(preset)
    parameters = model.num_parameters()
    generator = torch.Generator().manual_seed(0)
    found = []
    for recompute in recomputes if hasattr(model, "recompute") else ["none"]:
        if hasattr(model, "recompute"):
            model.recompute = recompute
        for rows in rows_list:
            row = {"preset": preset, "seq_len": seq_len, "rows": rows, "recompute": recompute,
                   "device": torch.cuda.get_device_name(device)}  # fmt: skip
            engine = EagerEngine(model, optimizer, rows)
            windows = torch.randint(0, config.vocab_size, (rows, seq_len + 1), generator=generator)
            try:
                engine.run_update(windows, BENCH_LR, BENCH_WEIGHT_DECAY)  # compiles, keeps its workspaces
                torch.cuda.synchronize(device)
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
                engine.run_update(windows, BENCH_LR, BENCH_WEIGHT_DECAY)
                torch.cuda.synchronize(device)
                measured = torch.cuda.max_memory_allocated(device) - before
            except torch.cuda.OutOfMemoryError:
                row["error"] = "out of memory"
            else:
                estimate = activation_bytes(family, config, rows, seq_len, "cuda", recompute, parameters)
                row.update(
                    state_gib=before / GIB,
                    measured_gib=measured / GIB,
                    measured_bytes_per_token=measured / (rows * seq_len),
                    estimate_gib=estimate / GIB,
                    estimate_over_measured=estimate / measured,
                )
            optimizer.zero_grad()
            torch.cuda.empty_cache()
            print(json.dumps(row), flush=True)
            found.append(row)
    del model, optimizer
    torch.cuda.empty_cache()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="ns-2b,ns-1p3b,transformer-2b", help="comma-separated")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--rows", default="1,2", help="comma-separated micro-batch rows")
    parser.add_argument("--recompute", default="none,dendritic,all", help="comma-separated (NS models)")
    parser.add_argument("--out", type=Path, help="append the JSON rows to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cuda_memory: no CUDA device: this measures a GPU's memory")
    device = torch.device("cuda")
    rows = [int(text) for text in args.rows.split(",")]
    for preset in args.presets.split(","):
        found = measure(preset, args.seq_len, rows, args.recompute.split(","), device)
        if args.out is not None:
            with args.out.open("a") as out:
                out.writelines(json.dumps(row) + "\n" for row in found)


if __name__ == "__main__":
    main()
