"""How fast `nsconsole` starts and how light the console is, measured as a user meets them.

- `--help` and `status`: `python -m nsconsole --help` and `python -m nsconsole status LINE` (LINE a
  real tiny line that trained a few updates on the CPU), each a fresh process; the wall time of
  the whole process, best and median of --repeat runs, and whether it imported torch (read from
  one `-X importtime` run).
- `first_paint`: `nsconsole` started in a private tmux server (a real terminal, 160x48, no line
  running); the time from starting it to the first `capture-pane` that shows the console's footer
  (`q Quit`), polled every 20 ms (so up to 20 ms late); best and median of --repeat starts.
- `watching`: the same console in tmux while --lines real supervisors run scripted trainers
  logging --rate rows a second each (bench/console_cpu.py's); once every line is on the screen and
  after --warmup seconds, the console process's CPU time over --seconds divided by the window (the
  share of one core) and its resident memory (psutil RSS) at the end.

    python bench/startup.py [--repeat 5] [--lines 8] [--rate 5] [--seconds 30] [--warmup 5]

Prints one JSON row per measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))  # the tiny-line helpers of the trainer tests

from console_cpu import bench_environment, supervised_lines  # noqa: E402

TERMINAL = (160, 48)
FOOTER = "q Quit"
"""Text of the console's footer: on the screen once the app has painted its first frame."""
POLL_S = 0.02
TIMEOUT_S = 120.0


def command_times(argv: list[str], environment: dict[str, str], repeat: int) -> dict[str, float]:
    """Best and median wall time of `argv` run `repeat` times (each must succeed)."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run(argv, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        times.append(time.perf_counter() - start)
    return {"best_s": round(min(times), 3), "median_s": round(statistics.median(times), 3)}


def imports_torch(argv: list[str], environment: dict[str, str]) -> bool:
    """Whether the command imported torch (its `-X importtime` report names every module imported)."""
    completed = subprocess.run(
        [argv[0], "-X", "importtime", *argv[1:]], env=environment, capture_output=True, text=True, check=True
    )
    return any(line.rsplit("|", 1)[-1].strip() == "torch" for line in completed.stderr.splitlines())


def make_status_line(root: Path) -> Path:
    """A real tiny line with rows, a heartbeat and checkpoints: 5 updates trained on the CPU."""
    from helpers.lines import make_data_line, make_line

    from engine.training.trainer import Trainer

    line = make_line(root, make_data_line(root / "data_root", prepare=1))
    Trainer(line, stop_at=5, echo=None).run()
    return line


class Tmux:
    """A private tmux server (its socket under `root`, no user configuration)."""

    def __init__(self, root: Path) -> None:
        self.server = ["tmux", "-S", str(root / "tmux.sock"), "-f", "/dev/null"]

    def __call__(self, *args: str) -> str:
        return subprocess.run([*self.server, *args], capture_output=True, text=True, check=True).stdout

    def screen(self) -> str:
        return self("capture-pane", "-p", "-t", "console")

    def wait_for(self, ready: Callable[[str], bool], what: str) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while not ready(self.screen()):
            if time.monotonic() > deadline:
                raise SystemExit(f"bench/startup.py: {what} did not appear within {TIMEOUT_S:g} s:\n{self.screen()}")
            time.sleep(POLL_S)


@contextmanager
def console_in_tmux(environment: dict[str, str]) -> Iterator[tuple[Tmux, float]]:
    """The console started in a fresh tmux server; yields the server and the start time."""
    root = Path(tempfile.mkdtemp(prefix="startup-bench-tmux-"))
    assignments = " ".join(f"{key}={shlex.quote(value)}" for key, value in environment.items())
    # `exec`: the pane's process is the console itself (its pid is the pane's pid).
    command = f"exec env -u COLUMNS -u LINES {assignments} {shlex.quote(sys.executable)} -m nsconsole"
    width, height = TERMINAL
    tmux = Tmux(root)
    started = time.perf_counter()
    # One call: the size is the server's default before the session exists (a pane resized after
    # the app started would race its first measurement), and a server without a session exits.
    tmux("start-server", ";", "set-option", "-g", "default-size", f"{width}x{height}", ";",
         "new-session", "-d", "-s", "console", "-x", str(width), "-y", str(height), command)
    try:
        yield tmux, started
    finally:
        subprocess.run([*tmux.server, "kill-server"], capture_output=True, check=False)
        shutil.rmtree(root, ignore_errors=True)


def console_environment(root: Path) -> dict[str, str]:
    return {**bench_environment(root, 0), "TERM": "xterm-256color", "PYTHONPATH": os.pathsep.join(sys.path)}


def first_paint(root: Path, repeat: int) -> dict[str, float]:
    """Best and median seconds from starting the console to its first painted frame."""
    times = []
    for _ in range(repeat):
        with console_in_tmux(console_environment(root)) as (tmux, started):
            tmux.wait_for(lambda screen: FOOTER in screen, "the console's footer")
            times.append(time.perf_counter() - started)
    return {"best_s": round(min(times), 3), "median_s": round(statistics.median(times), 3)}


def watching(lines: int, rate: float, seconds: float, warmup: float) -> dict[str, float]:
    """The console's share of one core and its RSS while it watches `lines` live lines."""
    with supervised_lines(lines, rate) as root, console_in_tmux(console_environment(root)) as (tmux, _):
        names = [f"line{index}" for index in range(lines)]
        tmux.wait_for(lambda screen: all(name in screen for name in names), "every line")
        console = psutil.Process(int(tmux("display-message", "-p", "-t", "console", "#{pane_pid}")))
        time.sleep(warmup)
        cpu_before, wall_before = sum(console.cpu_times()[:2]), time.monotonic()
        time.sleep(seconds)
        cpu, wall = sum(console.cpu_times()[:2]) - cpu_before, time.monotonic() - wall_before
        rss = console.memory_info().rss
    return {"cpu_fraction_of_a_core": round(cpu / wall, 4), "rss_mib": round(rss / 2**20, 1),
            "cpu_s": round(cpu, 2), "wall_s": round(wall, 2)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5, help="runs of each start measured")
    parser.add_argument("--lines", type=int, default=8, help="live lines the console watches")
    parser.add_argument("--rate", type=float, default=5.0, help="rows a second per line")
    parser.add_argument("--seconds", type=float, default=30.0, help="the CPU measurement's window")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds watched before it")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="startup-bench-"))
    try:
        (root / "run").mkdir(mode=0o700)
        (root / "host.json").write_text("{}")
        environment = {**os.environ, **bench_environment(root, 0)}
        line = make_status_line(root)
        for what, argv in (("--help", [sys.executable, "-m", "nsconsole", "--help"]),
                           ("status", [sys.executable, "-m", "nsconsole", "status", str(line)])):
            times = command_times(argv, environment, args.repeat)
            print(json.dumps({"bench": "startup", "what": what, **times, "repeat": args.repeat,
                              "imports_torch": imports_torch(argv, environment)}), flush=True)
        print(json.dumps({"bench": "startup", "what": "first_paint", **first_paint(root, args.repeat),
                          "repeat": args.repeat, "terminal": "x".join(map(str, TERMINAL))}), flush=True)
        result = watching(args.lines, args.rate, args.seconds, args.warmup)
        print(json.dumps({"bench": "startup", "what": "watching", "lines": args.lines,
                          "rows_per_s_per_line": args.rate, **result}), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
