"""Weeks of a line's supervisor and of a console left attached, in minutes: does anything grow?

A real supervisor (`engine.supervisor.supervisor.Supervisor`, in a child process, as `nsconsole
run` starts it; its data preparer running) supervises a stand-in trainer that writes rows as fast
as a line of weeks would over days (`--rate` rows a second: heartbeats, a checkpoint name every
`CHECKPOINT_EVERY` updates, a validation row every `VALIDATE_EVERY`), on a tiny data line of the
tests (`tests/helpers/lines.py`). run.log rotates past `--log-cap` bytes (the supervisor's and the
stand-in's `RotatingLog`, 256 MB in a real line), so weeks of rotations happen too. The bench
samples the supervisor's RSS, open descriptors (and those left on a rotated or deleted log),
threads, children and zombies, then, one phase after the other:

- `rows`: `--rows` rows streamed through it (with a subscriber reading them, as a console does);
- `relaunches`: the trainer killed `--relaunches` times (SIGTERM, every 5th SIGKILL), each relaunched
  and notified (host.json's `notify` is a command that reads its event and exits);
- `preparer`: the data preparer killed `--preparer-kills` times, each restarted;
- `clients`: `--clients` clients that connect, say hello, ask the status, subscribe (every other
  one, half of those from seq 0, a replay of the ring) and go, plus as many that vanish mid-message;
- `slow`: a subscriber that never reads while `--rows` more rows stream: the supervisor's buffer
  for it is bounded (`SUBSCRIBER_BUFFER_LIMIT`: it is dropped), so RSS comes back once it is gone.

Then the console (`nsconsole` in a private tmux, when tmux is on PATH): it attaches to the line,
rows stream, its keys open the line's screen and walk its tabs once (`first_visit`: the screen's
code loaded, Textual's caches filled), then `--console-rounds` times more, the supervisor stopped
and started again after each (the console reconnects): its RSS, descriptors and threads before and
after (`visits_and_restarts`). Last, the console's model of a line (`LineView`) fed
`--view-rows` rows in-process: the points it holds stay at their cap (`nsconsole.lines.rows`).

    python bench/long_lived.py [--rate 400] [--rows 20000] [--relaunches 100] [--preparer-kills 20]
        [--clients 1000] [--console-rounds 10] [--view-rows 1000000] [--log-cap 262144] [--keep DIR]

Prints one JSON row per quantity: {"process", "phase", "quantity", "start", "after", "n"}; at the
end the trainer's descriptors on rotated or deleted logs and the run.log files the line holds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tiny-line and tmux helpers of the tests
sys.path.insert(0, str(ROOT))

CHECKPOINT_EVERY = 200
VALIDATE_EVERY = 500
WARM_UP_ROWS = 10_000
"""Rows before the first reading: past the supervisor's caches (its ring of the newest 8,192
notifications, its index of the newest 8,192 rows), which fill by design."""

RUNNER = r'''
import json, os, sys
from engine import logrotate
from engine.supervisor.supervisor import Supervisor, SupervisorSettings
# run.log rotated past LONG_LIVED_LOG_CAP bytes instead of 256 MB: weeks of rotations in minutes.
cap = int(os.environ["LONG_LIVED_LOG_CAP"])
logrotate.RotatingLog.__init__.__defaults__ = logrotate.rotate_if_needed.__defaults__ = (cap, logrotate.KEEP_ROTATED)
raise SystemExit(Supervisor(sys.argv[1], SupervisorSettings(**json.loads(sys.argv[2]))).run())
'''

STAND_IN_TRAINER = r'''
import json, os, signal, sys, time
from engine.logrotate import RotatingLog
from engine.supervisor.child import die_with_parent
line, rate, validate_every, checkpoint_every = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
if not die_with_parent(int(sys.argv[sys.argv.index("--parent") + 1])):  # as the real trainer does
    sys.exit(128 + signal.SIGTERM)
stopping = []
signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
rows_path = os.path.join(line, "rows.jsonl")
checkpoints = os.path.join(line, "checkpoints")
os.makedirs(checkpoints, exist_ok=True)
update = 0
if os.path.exists(rows_path):  # go on from the last row, as a resume does
    with open(rows_path, "rb") as handle:
        handle.seek(max(0, os.path.getsize(rows_path) - 65536))
        tail = handle.read().splitlines()
    update = json.loads(tail[-1])["update"] if tail else 0
def beat(stage):
    with open(os.path.join(line, ".heartbeat.tmp"), "w") as handle:
        json.dump({"time": time.time(), "update": update, "stage": stage, "pid": os.getpid()}, handle)
    os.replace(os.path.join(line, ".heartbeat.tmp"), os.path.join(line, "heartbeat"))
def checkpoint():  # a name only: progress as the supervisor reads it (a relaunch is not a failure)
    os.makedirs(os.path.join(checkpoints, "u%08d" % update), exist_ok=True)
    with open(os.path.join(checkpoints, ".latest.tmp"), "w") as handle:
        handle.write("u%08d\n" % update)
    os.replace(os.path.join(checkpoints, ".latest.tmp"), os.path.join(checkpoints, "latest"))
rows = open(rows_path, "a")
log = RotatingLog(os.path.join(line, "run.log"), int(os.environ["LONG_LIVED_LOG_CAP"]))  # as the trainer's RunLog
print(f"stand-in trainer {os.getpid()} from update {update}", flush=True)  # its stdout: the launch's run.log
start, written = time.monotonic(), 0
while not stopping:
    due = min(int((time.monotonic() - start) * rate) - written, 2000)
    for _ in range(max(0, due)):
        update += 1
        written += 1
        row = {"update": update, "tokens": update * 512, "loss": 3.0 + 1.0 / update, "lr": 3e-4,
               "grad_norm": 1.0, "seq_len": 32, "skipped": False, "tokens_per_s": rate * 512,
               "time": time.time(), "cycle": 0, "stage": "trunk"}
        rows.write(json.dumps(row, sort_keys=True) + "\n")
        log.write(f"trainer: update {update:8d}  loss {row['loss']:.4f}\n")
        if update % validate_every == 0:
            rows.write(json.dumps({"update": update, "tokens": update * 512, "seq_len": 32, "time": time.time(),
                                   "val_32/mix": 3.1, "val_32/text": 3.2}, sort_keys=True) + "\n")
        if update % checkpoint_every == 0:
            checkpoint()
    rows.flush()
    beat("training")
    time.sleep(0.05)
checkpoint()
beat("stopped")
sys.exit(128 + signal.SIGTERM)
'''


def process_reading(pid: int) -> dict[str, float]:
    """RSS (MiB), open descriptors (and of those, the ones on a rotated or deleted log), threads, live
    children and zombie children of a process."""
    process = psutil.Process(pid)
    with process.oneshot():
        children = process.children()
        zombies = 0
        for child in children:
            with contextlib.suppress(psutil.Error):
                zombies += child.status() == psutil.STATUS_ZOMBIE
        return {"rss_mib": round(process.memory_info().rss / 2**20, 1), "fds": process.num_fds(),
                "stale_log_fds": stale_log_fds(pid), "threads": process.num_threads(),
                "children": len(children) - zombies, "zombies": zombies}


def stale_log_fds(pid: int) -> int:
    """Descriptors of `pid` on a rotated log (`run.log.2`) or on a deleted file: handles a rotation left open."""
    stale = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            stale += target.endswith(" (deleted)") or re.search(r"\.(log|out)\.\d+$", target) is not None
    return stale


def report(process: str, phase: str, start: dict[str, float], after: dict[str, float], n: int) -> None:
    for quantity, value in start.items():
        print(json.dumps({"process": process, "phase": phase, "quantity": quantity, "start": value,
                          "after": after[quantity], "n": n}), flush=True)


class Bench:
    """The line, its supervisor and what the phases need of them."""

    def __init__(self, root: Path, rate: float) -> None:
        from helpers.lines import make_data_line, make_line

        self.root = root
        self.rate = rate
        self.line = make_line(root, make_data_line(root / "template"))
        (root / "runner.py").write_text(RUNNER)
        (root / "trainer.py").write_text(STAND_IN_TRAINER)
        self.supervisor: subprocess.Popen[bytes] | None = None

    # ---- the supervisor ---------------------------------------------------------------------

    def start_supervisor(self) -> int:
        settings = {"poll_seconds": 0.2, "relaunch_delay_seconds": 0.05,
                    "trainer_command": [sys.executable, str(self.root / "trainer.py"), str(self.line), str(self.rate),
                                        str(VALIDATE_EVERY), str(CHECKPOINT_EVERY)]}
        self.supervisor = subprocess.Popen(
            [sys.executable, str(self.root / "runner.py"), str(self.line), json.dumps(settings)],
            stdout=subprocess.DEVNULL, stderr=open(self.root / "supervisor.out", "ab"),  # noqa: SIM115
        )
        self.wait(lambda: (self.status().get("trainer_pid") or 0) > 0, "the trainer to start")
        return self.supervisor.pid

    def stop_supervisor(self) -> None:
        if self.supervisor is not None and self.supervisor.poll() is None:
            self.supervisor.send_signal(signal.SIGTERM)
            self.supervisor.wait(120)

    def status(self) -> dict[str, Any]:
        from nsconsole.client import SupervisorClient

        try:
            with SupervisorClient(self.line / "supervisor.sock", timeout=30) as client:
                return client.call("status")
        except Exception:  # not serving (yet, or any more)
            return {}

    def rows(self) -> int:
        return int(self.status().get("rows") or 0)

    def wait(self, done: Any, what: str, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline or (self.supervisor is not None and self.supervisor.poll() is not None):
                raise SystemExit(f"bench: gave up waiting for {what}")
            time.sleep(0.1)

    def wait_rows(self, more: int) -> None:
        target = self.rows() + more
        self.wait(lambda: self.rows() >= target, f"{more} rows", timeout=60 + 3 * more / self.rate)

    # ---- the phases -------------------------------------------------------------------------

    def stream_rows(self, count: int) -> None:
        """`count` rows through the supervisor, with a subscriber reading them (a console)."""
        from nsconsole.client import SupervisorClient

        reading = threading.Event()
        reading.set()

        def read() -> None:
            with SupervisorClient(self.line / "supervisor.sock") as client:
                client.subscribe()
                while reading.is_set():
                    client.next_notification(timeout=0.5)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        self.wait_rows(count)
        reading.clear()
        reader.join(10)

    def relaunch(self, times: int) -> None:
        """Kill the trainer `times` times (SIGTERM: a signal_restart; every 5th SIGKILL: a crash)."""
        for number in range(times):
            pid = self.status().get("trainer_pid")
            self.wait_rows(int(self.rate // 5) + 1)  # it trains, past its start
            os.kill(int(pid), signal.SIGKILL if number % 5 == 4 else signal.SIGTERM)
            self.wait(lambda old=pid: (self.status().get("trainer_pid") or old) != old, "a relaunch")

    def kill_preparer(self, times: int) -> None:
        """Kill the data preparer `times` times, each once it is ready (a good run: no backoff)."""
        for _ in range(times):
            self.wait(lambda: self._preparer_ready() is not None, "a ready preparer")
            pid = self._preparer_ready()
            os.kill(int(pid), signal.SIGKILL)
            self.wait(lambda old=pid: self._preparer_ready() not in (None, old), "the preparer's restart")

    def _preparer_ready(self) -> int | None:
        preparer = self.status().get("preparer") or {}
        status = preparer.get("status") or {}
        # Its keeper has seen it ready (a good run: the next restart comes without a backoff).
        ready = preparer.get("pid") is not None and status.get("pid") == preparer.get("pid") and \
            preparer.get("exits_in_a_row") == 0 and status.get("state") in ("ready", "finished")
        return preparer["pid"] if ready else None

    def clients(self, count: int) -> None:
        """Clients that come and go as `nsconsole status` and the console do, and clients that vanish."""
        from nsconsole.client import SupervisorClient

        path = self.line / "supervisor.sock"
        for number in range(count):
            with SupervisorClient(path) as client:
                client.call("status")
                if number % 2 == 0:
                    client.subscribe(since_seq=0 if number % 4 == 0 else None)
                    client.next_notification(timeout=0.01)
            vanishing = socket.socket(socket.AF_UNIX)
            vanishing.connect(str(path))
            vanishing.sendall(b'{"jsonrpc": "2.0", "id": 1, "method": "hello", "params": {"protocol": 1}}\n'
                              b'{"jsonrpc": "2.0", "id": 2, "meth')
            vanishing.close()

    def slow_subscriber(self, rows: int) -> bool:
        """A subscriber that never reads while `rows` rows stream; True when the supervisor dropped it."""
        slow = socket.socket(socket.AF_UNIX)
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        slow.connect(str(self.line / "supervisor.sock"))
        slow.sendall(b'{"jsonrpc": "2.0", "id": 1, "method": "hello", "params": {"protocol": 1}}\n'
                     b'{"jsonrpc": "2.0", "id": 2, "method": "subscribe", "params": {"since_seq": null}}\n')
        self.wait_rows(rows)
        # Read what reached it: a dropped subscriber's stream ends within the kernel's buffers; a kept
        # one's goes on (the supervisor pushes new rows as fast as they are read).
        slow.setblocking(False)
        deadline, dropped = time.monotonic() + 5.0, False
        while time.monotonic() < deadline and not dropped:
            try:
                dropped = not slow.recv(1 << 20)
            except BlockingIOError:
                time.sleep(0.05)
            except OSError:  # reset by the supervisor
                dropped = True
        slow.close()
        return dropped


def console_phase(bench: Bench, rounds: int) -> None:
    """The console in a private tmux, attached while rows stream, keys pressed and the supervisor restarted."""
    from helpers.tmux import Tmux

    tmux = Tmux(bench.root / "tmux.sock", session="leak")
    environment = " ".join(f"{name}={os.environ[name]}" for name in
                           ("NSCONSOLE_RUN", "NSCONSOLE_HISTORY", "NSCONSOLE_HOST", "HOME"))
    tmux.start(f"env {environment} {sys.executable} -m nsconsole; sleep 600", 200, 50)
    try:
        tmux.wait_for(bench.line.name, timeout=120)
        pane = int(tmux("list-panes", "-t", "leak", "-F", "#{pane_pid}").strip())
        console = next(child for child in psutil.Process(pane).children() if "nsconsole" in " ".join(child.cmdline()))
        bench.wait_rows(int(bench.rate * 5))

        def visit() -> None:
            """The line's screen opened, its tabs walked (keys at a person's pace), closed again."""
            tmux.keys("Enter")
            time.sleep(2)
            for key in ("1", "x", "m", "l", "2", "3", "4", "5", "6", "1"):
                tmux.keys(key)
                time.sleep(0.7)
            time.sleep(2)
            tmux.keys("Escape")

        attached = process_reading(console.pid)
        visit()  # the first visit loads the line screen's code and fills Textual's caches: once
        start = process_reading(console.pid)
        report("console", "first_visit", attached, start, 1)
        for _ in range(rounds):
            visit()
            bench.stop_supervisor()  # the console sees it go ...
            time.sleep(2)
            bench.start_supervisor()  # ... and reconnects to the next one
            bench.wait_rows(int(bench.rate * 5))
        time.sleep(3)
        if not console.is_running():
            raise SystemExit(f"bench: the console exited; its screen:\n{tmux.screen()}")
        report("console", "visits_and_restarts", start, process_reading(console.pid), rounds)
    finally:
        tmux.kill()


def view_phase(rows: int) -> None:
    """The console's model of one line fed `rows` rows (a validation every VALIDATE_EVERY): what it holds."""
    from nsconsole.state import LineView

    view = LineView("bench", "/nowhere/bench")
    tracemalloc.start()
    start_bytes = tracemalloc.get_traced_memory()[0]
    held_at: dict[str, float] = {}
    for update in range(1, rows + 1):
        view.add_row({"update": update, "tokens": update * 512, "loss": 3.0 + 1.0 / update, "lr": 3e-4,
                      "grad_norm": 1.0, "tokens_per_s": 1e4, "skipped": False, "time": float(update), "cycle": 0})
        if update % VALIDATE_EVERY == 0:
            view.add_row({"update": update, "seq_len": 32, "val_32/mix": 3.1})
        if update == rows // 10:
            held_at = {"points": len(view.series), "validations": len(view.validations),
                       "mib": round((tracemalloc.get_traced_memory()[0] - start_bytes) / 2**20, 2)}
    after = {"points": len(view.series), "validations": len(view.validations),
             "mib": round((tracemalloc.get_traced_memory()[0] - start_bytes) / 2**20, 2)}
    tracemalloc.stop()
    for quantity in after:
        print(json.dumps({"process": "console", "phase": "view", "quantity": quantity, "start": held_at[quantity],
                          "after": after[quantity], "n": rows, "start_at_n": rows // 10}), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=400.0, help="the stand-in trainer's rows a second")
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--relaunches", type=int, default=100)
    parser.add_argument("--preparer-kills", type=int, default=20)
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--console-rounds", type=int, default=10)
    parser.add_argument("--view-rows", type=int, default=1_000_000)
    parser.add_argument("--log-cap", type=int, default=256 * 1024, help="bytes past which run.log rotates")
    parser.add_argument("--keep", type=Path, default=None, help="build in this directory and keep it")
    args = parser.parse_args()

    root = args.keep or Path(tempfile.mkdtemp(prefix="long-lived-"))
    root.mkdir(parents=True, exist_ok=True)
    for name in ("run", "history", "home"):
        (root / name).mkdir(mode=0o700, exist_ok=True)
    (root / "notify.sh").write_text("#!/bin/sh\ncat > /dev/null\n")
    (root / "notify.sh").chmod(0o755)
    (root / "host.json").write_text(json.dumps({"notify": str(root / "notify.sh")}))
    os.environ.update({"NSCONSOLE_RUN": str(root / "run"), "NSCONSOLE_HISTORY": str(root / "history"),
                       "NSCONSOLE_HOST": str(root / "host.json"), "HOME": str(root / "home"),
                       "WANDB_MODE": "disabled", "LONG_LIVED_LOG_CAP": str(args.log_cap)})
    bench = Bench(root, args.rate)
    try:
        pid = bench.start_supervisor()
        # Past its start: the ring of notifications and the tail of recent rows (8,192 each) fill first.
        bench.wait_rows(WARM_UP_ROWS)
        phases = (("rows", args.rows, bench.stream_rows), ("relaunches", args.relaunches, bench.relaunch),
                  ("preparer", args.preparer_kills, bench.kill_preparer), ("clients", args.clients, bench.clients))
        first = process_reading(pid)
        for phase, n, run in phases:
            before = process_reading(pid)
            run(n)
            time.sleep(1.0)
            report("supervisor", phase, before, process_reading(pid), n)
        before = process_reading(pid)
        dropped = bench.slow_subscriber(args.rows)
        time.sleep(1.0)
        report("supervisor", "slow", before, process_reading(pid), args.rows)
        print(json.dumps({"process": "supervisor", "phase": "slow", "quantity": "slow_subscriber_dropped",
                          "start": False, "after": dropped, "n": args.rows}), flush=True)
        report("supervisor", "all", first, process_reading(pid), bench.rows())
        trainer = int(bench.status().get("trainer_pid") or 0)
        print(json.dumps({"process": "trainer", "phase": "all", "quantity": "stale_log_fds", "start": 0,
                          "after": stale_log_fds(trainer), "n": bench.rows()}), flush=True)
        logs = sorted(path.name for path in bench.line.glob("run.log*"))
        print(json.dumps({"process": "line", "phase": "all", "quantity": "run_log_files", "start": 1,
                          "after": len(logs), "n": bench.rows(), "files": logs}), flush=True)
        if args.console_rounds and shutil.which("tmux"):
            console_phase(bench, args.console_rounds)
        if args.view_rows:
            view_phase(args.view_rows)
    finally:
        bench.stop_supervisor()
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
