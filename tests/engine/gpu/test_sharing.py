"""GPU sharing (engine.gpu.sharing): the decision over scripted readings, and a CPU line driven through
sharing, taking its own shapes back, and leaving the GPU (checkpoint, GpuBusy, exit 75)."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers.lines import (
    copy_data_line,
    data_template_fixture,
    make_line,
    rows_without_wall_clock,
)

from engine.checkpoints.format import read_latest
from engine.checkpoints.tensors import load_checkpoint
from engine.config.run import RunConfig
from engine.errors import ConfigError
from engine.gpu.devices import GpuDevice, GpuProcess, GpuSnapshot
from engine.gpu.sharing import (
    Action,
    GpuBusy,
    GpuMode,
    GpuReading,
    GpuWatch,
    SharingState,
    decide,
    reading_from_snapshot,
    refuse_unshareable_lengths,
    unshareable_lengths_problem,
)
from engine.protocol.facts import TrainerExitCode
from engine.training import engines as step_engines
from engine.training import main as supervised_trainer
from engine.training import trainer as trainer_module
from engine.training.engines import StepEngines
from engine.training.step import EagerEngine, UpdateResult
from engine.training.trainer import Trainer
from engine.units import GIB

RESERVE_GB = 1.0
CHECK_EVERY = 2
STOP_AT = 14
NOBODY = GpuReading(others=0, others_bytes=0)
SMALL = GpuReading(others=1, others_bytes=GIB // 2)
LARGE = GpuReading(others=1, others_bytes=2 * GIB)


def fold(readings: list[GpuReading], reserve_bytes: int | None) -> list[tuple[str, str]]:
    """(action, mode after it) for each reading of a sequence, from a line on its own."""
    state = SharingState()
    steps = []
    for reading in readings:
        action, state = decide(state, reading, reserve_bytes)
        steps.append((action, state.mode))
    return steps


def test_others_appearing_within_the_reserve_share_and_past_it_leave() -> None:
    steps = fold([NOBODY, SMALL, SMALL, LARGE], GIB)
    assert steps == [
        (Action.STAY, GpuMode.OWN),
        (Action.SHARE, GpuMode.SHARED),
        (Action.STAY, GpuMode.SHARED),
        (Action.LEAVE, GpuMode.SHARED),
    ]
    assert fold([LARGE], GIB) == [(Action.LEAVE, GpuMode.OWN)]
    assert fold([GpuReading(others=2, others_bytes=GIB)], GIB) == [(Action.SHARE, GpuMode.SHARED)]


def test_without_a_reserve_any_other_process_means_leave() -> None:
    assert fold([NOBODY, GpuReading(others=1, others_bytes=0)], None) == [
        (Action.STAY, GpuMode.OWN),
        (Action.LEAVE, GpuMode.OWN),
    ]


@pytest.mark.parametrize("gone_for", [1, 2])
def test_others_gone_for_fewer_than_three_checks_keep_the_line_sharing(gone_for: int) -> None:
    steps = fold([SMALL] + [NOBODY] * gone_for + [SMALL, NOBODY, NOBODY], GIB)
    assert all(mode == GpuMode.SHARED for _action, mode in steps)
    assert [action for action, _mode in steps].count(Action.SHARE) == 1


def test_others_gone_for_three_checks_in_a_row_give_the_line_its_own_shapes_back() -> None:
    steps = fold([SMALL, NOBODY, NOBODY, NOBODY, NOBODY, SMALL], GIB)
    assert [action for action, _mode in steps] == [
        Action.SHARE,
        Action.STAY,
        Action.STAY,
        Action.OWN,
        Action.STAY,
        Action.SHARE,
    ]
    assert steps[3][1] == GpuMode.OWN


def test_a_snapshot_reading_leaves_the_trainer_out_and_assumes_the_worst_where_unknown() -> None:
    def snapshot(processes: list[GpuProcess]) -> GpuSnapshot:
        device = GpuDevice(0, "gpu", "uuid", 80 * GIB, 30 * GIB, None, processes)
        return GpuSnapshot(available=True, reason="", driver="1", devices=[device])

    own = GpuProcess(pid=100, used_memory=20 * GIB)
    assert reading_from_snapshot(snapshot([own]), "uuid", 100) == NOBODY
    known = snapshot([own, GpuProcess(pid=7, used_memory=3 * GIB)])
    assert reading_from_snapshot(known, "uuid", 100) == GpuReading(others=1, others_bytes=3 * GIB)
    unknown = snapshot([own, GpuProcess(pid=7, used_memory=None)])
    assert reading_from_snapshot(unknown, "uuid", 100) == GpuReading(others=1, others_bytes=10 * GIB)
    no_gpu = GpuSnapshot(available=False, reason="no NVIDIA GPU", driver="", devices=[])
    assert reading_from_snapshot(no_gpu, "uuid", 100) == NOBODY
    # The trainer's GPU is found by its UUID, not its CUDA index (cuda:0 under the supervisor's
    # CUDA_VISIBLE_DEVICES is NVML's GPU 1 here): GPU 0's process is not on it.
    busy = GpuDevice(0, "gpu", "GPU-a", 80 * GIB, 5 * GIB, None, [GpuProcess(pid=7, used_memory=5 * GIB)])
    mine = GpuDevice(1, "gpu", "GPU-b", 80 * GIB, 20 * GIB, None, [own])
    two = GpuSnapshot(available=True, reason="", driver="1", devices=[busy, mine])
    assert reading_from_snapshot(two, "GPU-b", 100) == NOBODY
    assert reading_from_snapshot(two, "GPU-a", 100) == GpuReading(others=1, others_bytes=5 * GIB)


def test_the_room_left_to_others_is_the_reserve_less_what_they_hold() -> None:
    readings = iter([SMALL, NOBODY, LARGE])
    watch = GpuWatch(every=1, reserve_bytes=GIB, reader=lambda: next(readings), enabled=True)
    assert watch.check(0) == (Action.SHARE, SMALL)
    assert watch.room_for_others() == GIB - SMALL.others_bytes
    watch.check(1)
    assert watch.room_for_others() == GIB
    assert watch.check(2)[0] == Action.LEAVE
    assert watch.room_for_others() == 0


def test_a_cpu_line_never_checks(tmp_path: Path, data_template: Path) -> None:
    config = RunConfig.load(sharing_line(tmp_path, data_template) / "run.json")
    watch = GpuWatch.for_line(config, torch.device("cpu"), reader=lambda: pytest.fail("read on a CPU line"))
    assert not any(watch.due(update) for update in range(10))


# ---------------------------------------------------------------------------------------------
# a real CPU line, its watch forced on and fed scripted readings


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread


data_template = data_template_fixture(files=3)


def sharing_line(
    root: Path, data_template: Path, reserve_gb: float | None = RESERVE_GB, shared: bool = True
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    line = make_line(root, copy_data_line(data_template, root), **{"guards.gpu_check_every": CHECK_EVERY})
    document = RunConfig.load(line / "run.json").to_dict()
    document["guards"]["share_reserve_gb"] = reserve_gb
    if shared:
        document["lengths"][0]["shared"] = {"micro_batch_rows": 4, "recompute": "none"}
    config = RunConfig.from_dict(document)
    config.save(line / "run.json")
    config.save(line / "accepted_run.json")
    return line


def scripted(readings: list[GpuReading]) -> Callable[[], GpuReading]:
    """A reader returning `readings` in turn, then the last one forever."""
    calls = iter(readings)
    last = [readings[-1]]

    def read() -> GpuReading:
        last[0] = next(calls, last[0])
        return last[0]

    return read


def forced_watch(reader: Callable[[], GpuReading]) -> Callable[[RunConfig, torch.device], GpuWatch]:
    return partial(GpuWatch.for_line, reader=reader, enabled=True)


def train(line: Path, readings: list[GpuReading], stop_at: int = STOP_AT) -> Trainer:
    trainer = Trainer(line, stop_at=stop_at, echo=None, gpu_watch=forced_watch(scripted(readings)))
    assert trainer.run() == 0
    return trainer


def read_rows(line: Path) -> list[dict]:
    return [json.loads(text) for text in (line / "rows.jsonl").read_text().splitlines()]


def test_sharing_changes_the_split_not_the_update_and_the_line_takes_its_shapes_back(
    tmp_path: Path, data_template: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    splits: list[int] = []  # micro-batch rows of every update of the sharing line

    class RecordingEngine(EagerEngine):
        def run_update(self, windows: torch.Tensor, lr: float, weight_decay: float) -> UpdateResult:
            splits.append(self.micro_batch_rows)
            return super().run_update(windows, lr, weight_decay)

    alone = train(sharing_line(tmp_path / "alone", data_template), [NOBODY])
    # Checks at updates 0, 2, 4, ...: others at 2 and 4, gone at 6, 8, 10 -> own again from 10.
    shared_line = sharing_line(tmp_path / "shared", data_template)
    monkeypatch.setattr(step_engines, "EagerEngine", RecordingEngine)
    shared = train(shared_line, [NOBODY, SMALL, SMALL, NOBODY, NOBODY, NOBODY])
    assert splits == [8] * 2 + [4] * 8 + [8] * 4

    modes = [row["gpu_mode"] for row in read_rows(shared_line)]
    assert modes == ["own"] * 2 + ["shared"] * 8 + ["own"] * 4
    assert all(row["gpu_mode"] == "own" for row in read_rows(tmp_path / "alone" / "line"))
    log = (shared_line / "run.log").read_text()
    assert "training with the lengths' shared shapes from update 2" in log
    assert "training with the lengths' own shapes from update 10" in log

    alone_losses = [row["loss"] for row in read_rows(tmp_path / "alone" / "line")]
    shared_losses = [row["loss"] for row in read_rows(shared_line)]
    assert shared_losses == pytest.approx(alone_losses, rel=1e-5)
    torch.testing.assert_close(shared.optimizer.params, alone.optimizer.params, rtol=1e-4, atol=1e-5)
    # Another split of the same update sums in another order: equal up to rounding, not bit for bit.
    assert shared.engines.gpu_mode == GpuMode.OWN


def test_others_past_the_reserve_checkpoint_the_line_and_raise_gpu_busy(
    tmp_path: Path, data_template: Path
) -> None:
    line = sharing_line(tmp_path, data_template)
    trainer = Trainer(line, echo=None, gpu_watch=forced_watch(scripted([NOBODY, NOBODY, SMALL, LARGE])))
    dropped_before_stopping = []
    real_drop = StepEngines.drop

    def drop_and_note(engines: StepEngines) -> None:
        real_drop(engines)
        heartbeat = json.loads((line / "heartbeat").read_text())
        dropped_before_stopping.append((trainer.position.update, heartbeat.get("reason") != "gpu busy"))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(StepEngines, "drop", drop_and_note)
        with pytest.raises(GpuBusy, match="more than guards.share_reserve_gb = 1"):
            trainer.run()
    latest = load_checkpoint(line / "checkpoints" / str(read_latest(line / "checkpoints")))
    assert latest.update == 6  # the check at update 6 saw them past the reserve
    assert len(read_rows(line)) == 6
    assert "gpu busy" in (line / "heartbeat").read_text()
    # The memory went to the others before the line said it stopped (not only at its exit); the
    # switch to the shared shapes at update 4 dropped the engines too.
    assert (6, True) in dropped_before_stopping


def test_a_line_that_left_resumes_exactly_once_the_gpu_is_free(tmp_path: Path, data_template: Path) -> None:
    alone = train(sharing_line(tmp_path / "alone", data_template), [NOBODY])
    line = sharing_line(tmp_path / "left", data_template)
    with pytest.raises(GpuBusy):
        train(line, [NOBODY, NOBODY, LARGE])  # left at update 4, never having shared
    resumed = train(line, [NOBODY])
    assert rows_without_wall_clock(line / "rows.jsonl") == rows_without_wall_clock(
        tmp_path / "alone" / "line" / "rows.jsonl"
    )
    assert torch.equal(resumed.optimizer.params, alone.optimizer.params)


def test_a_reserve_with_a_length_without_a_shared_shape_is_refused_before_anything_is_written(
    tmp_path: Path, data_template: Path
) -> None:
    line = sharing_line(tmp_path, data_template, shared=False)
    with pytest.raises(ConfigError) as refused:
        Trainer(line, echo=None).run()
    # The tune command names this line, not a placeholder (a README walk found "tune LINE --shared").
    assert str(refused.value) == (f"{line / 'run.json'}: guards.share_reserve_gb is set but length 32 has no "
                                  f"shared shape (run `nsconsole tune {line} --shared`)")  # fmt: skip
    # Only the trainer's (empty) lock file is new: it is taken before anything is read.
    expected = ["accepted_run.json", "checkpoints", "run.json", "trainer.lock"]
    assert sorted(path.name for path in line.iterdir()) == expected
    assert (line / "trainer.lock").stat().st_size == 0
    assert not any((line / "checkpoints").iterdir())


def test_the_unshareable_lengths_check_is_one_statement_for_the_trainer_and_check() -> None:
    document = {
        "model": {"preset": "pssa-1.5m"}, "data": {"line": "d"},
        "lengths": [{"seq_len": 64}, {"seq_len": 128, "shared": {"micro_batch_rows": 1}}, {"seq_len": 256}],
        "plan": [{"name": "a", "seq_len": 256, "tokens": 1e6}, {"name": "b", "seq_len": 64, "tokens": 1e6},
                 {"name": "c", "seq_len": 128, "tokens": None}],
    }  # fmt: skip
    assert unshareable_lengths_problem(RunConfig.from_dict(document)) is None  # no reserve: nothing to share
    refuse_unshareable_lengths(RunConfig.from_dict(document))
    document["guards"] = {"share_reserve_gb": 2.0}
    config = RunConfig.from_dict(document)
    problem = unshareable_lengths_problem(config, "x/run.json")
    assert problem == (
        "x/run.json: guards.share_reserve_gb is set but lengths 64, 256 have no shared shape "
        "(run `nsconsole tune x --shared`)"
    )
    assert unshareable_lengths_problem(config, "run.json", "/lines/a").endswith("(run `nsconsole tune /lines/a --shared`)")
    with pytest.raises(ConfigError) as refused:
        refuse_unshareable_lengths(config, "x/run.json")
    assert str(refused.value) == problem  # the trainer's refusal is `nsconsole check`'s finding
    for length in document["lengths"]:
        length["shared"] = {"micro_batch_rows": 1}
    assert unshareable_lengths_problem(RunConfig.from_dict(document)) is None


def test_the_supervised_trainer_maps_leaving_the_gpu_to_exit_75(
    tmp_path: Path, data_template: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    line = sharing_line(tmp_path, data_template, reserve_gb=None, shared=False)
    monkeypatch.setattr(supervised_trainer, "die_with_parent", lambda _pid: True)
    watch = forced_watch(scripted([NOBODY, GpuReading(others=1, others_bytes=1 << 20)]))
    monkeypatch.setattr(trainer_module, "Trainer", partial(Trainer, gpu_watch=watch))
    assert supervised_trainer.main([str(line), "--parent", "1"]) == TrainerExitCode.GPU_BUSY
    assert "guards.share_reserve_gb is not set" in capsys.readouterr().err
    assert read_latest(line / "checkpoints") is not None
    assert load_checkpoint(line / "checkpoints" / str(read_latest(line / "checkpoints"))).update == 2


class OutOfMemoryWhenShared(EagerEngine):
    """An engine whose shared shape finds no memory: what a capture beside others can meet when
    they took memory in the gap between the old arena's close and the new one's hold."""

    def run_update(self, windows: torch.Tensor, lr: float, weight_decay: float) -> UpdateResult:
        if self.micro_batch_rows == 4:  # the shared shape of `sharing_line`
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 MiB.")
        return super().run_update(windows, lr, weight_decay)


def test_out_of_memory_beside_others_checkpoints_the_line_and_leaves_without_losing_an_update(
    tmp_path: Path, data_template: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    alone = train(sharing_line(tmp_path / "alone", data_template), [NOBODY])
    line = sharing_line(tmp_path / "oom", data_template)
    monkeypatch.setattr(step_engines, "EagerEngine", OutOfMemoryWhenShared)
    trainer = Trainer(line, echo=None, gpu_watch=forced_watch(scripted([NOBODY, SMALL])))
    with pytest.raises(GpuBusy, match="out of memory in update 3 beside 1 other process"):
        trainer.run()
    assert load_checkpoint(line / "checkpoints" / str(read_latest(line / "checkpoints"))).update == 2
    monkeypatch.setattr(step_engines, "EagerEngine", EagerEngine)
    resumed = train(line, [NOBODY])  # relaunched on a free GPU: the same line as one never shared
    assert rows_without_wall_clock(line / "rows.jsonl") == rows_without_wall_clock(
        tmp_path / "alone" / "line" / "rows.jsonl"
    )
    assert torch.equal(resumed.optimizer.params, alone.optimizer.params)


def test_out_of_memory_alone_is_the_line_s_error_not_a_reason_to_leave(
    tmp_path: Path, data_template: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    line = sharing_line(tmp_path, data_template)
    document = RunConfig.load(line / "run.json").to_dict()
    document["lengths"][0]["micro_batch_rows"] = 4  # its own shape is the one that runs out
    RunConfig.from_dict(document).save(line / "run.json")
    monkeypatch.setattr(step_engines, "EagerEngine", OutOfMemoryWhenShared)
    with pytest.raises(torch.OutOfMemoryError):
        Trainer(line, echo=None, gpu_watch=forced_watch(scripted([NOBODY]))).run()


class PinnedArena:
    """An arena whose memory does not come back when it closes (a block of its pool still held)."""

    held_bytes = 100 * GIB

    def close(self) -> int:
        return 3 * GIB


def test_a_switch_whose_arena_memory_does_not_come_back_checkpoints_and_leaves(
    tmp_path: Path, data_template: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class EnginesWithAnArena(StepEngines):
        def for_length(self, seq_len: int):
            if self.arena is None:
                self.arena = PinnedArena()
            return super().for_length(seq_len)

    monkeypatch.setattr(trainer_module, "StepEngines", EnginesWithAnArena)
    line = sharing_line(tmp_path, data_template)
    trainer = Trainer(line, echo=None, gpu_watch=forced_watch(scripted([NOBODY, SMALL])))
    with pytest.raises(
        GpuBusy, match=r"the arena's 100\.0 GiB did not come back for the switch to the shared shapes"
    ):
        trainer.run()
    assert load_checkpoint(line / "checkpoints" / str(read_latest(line / "checkpoints"))).update == 2
    assert all(row["gpu_mode"] == "own" for row in read_rows(line))


# ---------------------------------------------------------------------------------------------
# holding what the others free past their room (the GPU side: tests/test_trainer_cuda.py)


class HoldingEngines:
    """The part of StepEngines the check uses, over a device with `free` bytes free."""

    def __init__(self, free: int) -> None:
        self.arena = object()
        self.free = free
        self.held: list[int] = []

    def free_bytes(self) -> int:
        return self.free

    def hold_past(self, room: int, free: int) -> int:
        self.held.append(free - room)
        return free - room


def checking_trainer(readings: list[GpuReading], free: int) -> tuple[SimpleNamespace, list[str]]:
    watch = GpuWatch(every=1, reserve_bytes=4 * GIB, reader=scripted(readings), enabled=True)
    watch.check(0)  # the check's own reading: readings[0]
    logged: list[str] = []
    trainer = SimpleNamespace(
        engines=HoldingEngines(free), gpu_watch=watch, log=SimpleNamespace(write=logged.append)
    )
    return trainer, logged


def test_a_check_while_sharing_holds_what_is_free_past_the_reserve_less_their_use() -> None:
    trainer, logged = checking_trainer([SMALL, SMALL], free=10 * GIB)
    Trainer._hold_past_the_reserve(trainer, SMALL)
    # Room for the others: the 4 GiB reserve less the 0.5 GiB they hold; the rest is held.
    assert trainer.engines.held == [10 * GIB - (4 * GIB - GIB // 2)]
    assert logged == ["gpu: held 6.50 GiB more, leaving 3.50 GiB free: the reserve less the 0.50 GiB "
                      "the other processes hold"]  # fmt: skip


def test_a_check_that_sees_the_others_change_their_memory_holds_nothing() -> None:
    trainer, logged = checking_trainer([SMALL, LARGE], free=10 * GIB)
    Trainer._hold_past_the_reserve(trainer, SMALL)
    assert trainer.engines.held == [] and logged == []
