"""The socket fuzz, longer than its test: a real supervisor and trainer on a tiny line (no data
cycle yet, so the trainer waits, alive, and only the fuzz could move the line), `--rounds` rounds
of `--clients` concurrent clients sending `--messages` fuzzed messages each (tests/helpers/socket_fuzz.py
says what they send). After each round: is the supervisor alive and answering, did the line's
state or files change.

    python bench/socket_fuzz.py [--rounds 5] [--clients 100] [--messages 40] [--seed 0]

Prints one JSON row per round and a total row: messages, replies, error replies, internal errors,
hangs, reconnects, crashes, state changes, seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the tiny-line and fuzz helpers of the tests

RUNNER = r'''
import json, sys
from engine.supervisor.supervisor import Supervisor, SupervisorSettings
raise SystemExit(Supervisor(sys.argv[1], SupervisorSettings(**json.loads(sys.argv[2]))).run())
'''


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--messages", type=int, default=40, help="messages per client per round")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="socket-fuzz-"))
    (root / "run").mkdir(mode=0o700)
    (root / "host.json").write_text("{}")
    os.environ.update({"XDG_RUNTIME_DIR": str(root / "run"), "NSCONSOLE_RUN": str(root / "run"),
                       "NSCONSOLE_HISTORY": str(root / "history"), "NSCONSOLE_HOST": str(root / "host.json")})
    from helpers.lines import make_data_line, make_line
    from helpers.socket_fuzz import FuzzTally, fuzz_concurrently, line_state, state_changes

    from nsconsole.client import SupervisorClient

    line = make_line(root / "lines", make_data_line(root, prepare=0))
    (root / "runner.py").write_text(RUNNER)
    settings = json.dumps({"poll_seconds": 0.1, "run_preparer": False})
    supervisor = subprocess.Popen([sys.executable, str(root / "runner.py"), str(line), settings])

    def status() -> dict:
        with SupervisorClient(line / "supervisor.sock", timeout=30) as client:
            return client.call("status")

    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                current = status()
            except Exception:  # not serving yet
                current = {}
            if current.get("trainer_pid") is not None and current.get("latest_checkpoint") is not None:
                break
            if supervisor.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the line did not start")
            time.sleep(0.2)
        total, crashes, changes, seconds = FuzzTally(), 0, 0, 0.0
        for number in range(args.rounds):
            before = line_state(line, status())
            started = time.monotonic()
            tally = fuzz_concurrently(line / "supervisor.sock", args.clients, args.messages, seed=args.seed + number)
            took = time.monotonic() - started
            try:
                after = line_state(line, status())
                changed = state_changes(before, after)
                crashed = int(supervisor.poll() is not None)
            except Exception:
                changed, crashed = 0, 1
            print(json.dumps({"round": number, "clients": args.clients, **asdict(tally), "crashes": crashed,
                              "state_changes": changed, "seconds": round(took, 2)}), flush=True)
            total.merge(tally)
            crashes, changes, seconds = crashes + crashed, changes + changed, seconds + took
            if crashed:
                break
        print(json.dumps({"total": True, "clients": args.clients, **asdict(total), "crashes": crashes,
                          "state_changes": changes, "seconds": round(seconds, 2)}), flush=True)
        return 0 if crashes == total.hangs == changes == 0 else 1
    finally:
        if supervisor.poll() is None:
            supervisor.terminate()
            try:
                supervisor.wait(timeout=120)
            except subprocess.TimeoutExpired:
                supervisor.kill()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
