"""Issue 24 on real GPUs: several lines and one line over several GPUs of one host. Needs 2 or more
GPUs (skipped below that); run by `bash bench/gpu_suite.sh multi`.

- Two lines at once (`device: auto`), each under its own real supervisor: each holds the lease of a
  GPU of its own, NVML lists each trainer on its own GPU and on no other, and the console (the real
  app, attached to both supervisors) shows both GPUs with the line on each.
- A line over two GPUs (parallel.degree 2, NCCL, the CUDA-graph engine) under the real supervisor:
  one rank SIGKILLed mid-training ends the group (torchrun stops the other rank), the supervisor
  relaunches it from the newest checkpoint, and rows.jsonl has every update once, in order.
- A checkpoint saved by two ranks on two GPUs continues at degree 1 on one GPU. CUDA lines are not
  bit-identical run to run, so how far two plain degree-1 runs differ is measured first (as in
  tests/engine/training/test_distributed_cuda.py); the degree-2-then-1 line may differ from the
  plain one by no more than twice that.

The CPU versions are tests/engine/gpu/test_gpu_lines.py (a fake NVML host),
tests/engine/supervisor/test_supervise_distributed.py and tests/engine/training/test_distributed.py
(gloo ranks). Every trainer runs in a child process and this pytest process never touches CUDA
(`torch.cuda.device_count` and NVML make no context): a context of its own on a GPU would be
"another process" there, and the lines' GPU-sharing guard would leave the GPU to it.

The data lines have their first PREPARED_CYCLES cycles prepared only: a line that has trained them
waits for the next one, alive and holding its GPUs, however fast the GPUs are, until the test
prepares the rest (the console test stops its lines while they train or wait; the kill test
prepares the rest after the kill).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import pytest
import torch
from helpers import REPOSITORY
from helpers.lines import copy_data_line, data_template_fixture, line_readings, line_spread, make_line
from helpers.supervise import RUNNER, gone, stop_supervisor

from datalines import open_data_line
from datalines.preparer import prepare_cycle
from engine.checkpoints.format import read_latest, verify_line_checkpoints
from engine.checkpoints.tensors import load_checkpoint
from engine.config.run import RunConfig
from engine.gpu.devices import GpuSnapshot, gpu_snapshot, lease_holder
from engine.supervisor.registry import line_id

if TYPE_CHECKING:
    from nsconsole.app import ConsoleApp
    from nsconsole.state import LineView

pytestmark = [
    pytest.mark.usefixtures("private_host"),
    pytest.mark.cuda,
    pytest.mark.skipif(
        torch.cuda.device_count() < 2,
        reason=f"needs 2 GPUs of one host, {torch.cuda.device_count()} here (bash bench/gpu_suite.sh multi)",
    ),
]

PREPARED_CYCLES = 2
"""Cycles of the data template prepared (of its 4): about 19 updates, then a line waits for data."""

data_template = data_template_fixture(prepare=PREPARED_CYCLES)

QUIET = {"wandb.mode": "disabled"}
"""W&B is not what these tests are about: no W&B service process beside each trainer (nor its start)."""

START_TIMEOUT_S = 300.0
"""A cold CUDA start (torch's import, the layers' compile, the graphs' capture) up to its first rows."""
RUN_TIMEOUT_S = 600.0
"""A trainer or a supervisor run to its end."""
STOP_AT = 24
"""The kill test's last update: in cycle 2, which is prepared only after the kill."""
UPDATES = 12
"""The degree test's updates: 6 at degree 2, then 6 at degree 1 (all in cycles 0 and 1)."""


@pytest.fixture(autouse=True)
def no_cuda_context_here() -> None:
    """An earlier test of this pytest process that used CUDA would sit on GPU 0 as another process."""
    assert not torch.cuda.is_initialized(), "run these tests in a pytest process that has not used CUDA"


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[bytes]]]:
    """The processes a test starts. Any still running at its end is killed, and what it started
    (trainers, ranks: they stop when their parent dies) is waited for, then killed: a trainer left
    on a GPU would be another process there for the next test's line."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        if process.poll() is not None:
            continue
        try:
            descendants = psutil.Process(process.pid).children(recursive=True)
        except psutil.Error:
            descendants = []
        process.kill()
        process.wait()
        _gone, alive = psutil.wait_procs(descendants, timeout=60)
        for survivor in alive:
            with contextlib.suppress(psutil.Error):
                survivor.kill()


def supervise(root: Path, line: Path, **settings: object) -> subprocess.Popen[bytes]:
    """A real supervisor of `line` in a child process, polling fast, the preparer off (the test
    prepares the data line's cycles); the default engine: CUDA graphs on the GPU."""
    runner = root / "runner.py"
    runner.write_text(RUNNER)
    settings = {"poll_seconds": 0.1, "relaunch_delay_seconds": 0.05, "run_preparer": False, **settings}
    return subprocess.Popen([sys.executable, str(runner), str(line), json.dumps(settings)])


def supervisor_state(line: Path) -> dict[str, Any]:
    try:
        return json.loads((line / "supervisor.json").read_text())
    except (FileNotFoundError, ValueError):  # not written yet
        return {}


def log_tail(path: Path, characters: int = 3000) -> str:
    """The end of a log, for a failure's message."""
    try:
        return path.read_text(errors="replace")[-characters:]
    except FileNotFoundError:
        return f"({path} does not exist)"


def count_rows(line: Path) -> int:
    try:
        return (line / "rows.jsonl").read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def prepare_the_rest(data: Path) -> None:
    """Prepare the data line's cycles after the first PREPARED_CYCLES, up to its last."""
    line = open_data_line(data)
    index = PREPARED_CYCLES
    while True:
        prepare_cycle(line, index)
        last = line.last_cycle()
        if last is not None and index >= last:
            return
        index += 1


def pids_on(snapshot: GpuSnapshot, index: int) -> set[int]:
    """The compute processes NVML lists on GPU `index`."""
    return {process.pid for device in snapshot.devices if device.index == index for process in device.processes}


# ---- item 2: two lines, two GPUs, one console ---------------------------------------------------


def named_line(root: Path, name: str, data_template: Path) -> Path:
    """A line `root/name/name` beside its data line (make_line calls every line `line`, and the
    console shows lines by name)."""
    made = make_line(root / name, copy_data_line(data_template, root / name), device="auto", **QUIET)
    return made.rename(root / name / name)


def gpu_rows(app: ConsoleApp, selected: LineView) -> dict[int, str]:
    """The GPU panel's row of each GPU (NVML's index), as the running app draws it from its latest
    reading, with `selected` the line under the cursor (its memory drawn as █)."""
    from nsconsole.widgets.gpu_panel import GpuPanel

    panel = app.screen.query_one(GpuPanel)
    text = panel.render_text(app.gpu_reading, app.book, selected).plain
    return {int(row.split()[0][len("GPU"):]): row for row in text.splitlines() if row.startswith("GPU")}


@pytest.mark.timeout(900)
def test_two_lines_on_two_gpus_hold_a_lease_each_and_the_console_shows_both(
    tmp_path: Path, data_template: Path, children: list[subprocess.Popen[bytes]]
) -> None:
    # The console's modules load Textual, which the GPU image lacks unless its wheels are carried there:
    # imported here, so that this test alone skips without it.
    pytest.importorskip("textual", reason="the console needs textual (carry its wheels to the GPU host)")
    from helpers.console import until

    from nsconsole.app import ConsoleApp
    from nsconsole.widgets.lines_table import LinesTable

    lines = [named_line(tmp_path, name, data_template) for name in ("first", "second")]

    async def scenario() -> None:
        app = ConsoleApp(refresh_interval=0.2)
        async with app.run_test(size=(200, 50)) as pilot:
            children.extend(supervise(line.parent, line) for line in lines)
            views: list[LineView] = [
                await until(pilot, lambda line=line: app.book.get(line_id(line)), f"{line.name} in the console")
                for line in lines
            ]

            def training_on_their_gpus() -> bool:
                """Both lines trained an update, each on a GPU, and the console's latest NVML reading
                lists each trainer there."""
                for process, line in zip(children, lines, strict=True):
                    assert process.poll() is None, log_tail(line / "run.log")
                reading = app.gpu_reading
                if reading is None:
                    return False
                for view in views:
                    index, pid = view.gpu_index, view.trainer_pid
                    if not view.update or index is None or pid not in pids_on(reading.snapshot, index):
                        return False
                return True

            await until(pilot, training_on_their_gpus, "both lines training", timeout=START_TIMEOUT_S)
            first, second = views
            assert first.gpu_index is not None and second.gpu_index is not None
            assert first.gpu_index != second.gpu_index
            pairs = ((first, second), (second, first))
            # Each holds its GPU's lease (its trainer does), and NVML, read by this process now, lists
            # each trainer on its own GPU and not on the other's.
            snapshot = gpu_snapshot()
            for (view, other), line in zip(pairs, lines, strict=True):
                assert view.gpu_index is not None and other.gpu_index is not None
                holder = lease_holder(view.gpu_index)
                assert holder is not None and (holder.line, holder.pid) == (str(line), view.trainer_pid)
                uuid = snapshot.devices[view.gpu_index].uuid  # NVML's, the lease's and the supervisor's
                assert (holder.gpu, holder.uuid, view.status["gpu_uuid"]) == (view.gpu_index, uuid, uuid)
                assert view.trainer_pid in pids_on(snapshot, view.gpu_index)
                assert view.trainer_pid not in pids_on(snapshot, other.gpu_index)
            leased = {first.gpu_index, second.gpu_index}
            others = [device.index for device in snapshot.devices if device.index not in leased]
            assert [lease_holder(index) for index in others] == [None] * len(others)

            for line in lines:  # in the CUDA-graph engine, whose arena holds most of the GPU (the bars below)
                assert "CUDA graph capture failed" not in (line / "run.log").read_text()

            # The console: the lines table says where each line trains; the GPU panel shows every GPU,
            # each line's on its GPU's lease, the selected line's memory (█) on its own GPU alone.
            app.refresh_views()
            await pilot.pause()
            table = app.screen.query_one(LinesTable)
            for view in views:
                assert str(table.get_cell(view.key, "gpu")) == f"gpu{view.gpu_index}"
            for view, other in pairs:
                assert view.gpu_index is not None and other.gpu_index is not None
                rows = gpu_rows(app, view)
                assert sorted(rows) == [device.index for device in snapshot.devices]
                assert f"lease: {view.name}" in rows[view.gpu_index] and "█" in rows[view.gpu_index]
                assert f"lease: {other.name}" in rows[other.gpu_index] and "█" not in rows[other.gpu_index]
                assert all("lease: free" in rows[index] for index in others)

            # Stopped over their sockets (in threads: the app runs on meanwhile).
            for line in lines:
                await asyncio.to_thread(stop_supervisor, line)

    asyncio.run(scenario())
    assert [process.wait(timeout=60) for process in children] == [0, 0]
    for line in lines:  # each trainer's own NVML checks saw no other process on its GPU
        rows = [json.loads(text) for text in (line / "rows.jsonl").read_text().splitlines()]
        assert rows and all(row["gpu_mode"] == "own" for row in rows)
    assert all(lease_holder(device.index) is None for device in gpu_snapshot().devices)


# ---- item 3: a rank SIGKILLed on its GPU ---------------------------------------------------------


def group_ranks(line: Path, supervisor: subprocess.Popen[bytes]) -> dict[int, psutil.Process]:
    """The running group's two ranks, by rank: the children of torchrun (the trainer the supervisor
    launched), not what they start (Inductor's compile workers inherit RANK too)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert supervisor.poll() is None, log_tail(line / "run.log")
        pid = supervisor_state(line).get("trainer_pid")
        ranks: dict[int, psutil.Process] = {}
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(pid).children() if pid else []:
                rank = child.environ().get("RANK")
                if rank is not None:
                    ranks[int(rank)] = child
        if sorted(ranks) == [0, 1]:
            return ranks
        time.sleep(0.05)
    raise AssertionError(f"no group of two ranks appeared: {log_tail(line / 'run.log')}")


def wait_for_rows(line: Path, rows: int, supervisor: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while count_rows(line) < rows:
        assert time.monotonic() < deadline and supervisor.poll() is None, log_tail(line / "run.log")
        time.sleep(0.005)


@pytest.mark.timeout(900)
def test_a_rank_killed_on_its_gpu_ends_the_group_and_the_line_resumes_once(
    tmp_path: Path, data_template: Path, children: list[subprocess.Popen[bytes]]
) -> None:
    data = copy_data_line(data_template, tmp_path)
    line = make_line(tmp_path, data, device="cuda", **QUIET, **{"parallel.degree": 2})
    supervisor = supervise(tmp_path, line, stop_at=STOP_AT)
    children.append(supervisor)
    ranks = group_ranks(line, supervisor)
    wait_for_rows(line, 7, supervisor)  # past the checkpoint at update 5, and training

    # The group holds the leases of two GPUs, rank r's process on the r-th.
    state = supervisor_state(line)
    gpus = state["gpu_indices"]
    assert len(gpus) == 2 and gpus[0] == state["gpu_index"]
    snapshot = gpu_snapshot()
    for rank, index in enumerate(gpus):
        holder = lease_holder(index)
        assert holder is not None and (holder.line, holder.pid) == (str(line), state["trainer_pid"])
        assert ranks[rank].pid in pids_on(snapshot, index), (rank, index, snapshot.devices[index].processes)

    ranks[1].send_signal(signal.SIGKILL)
    prepare_the_rest(data)  # the relaunched group trains on to STOP_AT
    assert supervisor.wait(timeout=RUN_TIMEOUT_S) == 0, log_tail(line / "run.log")

    state = supervisor_state(line)
    assert (state["state"], state["launches"], state["crashes"]) == ("finished", 2, 1), log_tail(line / "run.log")
    assert len(state["gpu_indices"]) == 2
    assert all(gone(rank.pid) for rank in ranks.values())
    assert all(lease_holder(index) is None for index in gpus)
    # Every update once and in order, up to the checkpoint that ends the line, which counts them.
    updates = [json.loads(row)["update"] for row in (line / "rows.jsonl").read_text().splitlines()]
    assert updates == list(range(1, STOP_AT + 1))
    latest = load_checkpoint(line / "checkpoints" / read_latest(line / "checkpoints"))
    assert (latest.update, latest.state["rows"], latest.state["degree"]) == (STOP_AT, STOP_AT, 2)
    assert verify_line_checkpoints(line) == []
    run_log = (line / "run.log").read_text()
    resumes = re.findall(r"resumed from u(\d{8})", run_log)
    assert len(resumes) == 1 and int(resumes[0]) >= 5, resumes
    assert "CUDA graph capture failed" not in run_log
    assert "parameters on cuda:1" in (line / "ranks" / "rank1.log").read_text()


# ---- item 4: saved at degree 2 on two GPUs, resumed at degree 1 on one ---------------------------


def start_trainer(line: Path, stop_at: int, gpus: str, nproc: int = 1) -> subprocess.Popen[bytes]:
    """The line's trainer to `stop_at` on the GPUs `gpus` (CUDA_VISIBLE_DEVICES): alone, or as
    `nproc` torchrun ranks (NCCL), as the supervisor starts it; its output in `<line>/../trainer.out`."""
    main = ["-m", "engine.training.main", str(line), "--parent", str(os.getpid()), "--stop-at", str(stop_at)]
    if nproc == 1:
        argv = [sys.executable, *main]
    else:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                "--max-restarts=0", *main]  # fmt: skip
    environment = dict(os.environ, PYTHONPATH=str(REPOSITORY), CUDA_VISIBLE_DEVICES=gpus)
    with open(line.parent / "trainer.out", "ab") as output:
        return subprocess.Popen(argv, cwd=REPOSITORY, env=environment, stdout=output, stderr=subprocess.STDOUT)


def finish(process: subprocess.Popen[bytes], line: Path) -> None:
    assert process.wait(timeout=RUN_TIMEOUT_S) == 0, log_tail(line.parent / "trainer.out")


def set_degree(line: Path, degree: int) -> None:
    document = json.loads((line / "run.json").read_text())
    document["parallel"]["degree"] = degree
    RunConfig.from_dict(document).save(line / "run.json")


@pytest.mark.timeout(1200)
def test_a_checkpoint_saved_on_two_gpus_continues_on_one(
    tmp_path: Path, data_template: Path, children: list[subprocess.Popen[bytes]]
) -> None:
    lines = {}
    for name, changes in (("plain", {}), ("again", {}), ("moved", {"parallel.degree": 2})):
        lines[name] = make_line(tmp_path / name, copy_data_line(data_template, tmp_path / name),
                                device="cuda", **QUIET, **changes)  # fmt: skip
    # The two plain runs at once, one a GPU: how far two runs of the line differ on these GPUs.
    plain = start_trainer(lines["plain"], UPDATES, "0")
    again = start_trainer(lines["again"], UPDATES, "1")
    children.extend((plain, again))
    finish(plain, lines["plain"])
    finish(again, lines["again"])

    moved = lines["moved"]
    group = start_trainer(moved, UPDATES // 2, "0,1", nproc=2)
    children.append(group)
    finish(group, moved)
    set_degree(moved, 1)
    alone = start_trainer(moved, UPDATES, "0")
    children.append(alone)
    finish(alone, moved)

    saved = load_checkpoint(moved / "checkpoints" / f"u{UPDATES // 2:08d}")
    assert saved.state["degree"] == 2
    latest = load_checkpoint(moved / "checkpoints" / read_latest(moved / "checkpoints"))
    assert (latest.update, latest.state["degree"]) == (UPDATES, 1)
    assert verify_line_checkpoints(moved) == []
    assert [json.loads(text)["update"] for text in (moved / "rows.jsonl").read_text().splitlines()] == list(
        range(1, UPDATES + 1)
    )
    run_log = (moved / "run.log").read_text()
    assert f"resumed from u{UPDATES // 2:08d}" in run_log
    assert "CUDA graph capture failed" not in run_log
    assert "parameters on cuda:1" in (moved / "ranks" / "rank1.log").read_text()  # rank 1 on the second GPU

    reference = line_readings(lines["plain"])
    noise = line_spread(reference, line_readings(lines["again"]))
    measured = line_spread(reference, line_readings(moved))
    print(f"plain vs plain {noise}, plain vs degree 2 then 1 {measured}")
    assert measured[0] <= 2 * noise[0] and measured[1] <= 2 * noise[1], (noise, measured)
