"""GPU sharing shown on a real GPU: a second process takes memory beside a training line.

Two lines of `transformer-1p3b` on the embedded demo data (rows of 256 tokens), each under its
own foreground supervisor, one after the other:

- `shared` (guards.share_reserve_gb 8): a second process takes 2 GiB; the trainer should switch,
  in the same process, to the length's shared shape inside a new arena that leaves the reserve
  free, so the second process can then grow to 6 GiB; once it has gone for 3 checks the trainer
  takes its own shape back.
- `alone` (no reserve): a second process takes 2 GiB for 90 s; the trainer should checkpoint and
  exit (75), the supervisor wait for a free GPU, and the relaunched trainer resume from the
  checkpoint.

Prints one JSON row per thing seen (seconds since the phase began), then a summary row per phase.

    python bench/gpu_sharing.py --work DIR [--phases shared alone]   (CUDA; about 4 + 5 minutes on the H200)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PRESET = "transformer-1p3b"
SEQ_LEN = 256
LONG_SEQ_LEN = 512
OWN_ROWS, SHARED_ROWS, UPDATE_ROWS = 32, 8, 64
RESERVE_GB = 8.0
CHECK_EVERY = 5


def hog(first_gib: float, then_gib: float, seconds: float) -> None:
    """The other process: hold `first_gib`, after a while `then_gib` in all, for `seconds`."""
    import torch

    from engine.units import gib_bytes

    held = [torch.empty(gib_bytes(first_gib), dtype=torch.uint8, device="cuda")]
    print(json.dumps({"hog": "holding", "gib": first_gib}), flush=True)
    started = time.monotonic()
    grown = then_gib <= first_gib
    while time.monotonic() - started < seconds:
        if not grown and time.monotonic() - started > seconds / 3:
            try:
                held.append(torch.empty(gib_bytes(then_gib - first_gib), dtype=torch.uint8, device="cuda"))
                print(json.dumps({"hog": "grew", "gib": then_gib}), flush=True)
            except torch.OutOfMemoryError:
                print(json.dumps({"hog": "could not grow", "gib": then_gib}), flush=True)
            grown = True
        time.sleep(0.2)
    print(json.dumps({"hog": "leaving"}), flush=True)


def make_lines(work: Path) -> tuple[Path, Path]:
    from datalines import open_data_line
    from datalines.creation import init_embedded_line
    from datalines.validation import build_validation
    from engine.config.run import LengthConfig, RunConfig, SharedShapeConfig
    from engine.ops.new import NewLineOptions, new_line

    template = work / "data-template"
    if not template.exists():
        init_embedded_line(template)
        build_validation(open_data_line(template), [SEQ_LEN, LONG_SEQ_LEN])
    lines = []
    for name, reserve in (("shared", RESERVE_GB), ("alone", None)):
        data = work / f"data-{name}"
        shutil.rmtree(data, ignore_errors=True)
        shutil.copytree(template, data)
        root = work / name
        shutil.rmtree(root, ignore_errors=True)
        options = NewLineOptions(preset=PRESET, data=data, seq_len=SEQ_LEN, tokens_per_update=SEQ_LEN * UPDATE_ROWS)
        config: RunConfig = new_line(root, options)
        config.device = "cuda"
        config.lengths = [LengthConfig(SEQ_LEN, OWN_ROWS, shared=SharedShapeConfig(SHARED_ROWS))]
        config.guards.share_reserve_gb = reserve
        config.guards.gpu_check_every = CHECK_EVERY
        config.guards.min_free_disk_gb = 1.0
        config.validation.every_updates = 1000
        config.validation.long_seq_len = LONG_SEQ_LEN
        config.checkpoints.every_updates = 1000
        config.wandb.mode = "disabled"
        config.print_every = 1
        config.validate(source=str(root / "run.json"))
        config.save(root / "run.json")
        config.save(root / "accepted_run.json")
        lines.append(root)
    return lines[0], lines[1]


class Watch:
    """Follows a line's rows, run.log and supervisor state; prints what changes."""

    def __init__(self, line: Path, phase: str):
        self.line, self.phase = line, phase
        self.started = time.monotonic()
        self.rows_seen = 0
        self.log_seen = 0
        self.state: str | None = None
        self.mode: str | None = None
        self.update = 0
        self.modes: list[tuple[int, str]] = []
        self.events: list[dict] = []
        self.highest_update = 0
        self.retrained_updates = 0
        """Updates trained again after a relaunch: those past the checkpoint it resumed from."""
        self.left_gpu = False
        """The trainer checkpointed and left the GPU to the other process."""

    def emit(self, **row) -> None:
        row = {"phase": self.phase, "t": round(time.monotonic() - self.started, 1), **row}
        self.events.append(row)
        print(json.dumps(row), flush=True)

    def poll(self) -> None:
        rows_path = self.line / "rows.jsonl"
        if rows_path.is_file():
            lines = rows_path.read_text().splitlines()
            for text in lines[self.rows_seen :]:
                try:
                    row = json.loads(text)
                except json.JSONDecodeError:
                    break
                self.rows_seen += 1
                self.update = row.get("update", self.update)
                self.highest_update = max(self.highest_update, self.update)
                mode = row.get("gpu_mode")
                if mode != self.mode:
                    self.mode = mode
                    self.modes.append((self.update, mode))
                    self.emit(update=self.update, gpu_mode=mode, tokens_per_s=round(row.get("tokens_per_s", 0)))
        log_path = self.line / "run.log"
        if log_path.is_file():
            with log_path.open() as handle:
                handle.seek(self.log_seen)
                text = handle.read()
                self.log_seen += len(text.encode())
            for entry in text.splitlines():
                resumed = re.search(r"resumed from u\d+ \(update (\d+)", entry)
                if resumed:
                    self.retrained_updates += self.highest_update - int(resumed.group(1))
                    self.rows_seen = min(self.rows_seen, int(resumed.group(1)))  # rows.jsonl is cut back
                if "stopped until the GPU is free" in entry:
                    self.left_gpu = True
                lowered = entry.lower()
                if "gpu" in lowered or "capture" in lowered or "resum" in lowered or "error" in lowered:
                    self.emit(log=entry.strip()[:300])
        supervisor = self.line / "supervisor.json"
        try:
            state = json.loads(supervisor.read_text()).get("state")
        except (OSError, json.JSONDecodeError):
            state = None
        if state != self.state and state is not None:
            self.state = state
            self.emit(supervisor=state)

    def wait(self, condition, timeout: float, what: str) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.poll()
            if condition():
                return True
            time.sleep(0.5)
        self.emit(timeout=what)
        return False


def start_hog(first: float, then: float, seconds: float) -> subprocess.Popen:
    command = [sys.executable, __file__, "--hog", str(first), str(then), str(seconds)]
    return subprocess.Popen(command)


def run_phase(line: Path, phase: str, hog_first: float, hog_then: float, hog_seconds: float) -> dict:
    from engine.ops.stop import request_stop

    watch = Watch(line, phase)
    with (line / "supervisor.err").open("w") as errors:
        supervisor = subprocess.Popen(
            [sys.executable, "-m", "nsconsole", "run", str(line), "--foreground"], stdout=subprocess.DEVNULL, stderr=errors
        )
    ok = watch.wait(lambda: watch.update >= 15, 240, "15 updates")
    other = None
    if ok:
        watch.emit(other_process=f"starts: {hog_first} GiB, then {hog_then} GiB, for {hog_seconds} s")
        start_update = watch.update
        other = start_hog(hog_first, hog_then, hog_seconds)
        if phase == "shared":
            watch.wait(lambda: watch.mode == "shared", 120, "the switch to shared shapes")
            other.wait()
            watch.emit(other_process="gone")
            watch.wait(lambda: watch.mode == "own" and watch.update > start_update, 180, "the switch back")
        else:
            # The checkpoint before leaving takes most of a minute for this line: the other
            # process outlives it, so the supervisor is seen waiting for a free GPU.
            watch.wait(lambda: watch.left_gpu, 180, "the trainer leaving the GPU")
            if other.poll() is None:
                watch.wait(lambda: watch.state == "waiting-gpu" or other.poll() is not None, 60, "the wait for a free GPU")
            other.wait()
            watch.emit(other_process="gone")
            resumed_at = watch.update
            watch.wait(lambda: watch.update >= resumed_at + 10, 240, "10 updates after the relaunch")
    request_stop(line)
    try:
        supervisor.wait(timeout=180)
    except subprocess.TimeoutExpired:
        supervisor.kill()
    if other is not None and other.poll() is None:
        other.kill()
    watch.poll()
    summary = {"phase": phase, "summary": True, "supervisor_exit": supervisor.returncode,
               "final_update": watch.update, "retrained_updates": watch.retrained_updates,
               "modes": watch.modes, "state": watch.state}  # fmt: skip
    print(json.dumps(summary), flush=True)
    return summary


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--hog":
        hog(float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="a scratch directory")
    parser.add_argument("--phases", nargs="*", default=["shared", "alone"], choices=["shared", "alone"])
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])
    shared, alone = make_lines(args.work)
    if "shared" in args.phases:
        run_phase(shared, "shared", 2.0, 6.0, 25.0)
        # A 1.3B line's checkpoints take 16 GiB each: make room for the next phase's.
        shutil.rmtree(shared / "checkpoints", ignore_errors=True)
    if "alone" in args.phases:
        run_phase(alone, "alone", 2.0, 2.0, 90.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
