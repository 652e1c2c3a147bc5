"""How long one curve takes to draw: the console's braille plotter against plotext.

Both draw the same `--points` rows (a noisy decaying loss) into a `--width` x `--height` cell
area, braille dots in both; the best of `--repeats` runs is reported. plotext (5.x, the range
textual-plotext requires) is what textual-plotext renders with (its widget calls `plotext.build()`
on every render), so its time is the widget's drawing time. plotext is no dependency of the
project: without it the script prints a row saying so.

    python bench/console_plot.py [--points 50000] [--width 120] [--height 30] [--repeats 5]

Prints one JSON row per plotter.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nsconsole.widgets.plot import Layer, draw_layers  # noqa: E402


def rows(points: int) -> tuple[list[float], list[float]]:
    xs = [float(index * 512) for index in range(points)]
    ys = [3.0 + 5.0 * math.exp(-index / 5000) + 0.1 * math.sin(index * 1.7) for index in range(points)]
    return xs, ys


def best_of(repeats: int, job: Callable[[], object]) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        job()
        times.append(time.perf_counter() - started)
    return min(times)


def braille(xs: list[float], ys: list[float], width: int, height: int) -> Callable[[], object]:
    return lambda: draw_layers([Layer(xs, ys)], width, height)


def plotext_job(xs: list[float], ys: list[float], width: int, height: int) -> Callable[[], object] | None:
    try:
        import plotext
    except ImportError:
        return None

    def job() -> str:
        plotext.clear_figure()
        plotext.plotsize(width, height)
        plotext.theme("clear")
        plotext.plot(xs, ys, marker="braille")
        return plotext.build()

    return job


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=50_000)
    parser.add_argument("--width", type=int, default=120)
    parser.add_argument("--height", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    xs, ys = rows(args.points)
    shape = {"points": args.points, "width": args.width, "height": args.height, "repeats": args.repeats}
    jobs = {"braille (nsconsole.widgets.plot)": braille(xs, ys, args.width, args.height),
            "plotext": plotext_job(xs, ys, args.width, args.height)}
    for name, job in jobs.items():
        if job is None:
            print(json.dumps({"plotter": name, **shape, "skipped": "not installed"}))
            continue
        print(json.dumps({"plotter": name, **shape, "best_ms": round(best_of(args.repeats, job) * 1e3, 1)}))


if __name__ == "__main__":
    main()
