"""The console's CPU use while it watches 8 live lines.

Eight real supervisors (`engine.supervisor.supervisor.Supervisor`), each over its own copy of a tiny training
line, run a scripted trainer that logs `--rate` rows a second (rows shaped like the real
trainer's, with per-layer gradient norms, a validation row every 100 updates) and beats its
heartbeat. The console (`ConsoleApp`, headless, real discovery and links) runs in this process;
after a warm-up, this process's CPU time over the measured window, divided by the window, is the
share of one core the console takes. Measured on the lines screen, on a line's curves tab, and on
the lines screen with its refresh paused (`p`): the links to the supervisors alone (their status
polls, the pushed rows and heartbeats, the health checks), the floor no view can go under.

    python bench/console_cpu.py [--lines 8] [--rate 5] [--seconds 30]

Prints one JSON row per screen.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the tiny-line helpers of the trainer tests

SCRIPTED_TRAINER = r'''
import json, math, os, signal, sys, time
line, rate = sys.argv[1], float(os.environ["BENCH_ROWS_PER_S"])
stopping = []
signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
def beat(update, stage, **extra):
    path = os.path.join(line, "heartbeat")
    with open(path + ".tmp", "w") as handle:
        json.dump({"time": time.time(), "update": update, "stage": stage, "pid": os.getpid(), **extra}, handle)
    os.replace(path + ".tmp", path)
rows = open(os.path.join(line, "rows.jsonl"), "a")
update = 0
while not stopping:
    update += 1
    row = {"update": update, "tokens": update * 512, "data_tokens": update * 512, "cycle": update // 1000,
           "stage": "trunk", "seq_len": 64, "loss": 3 + 5 * math.exp(-update / 500), "lr": 3e-3,
           "weight_decay": 0.1, "tokens_per_update": 512, "grad_norm": 1.0, "skipped": False,
           "tokens_per_s": 1700.0, "time": time.time()}
    row.update({f"train/grad_norm/layer{index:02d}": 0.1 for index in range(24)})
    rows.write(json.dumps(row) + "\n")
    if update % 100 == 0:
        rows.write(json.dumps({"update": update, "tokens": update * 512, "seq_len": 64,
                               "val_64/mix": row["loss"] + 0.2, "val_64/text": row["loss"] + 0.2}) + "\n")
    rows.flush()
    beat(update, "training")
    time.sleep(1 / rate)
beat(update, "stopped", reason="signal SIGTERM")
'''

RUNNER = r'''
import json, sys
from engine.supervisor.supervisor import Supervisor, SupervisorSettings
raise SystemExit(Supervisor(sys.argv[1], SupervisorSettings(**json.loads(sys.argv[2]))).run())
'''


def make_lines(root: Path, count: int) -> list[Path]:
    from helpers.lines import make_data_line, make_line

    data = make_data_line(root / "data_root", prepare=1)
    template = make_line(root, data)
    lines = []
    for index in range(count):
        line = root / f"line{index}"
        shutil.copytree(template, line)
        lines.append(line)
    return lines


async def watch(seconds: float, warmup: float, open_line: bool, paused: bool = False) -> dict:
    from nsconsole.app import ConsoleApp
    from nsconsole.screens.line import LineScreen

    app = ConsoleApp()
    async with app.run_test(size=(160, 48)) as pilot:
        deadline = time.monotonic() + 120
        while len([line for line in app.book if line.connected]) < 8 and time.monotonic() < deadline:
            await pilot.pause(0.2)
        await pilot.pause(1.0)  # a refresh puts the lines in the table
        if open_line:
            await pilot.press("enter")
            assert isinstance(app.screen, LineScreen)
        if paused:
            await pilot.press("p")
            assert app.paused
        await pilot.pause(warmup)
        rows_before = sum(len(line.series) for line in app.book)
        cpu_before, wall_before = time.process_time(), time.monotonic()
        await pilot.pause(seconds)
        cpu, wall = time.process_time() - cpu_before, time.monotonic() - wall_before
        rows = sum(len(line.series) for line in app.book) - rows_before
        connected = len([line for line in app.book if line.connected])
    return {"cpu_s": cpu, "wall_s": wall, "rows_received": rows, "lines_connected": connected}


def bench_environment(root: Path, rate: float) -> dict[str, str]:
    """The environment of every process of a bench under `root`: a private runtime directory (the
    discovery registry: a console sees these lines and no other) and an empty host.json."""
    return {"XDG_RUNTIME_DIR": str(root / "run"), "NSCONSOLE_RUN": str(root / "run"),
            "NSCONSOLE_HISTORY": str(root / "history"), "NSCONSOLE_HOST": str(root / "host.json"),
            "BENCH_ROWS_PER_S": str(rate)}


@contextmanager
def supervised_lines(count: int, rate: float) -> Iterator[Path]:
    """`count` real supervisors over scripted trainers logging `rate` rows a second; yields the
    bench's root (a console started with `bench_environment(root, rate)` finds them); removes it after."""
    root = Path(tempfile.mkdtemp(prefix="console-bench-"))
    (root / "run").mkdir(mode=0o700)
    (root / "host.json").write_text("{}")
    environment = {**os.environ, **bench_environment(root, rate)}
    trainer = root / "scripted_trainer.py"
    trainer.write_text(SCRIPTED_TRAINER)
    settings = json.dumps({"poll_seconds": 0.2, "trainer_command": [sys.executable, str(trainer)]})
    supervisors = []
    try:
        for line in make_lines(root, count):
            supervisors.append(subprocess.Popen([sys.executable, "-c", RUNNER, str(line), settings],
                                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                                env=environment))
        yield root
    finally:
        for process in supervisors:
            process.terminate()
        for process in supervisors:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lines", type=int, default=8)
    parser.add_argument("--rate", type=float, default=5.0, help="rows a second per line")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--warmup", type=float, default=5.0)
    args = parser.parse_args()
    with supervised_lines(args.lines, args.rate) as root:
        os.environ.update(bench_environment(root, args.rate))  # the console runs in this process
        for screen, open_line, paused in (("lines", False, False), ("line-curves", True, False),
                                          ("lines-paused", False, True)):
            result = asyncio.run(watch(args.seconds, args.warmup, open_line, paused))
            print(json.dumps({
                "bench": "console_cpu", "screen": screen, "lines": args.lines, "rows_per_s_per_line": args.rate,
                "cpu_fraction_of_a_core": round(result["cpu_s"] / result["wall_s"], 4),
                **{key: round(value, 2) if isinstance(value, float) else value for key, value in result.items()},
            }), flush=True)


if __name__ == "__main__":
    main()
