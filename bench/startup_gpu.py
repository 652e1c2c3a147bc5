"""A large line's start-up on the GPU, cold and then relaunched with its compile caches warm (issue 22, item 4).

Creates a training line of --preset (default `ns-1p3b`) on the embedded demo data (the Python
standard library, its first cycle prepared here) at --seq-len 4096, then runs its trainer as the
supervisor does (`python -m engine.training.main LINE --parent PID`), twice:

- `cold`: a new line, an empty compile cache: to update 1 (`--stop-at 1`);
- `warm`: the same line relaunched, as after a crash or a supervisor's restart: it loads the
  checkpoint of update 1 and the compiled kernels the first launch left in `<line>/cache`, to update 2.

Prints each launch's start-up breakdown (the trainer's record in `<line>/startup.jsonl`: seconds in
import, set-up, checkpoint load, model build, compile, probe rows, warm-up and capture, first
update) as one JSON row, with the launch's wall time, then a summary row. With --out, copies the
line's run.log and startup.jsonl there. The line-start checkpoint is deleted before the relaunch
(it is not the one resumed from), so the two launches hold at most two checkpoints on the disk.

    python bench/startup_gpu.py --work /tmp/startup-gpu [--out DIR] [--preset ns-1p3b] [--seq-len 4096]
        [--rows 4] [--accum 2] [--recompute dendritic] [--device cuda]      (about 4 minutes on the H200)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAUNCH_TIMEOUT_S = 420


def make_line(work: Path, preset: str, seq_len: int, rows: int, accum: int, recompute: str, device: str) -> Path:
    """A fresh training line on a fresh copy of the embedded data line (made once per --work)."""
    from datalines import open_data_line
    from datalines.creation import init_embedded_line
    from datalines.preparer import prepare_cycle
    from datalines.validation import build_validation
    from engine.config.run import LengthConfig, RunConfig
    from engine.ops.new import NewLineOptions, new_line
    from engine.ops.val_lengths import line_lengths

    data = work / "data"
    if not (data / "dataline.json").is_file():
        shutil.rmtree(data, ignore_errors=True)
        init_embedded_line(data)
    data_line = open_data_line(data)
    if not data_line.cycle_ready(0):
        prepare_cycle(data_line, 0)
    root = work / "line"
    shutil.rmtree(root, ignore_errors=True)
    options = NewLineOptions(preset=preset, data=data, seq_len=seq_len, tokens_per_update=seq_len * rows * accum,
                             device=device)  # fmt: skip
    config: RunConfig = new_line(root, options)
    config.lengths = [LengthConfig(seq_len, rows, recompute)]
    config.guards.min_free_disk_gb = 1.0
    config.validation.every_updates = 1000
    # No long-context validation: a start-up needs none, and the embedded data's held-out text may
    # not fill a 32K row (it did not with the device's Python 3.12 standard library).
    config.validation.long_seq_len = seq_len
    config.checkpoints.every_updates = 1000
    config.checkpoints.keep_last = 1
    config.wandb.mode = "disabled"
    config.print_every = 1
    config.validate(source=str(root / "run.json"))
    config.save(root / "run.json")
    config.save(root / "accepted_run.json")
    missing = [length for length in line_lengths(root) if not (data_line.validation_dir(length) / "index.json").is_file()]
    if missing:
        build_validation(data_line, missing)
    return root


def launch(line: Path, stop_at: int) -> tuple[int, float, str]:
    """The trainer as the supervisor launches it: (exit status, wall seconds, the end of its stderr)."""
    environment = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    argv = [sys.executable, "-m", "engine.training.main", str(line), "--parent", str(os.getpid()),
            "--stop-at", str(stop_at)]  # fmt: skip
    began = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    return done.returncode, time.perf_counter() - began, (done.stdout + done.stderr)[-2000:]


def last_record(line: Path) -> dict:
    texts = (line / "startup.jsonl").read_text().splitlines() if (line / "startup.jsonl").is_file() else []
    return json.loads(texts[-1]) if texts else {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--preset", default="ns-1p3b")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=4, help="rows per micro-batch")
    parser.add_argument("--accum", type=int, default=2, help="micro-batches per update")
    parser.add_argument("--recompute", default="dendritic")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    line = make_line(args.work, args.preset, args.seq_len, args.rows, args.accum, args.recompute, args.device)
    shape = {"preset": args.preset, "seq_len": args.seq_len, "rows": args.rows, "accum": args.accum,
             "recompute": args.recompute}  # fmt: skip
    print(json.dumps({"bench": "startup_gpu", "made_line_s": round(time.perf_counter() - began, 1), **shape}), flush=True)
    totals: dict[str, float] = {}
    for name, stop_at in (("cold", 1), ("warm", 2)):
        if name == "warm":
            from engine.layout import LineLayout

            shutil.rmtree(LineLayout(line).checkpoint(0), ignore_errors=True)  # not the one resumed from
        code, wall, tail = launch(line, stop_at)
        record = last_record(line)
        row = {"launch": name, "exit": code, "wall_s": round(wall, 1), **shape, **record}
        if code != 0 or record.get("update") != stop_at:
            row["error"] = tail
        print(json.dumps(row), flush=True)
        if "total_s" in record and record.get("update") == stop_at:
            totals[name] = record["total_s"]
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        for name in ("run.log", "startup.jsonl"):
            if (line / name).is_file():
                shutil.copy(line / name, args.out / f"startup_{name}")
    summary = {"summary": "startup_gpu", **shape, **{f"{name}_total_s": value for name, value in totals.items()}}
    if len(totals) == 2:
        summary["saved_s"] = round(totals["cold"] - totals["warm"], 1)
    print(json.dumps(summary), flush=True)
    return 0 if len(totals) == 2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
