"""`nsconsole --run` on a fresh machine: the embedded demo line is created, trained under a
detached supervisor, visible in the discovery registry, and stops with a checkpoint on request;
on a demo line that has finished it says so and starts nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.lines import make_data_line, make_line, one_torch_thread

from engine.checkpoints.format import read_latest
from engine.ops.demo import demo_paths
from engine.ops.line_end import line_end
from engine.training.trainer import Trainer
from nsconsole.cli import main

pytestmark = pytest.mark.slow


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def _rows(line: Path) -> list[dict]:
    path = line / "rows.jsonl"
    if not path.exists():
        return []
    return [json.loads(text) for text in path.read_text().splitlines() if text.endswith("}")]


def test_run_creates_and_trains_the_demo_line_then_stops_cleanly(tmp_path: Path) -> None:
    host = tmp_path / "host.json"
    host.write_text(json.dumps({"work_root": str(tmp_path / "lines")}))
    env = {
        **os.environ,
        "NSCONSOLE_HOST": str(host),
        "XDG_RUNTIME_DIR": str(tmp_path / "runtime"),
        "NSCONSOLE_RUN": str(tmp_path / "run"),  # the discovery registry: <run>/<host name>/*.json
        "HOME": str(tmp_path),
    }
    (tmp_path / "runtime").mkdir(mode=0o700)
    command = [sys.executable, "-m", "nsconsole"]
    started = subprocess.run([*command, "--run"], env=env, capture_output=True, text=True, timeout=300)
    assert started.returncode == 0, started.stderr
    assert "watch it: nsconsole" in started.stdout
    line = tmp_path / "lines" / "demo"
    config = json.loads((line / "run.json").read_text())
    assert config["model"]["preset"] == "ns-tiny"
    assert config["model"]["overrides"]["eos_id"] == 0  # the data line's EOS, for NS boundaries
    # The schedule decays to the corpus's end, so the demo finishes by itself.
    assert [piece["kind"] for piece in config["lr"]["pieces"]] == ["warmup", "decay", "constant"]
    try:  # every check inside: a failing one must still stop the line (its trainer trains for minutes)
        registry = list((tmp_path / "run").glob("*/*.json"))
        assert any(json.loads(entry.read_text())["line"] == str(line) for entry in registry)
        _wait_for(lambda: len(_rows(line)) >= 3, 240, "three trained updates")
    finally:
        subprocess.run([*command, "stop", str(line)], env=env, check=True, timeout=60)
        supervisor_pid = json.loads((line / "supervisor.json").read_text())["pid"]
        _wait_for(lambda: not Path(f"/proc/{supervisor_pid}").exists(), 120, "the supervisor to exit")
    rows = _rows(line)
    losses = [row["loss"] for row in rows]
    assert all(loss == loss and loss < 10 for loss in losses)
    latest = read_latest(line / "checkpoints")
    assert latest is not None and int(latest[1:]) == rows[-1]["update"]
    # Running it again resumes the same line instead of creating another.
    again = subprocess.run([*command, "--run"], env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "creating" not in again.stdout
    subprocess.run([*command, "stop", str(line)], env=env, check=True, timeout=60)
    supervisor_pid = json.loads((line / "supervisor.json").read_text())["pid"]
    _wait_for(lambda: not Path(f"/proc/{supervisor_pid}").exists(), 120, "the supervisor to exit")


def test_run_on_a_finished_demo_line_says_so_and_starts_nothing(
    tmp_path: Path, private_host: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A tiny demo line (the demo's directories under the host's work root) trained to its data's
    end: `nsconsole --run` says it has finished and how to train on, in one line, and starts no
    supervisor; rolled back, it has more to train again."""
    lines = tmp_path / "lines"
    private_host.write_text(json.dumps({"work_root": str(lines)}))
    paths = demo_paths(str(lines))
    lines.mkdir()
    make_data_line(tmp_path / "making").rename(paths.data)
    make_line(tmp_path / "making", paths.data).rename(paths.line)
    with one_torch_thread():
        assert Trainer(paths.line, echo=None).run() == 0  # to the data line's end
    assert line_end(paths.line) == "it trained every cycle of its data line, 0 to 3"
    latest = read_latest(paths.line / "checkpoints")

    assert main(["--run"]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and captured.out == ""
    assert captured.err.startswith(
        f"nsconsole: {paths.line}: the demo line has finished (it trained every cycle of its data line, 0 to 3, "
        f"latest checkpoint {latest}); nothing is left to train, so no supervisor was started. "
    )
    assert f"`nsconsole rollback {paths.line} --to UPDATE`, then `nsconsole --run`" in captured.err
    assert not (paths.line / "supervisor.json").exists()

    assert main(["rollback", str(paths.line), "--to", "10"]) == 0
    assert line_end(paths.line) is None  # `nsconsole --run` would train it again


def test_run_on_a_finished_line_says_so_and_starts_nothing(
    tmp_path: Path, private_host: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Any line, not only the demo: `nsconsole run LINE` (background, --foreground or --no-supervisor)
    and `nsconsole --run LINE` on a line trained to its plan's end say so, in one line, and start nothing."""
    plan = [{"name": "trunk", "seq_len": 32, "tokens": 4 * 512}]
    line = make_line(tmp_path, make_data_line(tmp_path / "making", prepare=1), plan=plan)
    with one_torch_thread():
        assert Trainer(line, echo=None).run() == 0  # four updates: the plan's end
    assert line_end(line) == "the plan is complete"
    for arguments in (["run", str(line)], ["run", str(line), "--foreground"], ["--run", str(line)]):
        assert main(arguments) == 2, arguments
        captured = capsys.readouterr()
        assert captured.err.count("\n") == 1 and captured.out == ""
        assert captured.err.startswith(
            f"nsconsole: {line}: the line has finished (the plan is complete, latest checkpoint u00000004); nothing is left "
            "to train, so no supervisor was started. "
        )
    assert not (line / "supervisor.json").exists()
    # --no-supervisor too: no trainer loads torch only to resume and stop at once with status 0.
    heartbeat = (line / "heartbeat").read_bytes()
    assert main(["run", str(line), "--no-supervisor"]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and captured.out == ""
    assert captured.err.startswith(
        f"nsconsole: {line}: the line has finished (the plan is complete, latest checkpoint u00000004); nothing is left "
        "to train, so no trainer was started. "
    )
    assert (line / "heartbeat").read_bytes() == heartbeat
