"""The preparer: kill -9 mid-cycle and restart, retries with backoff, low-disk waiting, consumed cycles."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.data import make_chat_corpus, make_tokenizer, make_web_corpus, write_recipe

from datalines import DataLineError, SourceExhausted, open_data_line
from datalines.creation import init_data_line
from datalines.dataline import DataLine
from datalines.preparer import prepare_cycle
from datalines.service import MIN_FREE_ENV, preparer_running, run_preparer
from datalines.sources.local import LocalSource
from datalines.status import read_status

CYCLE_TOKENS = 5000


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("inputs")
    web = make_web_corpus(root / "web")
    chat = make_chat_corpus(root / "chat")
    tokenizer = make_tokenizer(root / "tokenizer.json", [web, chat])
    return {"web": web, "chat": chat, "tokenizer": tokenizer,
            "recipe": write_recipe(root / "recipe.json", web, chat, tokenizer)}


def new_line(inputs: dict[str, Path], path: Path, cycle_tokens: int = CYCLE_TOKENS) -> DataLine:
    return init_data_line(path, inputs["recipe"], 0, cycle_tokens, None)


def cycle_bytes(line: DataLine, index: int) -> dict[str, str]:
    directory = line.cycle_dir(index)
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(directory.iterdir())}


def preparer_command(work: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "nsconsole", "data", "run-preparer", "--work", str(work), *extra]


def test_kill_9_mid_cycle_leaves_nothing_complete_and_a_restart_gives_identical_bytes(tmp_path: Path) -> None:
    # A corpus large enough that a cycle takes a while to tokenize, so the kill lands inside it.
    web = make_web_corpus(tmp_path / "web", files_per_stratum=4, documents_per_file=1500)
    chat = make_chat_corpus(tmp_path / "chat", documents=3000)
    tokenizer = make_tokenizer(tmp_path / "tokenizer.json", [web, chat])
    recipe = write_recipe(tmp_path / "recipe.json", web, chat, tokenizer)
    killed = init_data_line(tmp_path / "killed", recipe, 0, 400_000, None)
    reference = init_data_line(tmp_path / "reference", recipe, 0, 400_000, None)

    process = subprocess.Popen(preparer_command(killed.path, "--ahead", "1", "--once"),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        status = read_status(killed.path)[0] if (killed.path / "preparer.json").exists() else None
        if status and status["state"] == "preparing" and status["progress"] > 0:
            break
        assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""
        time.sleep(0.005)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert not (killed.cycle_dir(0) / "manifest.json").exists(), "the kill came after the cycle was done"
    assert not killed.cycle_ready(0)
    with pytest.raises(DataLineError, match="not prepared yet"):
        killed.cycle(0)
    assert [path.name for path in (killed.path / "cycles").iterdir()][0].startswith(".tmp-c0000-")

    restarted = subprocess.run(preparer_command(killed.path, "--ahead", "1", "--once"), capture_output=True,
                               text=True, timeout=300)
    assert restarted.returncode == 0, restarted.stderr
    assert [path.name for path in (killed.path / "cycles").iterdir()] == ["c0000"]  # the partial is gone
    prepare_cycle(reference, 0)
    assert cycle_bytes(open_data_line(killed.path), 0) == cycle_bytes(reference, 0)


def test_failures_are_retried_with_backoff_and_resume_the_same_cycle(
    inputs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = new_line(inputs, tmp_path / "reference")
    prepare_cycle(reference, 0)
    line = new_line(inputs, tmp_path / "line")
    real_fetch = LocalSource.fetch
    failures = {"left": 2}

    def flaky_fetch(self: LocalSource, file: object) -> Path:
        if failures["left"]:
            failures["left"] -= 1
            raise ConnectionResetError("connection reset by peer")
        return real_fetch(self, file)  # type: ignore[arg-type]

    monkeypatch.setattr(LocalSource, "fetch", flaky_fetch)
    slept: list[float] = []
    seen: list[str] = []
    status = run_preparer(line, ahead=1, once=True, sleep=slept.append,
                          on_status=lambda s: seen.append(s.state))
    assert status.state == "ready" and status.failures == 2 and status.consecutive_failures == 0
    assert slept == [2.0, 4.0]
    assert seen.count("retrying") == 2
    assert "ConnectionResetError" in status.last_error
    assert cycle_bytes(line, 0) == cycle_bytes(reference, 0)


def test_a_status_is_said_before_the_status_file_shows_it(inputs: dict[str, Path], tmp_path: Path) -> None:
    """Whoever reads the status file and then stops the preparer (the supervisor; the test below)
    must find the status already reported: each report comes before the file changes."""
    line = new_line(inputs, tmp_path / "line")
    file_when_said: list[str | None] = []

    def report(status) -> None:
        shown = read_status(line.path)[0]  # None before the first write
        file_when_said.append(None if shown is None else shown["state"])

    def stop_when_waiting(status) -> bool:
        return status.state == "waiting"

    status = run_preparer(line, ahead=1, min_free_bytes=10**21, on_status=report, should_stop=stop_when_waiting)
    assert status.state == "waiting"
    assert file_when_said and file_when_said[-1] != "waiting"  # said while the file still showed the state before


def test_low_disk_makes_the_preparer_wait_and_say_so(inputs: dict[str, Path], tmp_path: Path) -> None:
    line = new_line(inputs, tmp_path / "line")
    environment = {**os.environ, MIN_FREE_ENV: "1e9"}  # a billion GiB: never available
    process = subprocess.Popen(preparer_command(line.path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env=environment, text=True)
    deadline = time.monotonic() + 120
    status = None
    while time.monotonic() < deadline:
        status = read_status(line.path)[0]
        if status and status["state"] == "waiting":
            break
        time.sleep(0.02)
    process.terminate()
    out, _ = process.communicate(timeout=60)
    assert process.returncode == 130
    assert read_status(line.path)[0]["state"] == "stopped"  # a SIGTERM leaves no stale `waiting` behind
    assert status is not None and status["state"] == "waiting"
    assert status["waiting_reason"].startswith("disk: ")
    assert "1000000000.00 GiB needed" in status["waiting_reason"]  # GiB, as every *_gb setting
    assert status["pid"] == process.pid and status["cycle"] == 0
    assert "waiting: disk: " in out  # said on screen too
    assert not (line.path / "cycles" / "c0000").exists()
    # With room again it goes on.
    assert run_preparer(line, ahead=1, once=True, min_free_bytes=0).state == "ready"
    assert line.cycle_ready(0)


def test_consumed_cycles_are_deleted_and_the_next_ones_prepared(
    inputs: dict[str, Path], tmp_path: Path
) -> None:
    line = new_line(inputs, tmp_path / "line")
    assert run_preparer(line, ahead=2, once=True).ready == [0, 1]
    line.mark_consumed(0)
    status = run_preparer(line, ahead=2, once=True)
    assert status.ready == [1, 2]
    assert sorted(path.name for path in line.cycle_dir(0).iterdir()) == ["consumed", "manifest.json"]
    written = json.loads((line.path / "preparer.json").read_text())
    assert written["state"] == "ready" and written["ready"] == [1, 2] and written["time"] > 0


def test_one_preparer_per_line(inputs: dict[str, Path], tmp_path: Path) -> None:
    line = new_line(inputs, tmp_path / "line")
    calls: list[str] = []

    def second_preparer(status: object) -> bool:
        assert preparer_running(line.path)
        with pytest.raises(DataLineError, match="another preparer runs on this line"):
            run_preparer(open_data_line(line.path), once=True)
        calls.append("refused")
        return True

    assert not preparer_running(line.path)
    run_preparer(line, once=True, should_stop=second_preparer)
    assert calls == ["refused"]
    assert not preparer_running(line.path)


def test_an_exhausted_source_stops_the_preparer_with_the_error(
    inputs: dict[str, Path], tmp_path: Path
) -> None:
    line = new_line(inputs, tmp_path / "line")
    with pytest.raises(SourceExhausted, match="no untrained documents left for cycle"):
        run_preparer(line, ahead=40, once=True)
    status = read_status(line.path)[0]
    assert status["state"] == "failed" and "no untrained documents" in status["last_error"]
    assert "data is used up" in status["fix"]
    result = subprocess.run(
        preparer_command(line.path, "--ahead", "40", "--once"), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 78  # stopped for good: not a refusal (2), which a supervisor retries
    assert result.stderr.startswith("nsconsole: ") and "source " in result.stderr
    assert "data is used up" in result.stderr
    assert len(result.stderr.splitlines()) == 1


def test_the_terminal_view_shows_progress_and_says_why_it_waits() -> None:
    import io

    from rich.console import Console

    from datalines.status import PreparerStatus
    from nsconsole.commands.data import PreparerView

    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=120)
    with PreparerView(interactive=True, console=console) as view:
        message = "cycle 0: tokenizing web/news"
        view.update(PreparerStatus(state="preparing", cycle=0, progress=0.5, message=message))
        reason = "disk: 0.10 GB free < 2.00 GB needed"
        view.update(PreparerStatus(state="waiting", cycle=1, waiting_reason=reason))
    shown = screen.getvalue()
    assert "waiting: disk: 0.10 GB free < 2.00 GB needed" in shown
    assert "50%" in shown and "preparing: cycle 0: tokenizing web/news" in shown
