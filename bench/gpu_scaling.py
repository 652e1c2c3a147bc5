"""Multi-GPU throughput (issue 24): tokens/s per GPU from 1 GPU to 2, 4 and 8, and the scaling efficiency.

For each model, each `--shards` mode (`none`: every rank holds the whole state and the gradient
is summed; `fsdp`: FSDP2 shards it) and each degree N, one launch of `python -m
torch.distributed.run --standalone --nproc-per-node N -m nsconsole bench ...`: N ranks train as
the trainer's do (engine.ops.bench: rank r on the GPU `--device` names + r, each rank `--rows x
--accum` rows an update, so the group's update is N times one GPU's; CUDA graphs where they
apply, i.e. `none` on CUDA; FSDP2 trains eagerly). Degree 1 runs through torchrun too, with one process, so both sides pay
the same launch and the same (one-rank) collectives. Every launch runs with OMP_NUM_THREADS=1
unless the environment sets it (torchrun sets it above one process only; on a CPU a rank is then
one core, at every degree).

Rows (JSON, one a line, on stdout and appended to --out as they come):
- `"kind": "run"`: rank 0's `nsconsole bench` row (degree, shard, tokens_per_s of the group,
  tokens_per_s_per_gpu, mfu per device, last_loss, notes, ...), the launch's wall `seconds`
  (start-up and compilation included) and `error` (null, or why the launch gave no row: the last
  line its ranks wrote to stderr before torchrun's report, or a timeout);
- `"kind": "scaling"`, after each run above degree 1: `scaling_efficiency` = tokens/s per GPU at
  N over tokens/s per GPU at degree 1 (same model and shard, this call), `efficiency_per_doubling`
  = scaling_efficiency ** (1 / log2 N), and `meets_goal` (per doubling at least GOAL_PER_DOUBLING,
  the issue's goal within one host); null where either run gave no figure.

A launch that fails (out of memory, a crash, an unknown model) gives its error row and the
runner goes on; each launch is stopped after `--run-timeout` seconds (torchrun gets SIGTERM and
stops its ranks, then SIGKILL).

    python bench/gpu_scaling.py --seq-len 4096 --rows 4 --accum 2 --recompute dendritic --out scaling.jsonl
    python bench/gpu_scaling.py --device cpu --models transformer-tiny --degrees 1,2 --seq-len 32 --rows 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The repository root first: run as a script, bench/ would lead sys.path and its kernels.py
# would shadow the kernels package.
sys.path.insert(0, str(ROOT))

from gpu_peers import emit  # noqa: E402  (bench/, beside this script: its JSON rows)

DEFAULT_MODELS = ("ns-1p3b", "ns-2b")
DEFAULT_SHARDS = ("none", "fsdp")
GPU_DEGREES = (1, 2, 4, 8)
CPU_DEGREES = (1, 2)
GOAL_PER_DOUBLING = 0.9
"""Issue 24's goal: each doubling of the GPUs within one host keeps at least this share of a
GPU's tokens/s."""
STOP_GRACE_SECONDS = 60.0
"""After a timeout's SIGTERM, how long torchrun may take to stop its ranks before SIGKILL."""
AGENT_LOG = re.compile(r"^[DIWEF]\d{4} .*torch/distributed/")
"""A log line of torchrun's own agent (glog style: `W1206 04:46:03.962000 PID .../torch/distributed/...`)."""


def progress(message: str) -> None:
    print(f"[gpu_scaling] {message}", file=sys.stderr, flush=True)


def bench_command(model: str, shard: str, degree: int, args: argparse.Namespace) -> list[str]:
    """One launch: `degree` ranks of `nsconsole bench` under torchrun."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={degree}",
        "--max-restarts=0", "-m", "nsconsole", "bench", "--model", model, "--shard", shard,
        "--seq-len", str(args.seq_len), "--rows", str(args.rows), "--accum", str(args.accum),
        "--recompute", recompute_for(model, args.recompute), "--engine", args.engine,
        "--updates", str(args.updates), "--warmup", str(args.warmup), "--device", args.device,
    ]  # fmt: skip


def recompute_for(model: str, recompute: str) -> str:
    """`--recompute` for NS models, the only family with activation recomputation; none for the
    others (an unknown model keeps it: its launch says the model is unknown)."""
    from engine.errors import ConfigError
    from engine.models.presets import family_of

    try:
        return recompute if family_of(model) == "ns" else "none"
    except ConfigError:
        return recompute


def launch_environment() -> dict[str, str]:
    """The ranks' environment: the repository importable, one intra-op thread unless set (module
    docstring)."""
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), environment.get("PYTHONPATH")]))
    environment.setdefault("OMP_NUM_THREADS", "1")
    return environment


def ranks_lines(stderr: str) -> list[str]:
    """The non-blank lines the ranks wrote to stderr: without torchrun's log lines and its closing
    report of a failed rank (its traceback ending in ChildFailedError, and the summary after it)."""
    lines = stderr.splitlines()
    failed = next((index for index, line in enumerate(lines) if "ChildFailedError" in line), None)
    if failed is not None:  # cut at the traceback that raised it: the last one to start before it
        starts = [index for index in range(failed) if lines[index].startswith("Traceback")]
        lines = lines[: starts[-1] if starts else failed]
    return [line for line in lines if line.strip() and not AGENT_LOG.match(line)]


def launch(command: list[str], timeout: float) -> tuple[dict[str, Any], float]:
    """Rank 0's JSON row (or `{"error": ...}`: the last line the ranks wrote to stderr, e.g.
    `nsconsole: ...` or `torch.OutOfMemoryError: ...`) and the launch's wall time."""
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=ROOT, env=launch_environment(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.terminate()  # torchrun stops its ranks on SIGTERM
        try:
            process.communicate(timeout=STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
        return {"error": f"timed out after {timeout:.0f} s"}, time.perf_counter() - started
    seconds = time.perf_counter() - started
    rows = [line for line in stdout.splitlines() if line.startswith("{")]
    if process.returncode != 0 or not rows:
        written = ranks_lines(stderr) or [f"torchrun exited with status {process.returncode}"]
        sys.stderr.write("".join(f"{line}\n" for line in written[-20:]))
        return {"error": written[-1]}, seconds
    return json.loads(rows[-1]), seconds


def scaling_row(run: dict[str, Any], baseline: dict[str, Any] | None) -> dict[str, Any]:
    """The efficiency of a run above degree 1 against degree 1's (module docstring)."""
    speed = run.get("tokens_per_s_per_gpu")
    base = baseline.get("tokens_per_s_per_gpu") if baseline is not None else None
    efficiency = speed / base if speed is not None and base else None
    per_doubling = efficiency ** (1 / math.log2(run["degree"])) if efficiency is not None else None
    return {
        "kind": "scaling",
        **{key: run[key] for key in ("model", "shard", "degree", "seq_len", "rows", "accum", "device")},
        "tokens_per_s_per_gpu": speed,
        "baseline_tokens_per_s_per_gpu": base,
        "scaling_efficiency": efficiency,
        "efficiency_per_doubling": per_doubling,
        "meets_goal": None if per_doubling is None else per_doubling >= GOAL_PER_DOUBLING,
    }


def visible_gpus(device: str) -> int | None:
    """GPUs from `device`'s index on (rank r trains on index + r), None on the CPU; ConfigError
    for a bad name."""
    import torch

    from engine.training.trainer import resolve_device

    target = resolve_device(device, "gpu_scaling: --device")
    return None if target.type != "cuda" else torch.cuda.device_count() - (target.index or 0)


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str], list[str], list[int]]:
    """The options, the models, the shards and the degrees (one line and status 2 for a bad one)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated presets")
    parser.add_argument("--shards", default=",".join(DEFAULT_SHARDS), help="comma-separated: none, fsdp")
    parser.add_argument("--degrees", help="comma-separated GPUs per run (default: 1, 2, 4, 8 up to the "
                                          "visible GPUs; 1, 2 on the CPU)")  # fmt: skip
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens per row")
    parser.add_argument("--rows", type=int, default=4, help="rows per micro-batch of each GPU")
    parser.add_argument("--accum", type=int, default=2, help="micro-batches per update of each GPU")
    parser.add_argument("--recompute", default="none", help="activation recomputation of NS models")
    parser.add_argument("--engine", default="auto", choices=("auto", "eager", "graph"), help="step engine")
    parser.add_argument("--updates", type=int, default=5, help="timed updates per run, after the warm-up")
    parser.add_argument("--warmup", type=int, default=2, help="untimed updates first (compilation, capture)")
    parser.add_argument("--device", default="auto", help="auto, cuda, cuda:N (rank r on N + r) or cpu")
    parser.add_argument("--run-timeout", type=float, default=600.0, help="seconds before a launch is stopped")
    parser.add_argument("--out", type=Path, help="append the JSON rows to this file")
    args = parser.parse_args(argv)

    from engine.errors import ConfigError

    models = [name for name in args.models.split(",") if name]
    shards = [name for name in args.shards.split(",") if name]
    if not models:
        parser.error("--models: at least one preset")
    if not shards or any(shard not in DEFAULT_SHARDS for shard in shards):
        parser.error(f"--shards: each one of {', '.join(DEFAULT_SHARDS)}, got {args.shards!r}")
    if min(args.seq_len, args.rows, args.accum, args.updates) < 1 or args.warmup < 0:
        parser.error("--seq-len, --rows, --accum and --updates must be at least 1, --warmup at least 0")
    try:
        gpus = visible_gpus(args.device)
        asked = sorted({int(value) for value in args.degrees.split(",") if value}) if args.degrees else None
    except (ConfigError, ValueError) as error:
        parser.error(str(error))
    degrees = asked or (list(CPU_DEGREES) if gpus is None else [d for d in GPU_DEGREES if d <= gpus])
    if not degrees or degrees[0] < 1:
        parser.error(f"--degrees: each at least 1, got {args.degrees!r}")
    if gpus is not None and degrees[-1] > gpus:
        parser.error(f"--degrees {degrees[-1]}: rank r trains on the GPU --device names + r ({args.device}), "
                     f"and this host shows {gpus} GPU(s) from there")  # fmt: skip
    return args, models, shards, degrees


def main(argv: list[str] | None = None) -> int:
    args, models, shards, degrees = parse_args(argv)
    started = time.perf_counter()
    out = args.out.open("a") if args.out else None
    runs = [(model, shard, degree) for model in models for shard in shards for degree in degrees]
    baselines: dict[tuple[str, str], dict[str, Any]] = {}
    for index, (model, shard, degree) in enumerate(runs, 1):
        name = f"{index}/{len(runs)} {model}, shard {shard}, degree {degree}"
        progress(f"{name}: {args.rows} x {args.accum} rows of {args.seq_len} a GPU ...")
        result, seconds = launch(bench_command(model, shard, degree, args), args.run_timeout)
        asked = {"model": model, "shard": shard, "degree": degree, "seq_len": args.seq_len,
                 "rows": args.rows, "accum": args.accum, "recompute": recompute_for(model, args.recompute),
                 "engine": args.engine, "device": args.device}  # fmt: skip
        run = {"kind": "run", **asked, **result, "seconds": round(seconds, 1), "error": result.get("error")}
        emit(run, out)
        speed = run.get("tokens_per_s_per_gpu")
        summary = f"{speed:,.0f} tok/s per GPU" if speed is not None else f"no figure: {run['error']}"
        progress(f"{name}: {summary} ({seconds:.0f} s)")
        if degree == 1:
            baselines[(model, shard)] = run
        else:
            emit(scaling_row(run, baselines.get((model, shard))), out)
    if out is not None:
        out.close()
    progress(f"done in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
