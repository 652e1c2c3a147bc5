"""A months-long line, as its user lives it: every user action timed on a realistic record.

Users run 1-2B lines for weeks: at ns-2b's ~2 s an update a line logs ~43,000 rows a day. This
builds such a line in a temp dir with the project's own code (a real `ns-tiny` line on a tiny
data line, trained for real for a few updates, so its checkpoints, run.log, W&B record and rows
are the trainer's own), then grows its rows.jsonl to `--rows` rows by repeating its real rows with
renumbered `update`/`tokens`/`time`, sized as an ns-2b line's (48 layers: a gradient norm per
layer in every row; a validation every 1000 updates with the probes of 36 dendritic and 12
hippocampal layers of 20 heads, and its samples), and run.log to a line per update. Its newest
checkpoints are renamed to the grown record's last updates, their `rows`/`rows_bytes` counting
the grown file (what `nsconsole check` and a resume check), so the line resumes where it ends.

Then each action runs in a child process of its own (this script with `--action`) and prints
one JSON row: seconds, the child's peak RSS in MiB, and what it saw.

    python bench/long_line.py [--rows 1000000] [--keep DIR] [--actions a,b,...] [--timeout 600]

Actions, in order (the last ones change the line): `status`, `check`, `at_rest` (the console's
read of a line no supervisor runs, then its curves tab drawn), `wandb_gap` (the rows W&B re-sends
after a gap of 5000 updates), `supervisor` (`nsconsole run`: until it answers; then its RSS),
`attach` (the console attached to the running supervisor: time until the line's curves can be
drawn, the points it holds, its RSS), `supervisor_again` (stopped, then `nsconsole run` again: a
start from the index of rows.jsonl the stopped supervisor saved), `rows_rpc` (a `rows` call at the newest rows), `resume` (the
trainer's start up to its first update, `--no-supervisor`), `rollback` (`nsconsole rollback` to
the line's second newest checkpoint), `at_rest_indexed` (`at_rest` again, with the saved index).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tiny-line helpers of the trainer tests
sys.path.insert(0, str(ROOT))

LAYERS = 48
"""ns-2b's layers: every 4th is hippocampal (12), the others dendritic (36)."""
HEADS = 20
"""ns-2b's attention heads (the hippocampal per-head probes)."""
VALIDATE_EVERY = 1000
SECONDS_PER_UPDATE = 2.0
REAL_UPDATES = 6
TOKENS_PER_UPDATE = 512
ACTIONS = ("status", "check", "at_rest", "wandb_gap", "supervisor", "attach", "supervisor_again", "rows_rpc", "resume",
           "rollback", "at_rest_indexed")

_LAYER = re.compile(r"layer(\d\d)")
_HEAD = re.compile(r"head(\d+)")


# ---- building the aged line -------------------------------------------------------------------


def train_real_line(root: Path) -> Path:
    """A real ns-tiny line trained for REAL_UPDATES updates (validations every 3, checkpoints every 5)."""
    from helpers.lines import make_data_line, make_line

    data = make_data_line(root)
    line = make_line(root, data, **{"model.preset": "ns-tiny", "validation.every_updates": 3,
                                    "validation.long_seq_len": 64})
    code = subprocess.run(
        [sys.executable, "-m", "nsconsole", "run", str(line), "--no-supervisor", "--stop-at", str(REAL_UPDATES)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_env(),
    )
    if code.returncode != 0:
        raise SystemExit(f"training the real line failed: {code.stderr.decode()[-2000:]}")
    return line


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def widen_per_layer(row: dict[str, Any]) -> dict[str, Any]:
    """The row as an ns-2b line writes it: each `layerNN` reading for all 48 layers of its kind
    (ns-tiny's layer03 is hippocampal, the others dendritic), each `headN` one for 20 heads."""
    wide: dict[str, Any] = {}
    for key, value in row.items():
        layer = _LAYER.search(key)
        keys = [key]
        if layer is not None:
            hippocampal = int(layer[1]) % 4 == 3
            keys = [_LAYER.sub(f"layer{index:02d}", key) for index in range(LAYERS) if (index % 4 == 3) == hippocampal]
        for name in keys:
            head = _HEAD.search(name)
            names = [name] if head is None else [_HEAD.sub(f"head{index}", name) for index in range(HEADS)]
            for wide_name in names:
                wide[wide_name] = value
    return wide


def grow_rows(line: Path, total: int) -> tuple[int, dict[int, tuple[int, int]]]:
    """rows.jsonl grown to `total` rows (see the module docstring); (its size, {update: (rows, bytes)
    after that update} for the updates the renamed checkpoints and W&B need)."""
    rows_path = line / "rows.jsonl"
    real = [json.loads(text) for text in rows_path.read_text().splitlines()]
    training = [widen_per_layer(row) for row in real if not any(key.startswith("val_") for key in row)]
    validation = widen_per_layer(next(row for row in real if any(key.startswith("val_") for key in row)))
    rng = random.Random(0)
    began = real[0]["time"] - total * SECONDS_PER_UPDATE
    marks = {total, total - 1, total - VALIDATE_EVERY}
    counts: dict[int, tuple[int, int]] = {}
    size = 0
    with open(rows_path, "w", encoding="utf-8") as handle:
        for update in range(1, total + 1):
            template = validation if update % VALIDATE_EVERY == 0 else training[update % len(training)]
            loss = 2.2 + 4.0 / (1.0 + update / 2000.0) + rng.gauss(0.0, 0.03) + (3.0 if rng.random() < 1e-4 else 0.0)
            row = {**template, "update": update, "tokens": update * TOKENS_PER_UPDATE, "data_tokens":
                   update * TOKENS_PER_UPDATE, "time": began + update * SECONDS_PER_UPDATE, "loss": loss,
                   "grad_norm": abs(rng.gauss(1.0, 0.2)), "tokens_per_s": 41000.0 + rng.gauss(0.0, 500.0)}
            text = json.dumps(row, sort_keys=True, allow_nan=True) + "\n"
            handle.write(text)
            size += len(text.encode())
            if update in marks:
                counts[update] = (update, size)
    return size, counts


def age_checkpoints(line: Path, counts: dict[int, tuple[int, int]], total: int) -> None:
    """The two newest real checkpoints renamed to updates `total - 1000` and `total`: their state's
    update, tokens and rows counting the grown record; meta.json's digests made good again."""
    from engine.checkpoints.format import write_latest

    checkpoints = line / "checkpoints"
    real = sorted(path for path in checkpoints.iterdir() if path.is_dir() and path.name != "u00000000")
    for source, update in zip(real[-2:], (total - VALIDATE_EVERY, total), strict=True):
        target = checkpoints / f"u{update:08d}"
        source.rename(target)
        state = json.loads((target / "state.json").read_text())
        rows, size = counts[update]
        tokens = update * TOKENS_PER_UPDATE
        state.update(update=update, rows=rows, rows_bytes=size)
        state["position"].update(update=update, tokens_trained=tokens, stage_tokens=tokens)
        state["wandb"]["acknowledged_step"] = update
        (target / "state.json").write_text(json.dumps(state, indent=1, sort_keys=True))
        meta = json.loads((target / "meta.json").read_text())
        data = (target / "state.json").read_bytes()
        meta["files"]["state.json"] = {"blake2b": hashlib.blake2b(data, digest_size=32).hexdigest(), "bytes": len(data)}
        (target / "meta.json").write_text(json.dumps(meta, indent=1))
    write_latest(checkpoints, f"u{total:08d}")


def age_records(line: Path, total: int) -> None:
    """run.log a line per update (as the trainer prints them), the heartbeat at the last update, a
    supervisor.json that ended `stopped`, and W&B acknowledged 5000 updates back (a gap to re-send)."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    with open(line / "run.log", "w", encoding="utf-8") as log:
        for update in range(1, total + 1):
            log.write(f"{stamp} trainer: update {update:>7}  tokens {update * TOKENS_PER_UPDATE:>13,}  loss 3.1234  "
                      f"lr 3.000e-03  grad_norm 1.000     41,000 tok/s\n")
    beat = json.loads((line / "heartbeat").read_text())
    beat.update(update=total, time=time.time())
    (line / "heartbeat").write_text(json.dumps(beat))
    (line / "supervisor.json").write_text(json.dumps({"state": "stopped", "pid": 1, "launches": 1}))
    wandb_run = json.loads((line / "wandb_run.json").read_text())
    wandb_run["acknowledged_step"] = total - 5000
    (line / "wandb_run.json").write_text(json.dumps(wandb_run, indent=2))


def build(root: Path, total: int) -> Path:
    line = train_real_line(root)
    _, counts = grow_rows(line, total)
    age_checkpoints(line, counts, total)
    age_records(line, total)
    return line


# ---- the actions (each in a child process) ------------------------------------------------------


def action_status(line: Path) -> dict[str, Any]:
    return {"exit": _cli("status", str(line))}


def action_check(line: Path) -> dict[str, Any]:
    return {"exit": _cli("check", str(line))}


def _cli(*argv: str) -> int:
    from contextlib import redirect_stdout
    from io import StringIO

    from nsconsole.cli import main

    with redirect_stdout(StringIO()):
        return main(list(argv))


def action_at_rest(line: Path) -> dict[str, Any]:
    from nsconsole.history import read_at_rest
    from nsconsole.state import LineView

    resting = read_at_rest(line)
    assert resting is not None, "the line is not at rest"
    view = LineView("bench", line)
    view.apply_rest(resting.supervisor, resting.heartbeat, resting.rows, time.time())
    shown = time.monotonic()
    _draw_curves(view)
    return {"points": len(view.series), "validations": len(view.validations), "update": view.update,
            "curves_s": round(time.monotonic() - shown, 3)}


def _draw_curves(view: Any) -> None:
    """What the curves tab does with the line's rows: its frame, then each curve drawn (160 x 10 cells)."""
    from nsconsole.widgets.curves import CURVES, CurveSettings, build_frame
    from nsconsole.widgets.plot import Layer, draw_layers

    frame = build_frame(view, CurveSettings(), None, {})
    assert frame.x_range is not None
    for column, _ in CURVES:
        draw_layers([Layer(frame.line.xs, frame.line.columns[column])], 160, 10, False, [], [], frame.x_range)


def action_supervisor(line: Path) -> dict[str, Any]:
    code = subprocess.run([sys.executable, "-m", "nsconsole", "run", str(line)], cwd=ROOT, env=_env(),
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if code.returncode != 0:
        raise SystemExit(code.stderr.decode()[-2000:])
    return {"supervisor_pid": json.loads((line / "supervisor.json").read_text()).get("pid")}


def action_supervisor_again(line: Path) -> dict[str, Any]:
    """The line's supervisor stopped and started again: this start reads rows.jsonl from where the
    index the stopped one saved (rows.index.json) left off."""
    _stop_supervisor(line)
    began = time.monotonic()
    started = action_supervisor(line)
    return {"start_s": round(time.monotonic() - began, 3), **started}


def action_at_rest_indexed(line: Path) -> dict[str, Any]:
    """`at_rest` once a supervisor has saved the line's index (and a rollback cut rows.jsonl since)."""
    return action_at_rest(line)


def _supervisor_memory(line: Path) -> dict[str, Any]:
    pid = json.loads((line / "supervisor.json").read_text()).get("pid")
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(re.findall(r"^(VmHWM|VmRSS):\s+(\d+) kB", status, re.MULTILINE))
    return {"supervisor_peak_mib": round(int(fields["VmHWM"]) / 1024, 1),
            "supervisor_rss_mib": round(int(fields["VmRSS"]) / 1024, 1)}


def action_attach(line: Path) -> dict[str, Any]:
    from engine.supervisor.registry import list_supervisors
    from nsconsole.live import LiveLines
    from nsconsole.state import LineBook

    async def attach() -> dict[str, Any]:
        book = LineBook()
        entries = [entry for entry in list_supervisors() if Path(entry.line).resolve() == line.resolve()]
        live = LiveLines(book, lambda _: None, discover=lambda: entries, find_lines=list)
        task = asyncio.create_task(live.run())
        while not book.lines or not next(iter(book)).ever_connected or not len(next(iter(book)).series):
            await asyncio.sleep(0.01)
        view = next(iter(book))
        await asyncio.sleep(1.0)  # the first page of rows is in: let the rest of the fetch finish
        while (view.series.update[-1] if view.series.update else 0) < (view.status.get("rows") or 0) - 100:
            await asyncio.sleep(0.05)
        shown = time.monotonic()
        _draw_curves(view)
        drawn = time.monotonic() - shown
        task.cancel()
        return {"points": len(view.series), "validations": len(view.validations), "update": view.update,
                "curves_s": round(drawn, 3)}

    return {**asyncio.run(attach()), **_supervisor_memory(line)}


def action_rows_rpc(line: Path) -> dict[str, Any]:
    from nsconsole.client import SupervisorClient

    with SupervisorClient(line / "supervisor.sock") as client:
        total = client.call("status")["rows"]
        began = time.monotonic()
        reply = client.call("rows", since=max(0, total - 100), limit=100)
        return {"rows": len(reply["rows"]), "call_s": round(time.monotonic() - began, 4), **_supervisor_memory(line)}


def action_wandb_gap(line: Path) -> dict[str, Any]:
    from engine.wandb.rows import read_rows

    after = json.loads((line / "wandb_run.json").read_text())["acknowledged_step"]
    sent = sum(1 for _ in read_rows(line / "rows.jsonl", after=after))
    return {"rows_resent": sent}


def action_resume(line: Path) -> dict[str, Any]:
    _stop_supervisor(line)
    latest = int((line / "checkpoints" / "latest").read_text().strip().lstrip("u"))
    began = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "nsconsole", "run", str(line), "--no-supervisor", "--stop-at",
                          str(latest + 1)], cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    startup = [json.loads(text) for text in (line / "startup.jsonl").read_text().splitlines()][-1]
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {"exit": run.returncode, "wall_s": round(time.monotonic() - began, 2), "trainer_peak_mib": round(peak, 1),
            "startup": startup, "error": run.stderr.decode()[-500:] if run.returncode else None}


def _stop_supervisor(line: Path) -> None:
    if (line / "supervisor.sock").exists():
        subprocess.run([sys.executable, "-m", "nsconsole", "stop", str(line)], cwd=ROOT, env=_env(),
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while (line / "supervisor.sock").exists() and time.monotonic() < deadline:
            time.sleep(0.2)


def action_rollback(line: Path) -> dict[str, Any]:
    _stop_supervisor(line)
    checkpoints = sorted(path.name for path in (line / "checkpoints").iterdir() if path.name.startswith("u"))
    target = int(checkpoints[-2].lstrip("u"))
    return {"exit": _cli("rollback", str(line), "--to", str(target)), "to": target}


def run_action(name: str, line: Path) -> dict[str, Any]:
    """One action in this process: its seconds, this process's peak RSS and what it saw."""
    began = time.monotonic()
    seen = globals()[f"action_{name}"](line)
    seconds = time.monotonic() - began
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"action": name, "seconds": round(seconds, 3), "peak_rss_mib": round(peak, 1), **seen}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--keep", type=Path, default=None, help="build (or reuse) the line here and keep it")
    parser.add_argument("--actions", default=",".join(ACTIONS))
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds an action may take")
    parser.add_argument("--action", help=argparse.SUPPRESS)
    parser.add_argument("--line", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.action == "build":
        build(args.line.parent, args.rows)
        return
    if args.action:
        print(json.dumps(run_action(args.action, args.line)), flush=True)
        return
    root = args.keep or Path(tempfile.mkdtemp(prefix="long-line-"))
    os.environ.setdefault("NSCONSOLE_RUN", str(root / "run"))  # this line's supervisor alone, in a registry of its own
    os.environ.setdefault("NSCONSOLE_HISTORY", str(root / "history"))
    line = root / "line"
    if not (line / "rows.jsonl").exists():
        # Built in a child: a process's peak RSS survives exec on Linux, so this one stays small.
        began = time.monotonic()
        subprocess.run([sys.executable, __file__, "--action", "build", "--line", str(line), "--rows", str(args.rows)],
                       env=_env(), check=True)
        size = (line / "rows.jsonl").stat().st_size
        print(json.dumps({"action": "build", "rows": args.rows, "rows_jsonl_mib": round(size / 2**20, 1),
                          "run_log_mib": round((line / "run.log").stat().st_size / 2**20, 1),
                          "seconds": round(time.monotonic() - began, 1)}), flush=True)
    try:
        for name in args.actions.split(","):
            command = [sys.executable, __file__, "--action", name, "--line", str(line)]
            try:
                done = subprocess.run(command, env=_env(), capture_output=True, timeout=args.timeout)
            except subprocess.TimeoutExpired:
                print(json.dumps({"action": name, "seconds": None, "timed_out_after_s": args.timeout}), flush=True)
                continue
            out = done.stdout.decode().strip().splitlines()
            print(out[-1] if done.returncode == 0 and out else
                  json.dumps({"action": name, "failed": done.stderr.decode()[-800:]}), flush=True)
    finally:
        _stop_supervisor(line)
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
