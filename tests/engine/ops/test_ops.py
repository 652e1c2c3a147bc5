"""new / check / status / stop on real line directories, through `nsconsole.cli.main`."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.supervise import this_process_as_trainer

import datalines
from engine.config.run import RunConfig
from engine.errors import ConfigError
from engine.metrics import METRICS_VERSION
from engine.models import presets
from engine.ops import check as checks
from engine.ops.lines import accept
from engine.ops.status import read_last_rows
from nsconsole.cli import main


@dataclasses.dataclass
class FakePresetConfig:
    vocab_size: int = 256
    width: int = 32

    def validate(self) -> None:
        """Every shape of this stand-in can be built (the registry's contract asks for the method)."""


@dataclasses.dataclass
class FakeDataLine:
    vocab_size: int
    eos_id: int
    tokenizer_json: str = "{}"
    cycle_tokens: int = 10**6

    def last_cycle(self) -> int | None:
        return 3  # the data line ends after 4 cycles: retention keeps at most 4 cycle ends


DATA_VOCAB = {"vocab": 512}
"""The vocabulary the fake data line reports (tests change it to make a mismatch)."""


def fake_preset_config(name: str, overrides: dict[str, Any] | None = None) -> FakePresetConfig:
    if name != "tiny-test":
        raise ConfigError(f"model.preset: unknown preset {name!r}")
    unknown = sorted(set(overrides or {}) - {spec.name for spec in dataclasses.fields(FakePresetConfig)})
    if unknown:
        raise ConfigError(f"model.overrides: unknown key {unknown[0]!r} for preset {name!r}")
    return dataclasses.replace(FakePresetConfig(), **(overrides or {}))


@pytest.fixture(autouse=True)
def environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The model registry and the data line reader are written alongside this module; their
    # entry points stand in, so these tests hold the line operations alone.
    monkeypatch.setattr(presets, "preset_names", lambda: ["tiny-test"])
    monkeypatch.setattr(presets, "preset_config", fake_preset_config)
    monkeypatch.setattr(presets, "family_of", lambda name: "tiny-test-family")  # holds no model buffers
    DATA_VOCAB["vocab"] = 512
    monkeypatch.setattr(
        datalines, "open_data_line", lambda path: FakeDataLine(DATA_VOCAB["vocab"], 0), raising=False
    )
    # Held-out rows need the real model registry and data line: tests/test_ops_real.py checks them.
    # The model the checks size (a checkpoint's disk): 8 x 8 + 8 parameters stand in for tiny-test's.
    monkeypatch.setattr(checks, "_meta_model", lambda config: torch.nn.Linear(8, 8))
    # Whether that model loads a checkpoint needs the real registry too (test_pssa_line_overrides.py).
    monkeypatch.setattr(checks, "_check_model_against_checkpoint", lambda *_: checks.CheckResult(True, "model: -"))
    monkeypatch.setattr(
        checks, "_check_heldout_rows", lambda layout, config, model: checks.CheckResult(True, "held-out rows")
    )
    # So does the memory estimate (tests/engine/models/test_memory_budget.py checks it).
    monkeypatch.setattr(checks, "_check_memory", lambda config, model: checks.CheckResult(True, "memory"))
    monkeypatch.delenv("NSCONSOLE_HOST", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def data_line(tmp_path: Path) -> Path:
    path = tmp_path / "data" / "trunk"
    path.mkdir(parents=True)
    (path / "dataline.json").write_text("{}")
    return path


@pytest.fixture
def line(tmp_path: Path, data_line: Path) -> Path:
    arguments = ["new", "runs/trunk", "--model", "tiny-test", "--data", str(data_line), "--seq-len", "64"]
    assert main(arguments) == 0
    return tmp_path / "runs" / "trunk"


def tree(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*"))


def edit_run_json(line: Path, edit: Any) -> None:
    document = json.loads((line / "run.json").read_text())
    edit(document)
    (line / "run.json").write_text(json.dumps(document))


# -- new ------------------------------------------------------------------------------------------


def test_new_writes_a_valid_line(line: Path, data_line: Path) -> None:
    assert tree(line) == ["checkpoints", "run.json"]  # no accepted_run.json: the first start accepts
    config = RunConfig.load(line / "run.json")
    assert config.model.preset == "tiny-test"
    assert config.model.overrides == {"vocab_size": 512}  # follows the data line's tokenizer
    assert config.data.line == str(data_line)
    assert config.plan[0].seq_len == 64 and config.lengths[0].seq_len == 64
    assert config.tokens_per_update == 262144


def test_new_with_every_option(tmp_path: Path, data_line: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ramp = '[{"from":0,"to":4.7e9,"tokens":262144},{"from":4.7e9,"to":null,"tokens":393216}]'
    status = main([
        "new", "runs/b", "--model", "tiny-test", "--data", str(data_line), "--peak-lr", "1e-3",
        "--tokens-per-update", ramp, "--weight-decay-batch", "1048576", "--ema-horizon-tokens", "2e9",
        "--seq-len", "2048", "--override", "width=64", "--override", "vocab_size=300",
    ])
    assert status == 0
    assert capsys.readouterr().out.startswith(f"created {tmp_path / 'runs' / 'b'}: tiny-test")
    config = RunConfig.load(tmp_path / "runs" / "b" / "run.json")
    assert config.lr.peak == 1e-3
    assert [piece.tokens for piece in config.ramp()] == [262144, 393216]
    assert config.optimizer.weight_decay_batch == 1048576
    assert config.ema is not None and config.ema.horizon_tokens == 2e9 and config.ema.from_tokens == 2e9
    assert config.model.overrides == {"width": 64, "vocab_size": 300}  # an explicit vocab_size is kept


def test_new_default_batch_is_whole_rows(tmp_path: Path, data_line: Path) -> None:
    assert main(["new", "odd", "--model", "tiny-test", "--data", str(data_line), "--seq-len", "3000"]) == 0
    assert RunConfig.load(tmp_path / "odd" / "run.json").tokens_per_update == 87 * 3000


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--model", "gpt-5"], "--model: 'gpt-5' is not a preset (known: tiny-test)"),
        (["--data", "data/none"], "data/none: no such data line directory"),
        (["--data", "data"], "data: not a data line (no dataline.json)"),
        (["--tokens-per-update", "[{"], "--tokens-per-update: not a number or JSON ramp"),
        (["--tokens-per-update", '"x"'],
         "--tokens-per-update: tokens_per_update must be an integer or a list"),
        (["--tokens-per-update", "1000"],
         "tokens_per_update 1000 is not a multiple of plan[0] (trunk)'s seq_len 64"),
        (["--peak-lr", "-1"], "lr.peak must be positive, got -1.0"),
        (["--seq-len", "0"], "lengths[0].seq_len must be at least 2, got 0"),  # not the default 4096
        (["--override", "depth=3"], "model.overrides: unknown key 'depth' for preset 'tiny-test'"),
    ],
)
def test_new_refuses_and_writes_nothing(
    tmp_path: Path, data_line: Path, capsys: pytest.CaptureFixture[str], arguments: list[str], message: str
) -> None:
    base = {"--model": "tiny-test", "--data": str(data_line), "--seq-len": "64"}
    for flag, value in zip(arguments[::2], arguments[1::2]):
        base[flag] = value
    before = tree(tmp_path)
    assert main(["new", "runs/x", *[item for pair in base.items() for item in pair]]) == 2
    error = capsys.readouterr().err
    assert error.startswith("nsconsole: ") and message in error, error
    assert error.count("\n") == 1
    assert tree(tmp_path) == before


def test_new_refuses_an_existing_line(
    line: Path, data_line: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = (line / "run.json").read_bytes()
    assert main(["new", str(line), "--model", "tiny-test", "--data", str(data_line)]) == 2
    assert f"{line / 'run.json'}: already exists" in capsys.readouterr().err
    assert (line / "run.json").read_bytes() == before


def test_new_resolves_relative_lines_under_work_root(
    tmp_path: Path, data_line: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    host = tmp_path / "host.json"
    host.write_text(json.dumps({"work_root": str(tmp_path / "lines")}))
    monkeypatch.setenv("NSCONSOLE_HOST", str(host))
    (tmp_path / "lines" / "data").mkdir(parents=True)
    data_line.rename(tmp_path / "lines" / "data" / "trunk")
    assert main(["new", "trunk", "--model", "tiny-test", "--data", "data/trunk", "--seq-len", "64"]) == 0
    config = RunConfig.load(tmp_path / "lines" / "trunk" / "run.json")
    assert config.data.line == str(tmp_path / "lines" / "data" / "trunk")


# -- check ----------------------------------------------------------------------------------------


def check_output(line: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    status = main(["check", str(line)])
    captured = capsys.readouterr()
    return status, (captured.out + captured.err).splitlines()


def test_check_passes_on_a_new_line(line: Path, data_line: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, lines = check_output(line, capsys)
    assert status == 0, lines
    # The one warning: the default warmup (2e8 tokens) outlasts the fake data line's 4 cycles of 1e6.
    assert [text for text in lines if not text.startswith("ok: ")] == [
        "warn: lr warmup: lr.pieces[0].until is 200,000,000 tokens, but its data line "
        f"{data_line} holds about 4,000,000: the line would end still warming up, never at its "
        "peak rate; set lr.pieces[0].until in run.json to a fraction of that"
    ]
    assert any(text.startswith("ok: run.json: valid (tiny-test; plan trunk@64)") for text in lines)
    assert any("vocab 512 = model's" in text for text in lines)
    assert "ok: checkpoints: none yet" in lines


def test_check_refuses_an_unlisted_lifelong_change(line: Path, capsys: pytest.CaptureFixture[str]) -> None:
    accept(line)  # as the line's first start does
    edit_run_json(line, lambda d: d["optimizer"].update(weight_decay=0.05))
    status, lines = check_output(line, capsys)
    assert status == 1
    assert "FAIL: run.json: optimizer.weight_decay changed from 0.1 to 0.05 " \
        '(add "optimizer.weight_decay" to allow_changes to change it on purpose)' in lines
    edit_run_json(line, lambda d: d.update(allow_changes=["optimizer.weight_decay"]))
    assert check_output(line, capsys)[0] == 0



class CycleStarts:
    """A data line whose cycles start every 100,000 tokens, the rest as the line's data line is."""

    def __init__(self, line: Any) -> None:
        self.line = line

    def __getattr__(self, name: str) -> Any:
        return getattr(self.line, name)

    def cycle_start_tokens(self, index: int) -> int:
        return index * 100_000


def test_check_refuses_a_schedule_grown_from_a_point_already_trained(
    line: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A line stopped at 46,080 tokens (cycle 0, 720 samples of 64) whose open lr piece is closed
    # at 30,000: the schedule grew at its end, but from a point the line had trained past.
    edit_run_json(line, lambda d: d["lr"]["pieces"][0].update(until=20000))
    accept(line)
    checkpoint = line / "checkpoints" / "u00000045"
    checkpoint.mkdir(parents=True)
    position = {"update": 45, "tokens_trained": 46080, "stage": 0, "stage_tokens": 46080, "cycle": 0,
                "sample": 720, "earlier": []}
    (checkpoint / "state.json").write_text(json.dumps({"position": position, "data": {"seq_len": 64}}))
    (line / "checkpoints" / "latest").write_text("u00000045")
    real_open = datalines.open_data_line
    monkeypatch.setattr(datalines, "open_data_line", lambda path: CycleStarts(real_open(path)))
    edit_run_json(line, lambda d: d["lr"]["pieces"][1].update(until=30000) or d["lr"]["pieces"].append(
        {"kind": "decay", "until": 90000, "to": 0.1, "shape": "linear"}))
    status, lines = check_output(line, capsys)
    assert status == 1
    assert "FAIL: run.json: lr.pieces piece 1 closed at 30,000, before the 46,080 tokens this line has trained: " \
        "only there or later (the schedule may only grow at its end)" in lines
    # Every start asks the same (`accept`: the trainer's, a supervisor's relaunch, --foreground).
    with pytest.raises(ConfigError, match="piece 1 closed at 30,000, before the 46,080 tokens"):
        accept(line)
    edit_run_json(line, lambda d: d["lr"]["pieces"][1].update(until=46080))
    assert "ok: lifelong keys: unchanged since accepted_run.json (or allowed)" in check_output(line, capsys)[1]


def test_check_vocab_metrics_sharing_and_data(line: Path, capsys: pytest.CaptureFixture[str]) -> None:
    DATA_VOCAB["vocab"] = 1024
    status, lines = check_output(line, capsys)
    assert status == 1
    assert any("has a tokenizer of 1024 tokens but the model's vocab_size is 512" in text for text in lines)
    DATA_VOCAB["vocab"] = 512
    edit_run_json(line, lambda d: d.update(metrics=99))
    status, lines = check_output(line, capsys)
    assert status == 1 and any(f"metrics is version 99 but this code computes version {METRICS_VERSION}" in t for t in lines)
    edit_run_json(line, lambda d: (d.update(metrics=METRICS_VERSION), d["guards"].update(share_reserve_gb=24)))
    status, lines = check_output(line, capsys)
    assert status == 1 and any("length 64 has no shared shape" in t for t in lines)
    # The command to run names the line (a README walk found the literal `tune LINE --shared`).
    assert any(t.endswith(f"(run `nsconsole tune {line} --shared`)") for t in lines)
    edit_run_json(line, lambda d: d["lengths"][0].update(shared={"micro_batch_rows": 1}))
    assert check_output(line, capsys)[0] == 0
    edit_run_json(line, lambda d: d["data"].update(line=str(line / "missing")))
    edit_run_json(line, lambda d: d.update(allow_changes=["data"]))
    status, lines = check_output(line, capsys)
    assert status == 1 and f"FAIL: data line: {line / 'missing'}: no such data line directory" in lines


def test_check_malformed_run_json_is_status_2(line: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (line / "run.json").write_text('{"model": ')
    status, lines = check_output(line, capsys)
    assert status == 2
    assert lines == [f"nsconsole: {line / 'run.json'}: malformed JSON at line 1 column 11: Expecting value"]


def test_check_verifies_the_checkpoints(line: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (line / "checkpoints" / "u00000010").mkdir()  # a checkpoint with none of its files
    status, lines = check_output(line, capsys)
    assert status == 1
    assert any(text.startswith("FAIL: checkpoints: ") and "u00000010" in text for text in lines), lines


def test_check_wants_room_for_a_checkpoint(
    line: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Above the guard's floor but below 1.5x the first checkpoint (72 parameters x 12 bytes: fp32
    # weights and two moments, no average; + the tokenizer): the trainer would refuse to start.
    edit_run_json(line, lambda d: d["guards"].update(min_free_disk_gb=0))
    full = shutil.disk_usage(line)._replace(free=1000)
    monkeypatch.setattr(checks.shutil, "disk_usage", lambda path: full)
    status, lines = check_output(line, capsys)
    assert status == 1
    assert any(
        "too little for the next checkpoint (a checkpoint about 8.07e-07 GiB, estimated: 72 parameters x 12 bytes"
        in text and text.endswith("the trainer would not start")
        for text in lines
    ), lines


def test_accept_refuses_then_records(line: Path) -> None:
    accept(line)  # the first start
    edit_run_json(line, lambda d: d["seeds"].update(data=3))
    with pytest.raises(ConfigError, match=r"run\.json: seeds\.data changed from 0 to 3"):
        accept(line)
    assert RunConfig.load(line / "accepted_run.json").seeds.data == 0
    edit_run_json(line, lambda d: d.update(allow_changes=["seeds"]))
    accept(line)
    assert RunConfig.load(line / "accepted_run.json").seeds.data == 3
    # The listing was used up: run.json no longer lists it, so the next edit is caught again.
    assert RunConfig.load(line / "run.json").allow_changes == []
    assert RunConfig.load(line / "accepted_run.json").allow_changes == []
    edit_run_json(line, lambda d: d["seeds"].update(data=4))
    with pytest.raises(ConfigError, match=r"seeds\.data changed from 3 to 4"):
        accept(line)


def test_accept_leaves_a_run_json_edited_since_it_was_read(line: Path) -> None:
    edit_run_json(line, lambda d: (d["seeds"].update(data=3), d.update(allow_changes=["seeds"])))
    config = RunConfig.load(line / "run.json")
    edit_run_json(line, lambda d: d.update(print_every=7))  # edited after the trainer read it
    accept(line, config)
    assert RunConfig.load(line / "run.json").allow_changes == ["seeds"]
    assert RunConfig.load(line / "accepted_run.json").seeds.data == 3


# -- status and stop ------------------------------------------------------------------------------


def test_status_of_a_new_line(line: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", str(line)]) == 0
    out = capsys.readouterr().out
    assert f"line: {line}" in out
    assert "model: tiny-test" in out and "plan: trunk at 64 for the rest of the data" in out
    assert "heartbeat: none" in out and "rows: none yet" in out and "checkpoints: none yet" in out
    assert "STOP" not in out


def test_status_reads_rows_heartbeat_checkpoints_and_stop(
    line: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [{"update": u, "tokens": u * 4096, "loss": 5.0 - u / 10, "lr": 1e-4} for u in range(1, 11)]
    with (line / "rows.jsonl").open("w") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in rows)
        handle.write('{"update": 11, "tok')  # a write cut short
    heartbeat = {"time": time.time() - 300, "update": 10, "stage": "trunk", **this_process_as_trainer()}
    (line / "heartbeat").write_text(json.dumps(heartbeat))
    (line / "checkpoints" / "u00000010").mkdir()
    (line / "checkpoints" / "latest").write_text("u00000010\n")
    assert main(["stop", str(line), "--at-cycle-end", "2"]) == 0
    capsys.readouterr()
    assert main(["status", str(line), "--rows", "3"]) == 0
    out = capsys.readouterr().out
    assert "rows (newest 3):" in out
    assert "update 8  tokens 32768  loss 4.2  lr 0.0001" in out
    assert "update 10 " in out and "update 7 " not in out
    assert "the last line of rows.jsonl is incomplete" in out
    assert f"heartbeat: 5 min ago, update 10, stage trunk, pid {os.getpid()} (alive)" in out
    assert "checkpoints: 1 (u00000010); latest u00000010" in out
    assert "STOP pending: at the end of cycle 2" in out


@pytest.mark.parametrize("rows", ["0", "-1"])
def test_status_refuses_fewer_than_one_row(line: Path, capsys: pytest.CaptureFixture[str], rows: str) -> None:
    """`--rows 0` read none and reported "rows: none yet" of a line that has rows."""
    (line / "rows.jsonl").write_text(json.dumps({"update": 1, "loss": 5.0}) + "\n")
    with pytest.raises(SystemExit) as ended:
        main(["status", str(line), "--rows", rows])
    assert ended.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"nsconsole status: error: argument --rows: must be at least 1, got {rows}"
    )


def test_status_says_which_checkpoints_it_lists(line: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for update in (100, 200, 300, 400, 493):
        (line / "checkpoints" / f"u{update:08d}").mkdir()
    (line / "checkpoints" / "latest").write_text("u00000493\n")
    assert main(["status", str(line)]) == 0
    out = capsys.readouterr().out
    assert "checkpoints: 5 (newest 3: u00000300, u00000400, u00000493); latest u00000493\n" in out


def test_status_says_w_and_b_is_disabled(line: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", str(line)]) == 0
    assert "W&B: no run yet\n" in capsys.readouterr().out  # offline, nothing sent yet
    edit_run_json(line, lambda document: document["wandb"].update(mode="disabled"))
    assert main(["status", str(line)]) == 0
    assert "W&B: disabled (run.json wandb.mode)\n" in capsys.readouterr().out


def test_read_last_rows_across_blocks(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"update": u, "pad": "x" * 90}) + "\n" for u in range(5000)))
    rows, torn, bad = read_last_rows(path, 3)
    assert [row["update"] for row in rows] == [4997, 4998, 4999] and not torn and bad == 0
    rows, _, _ = read_last_rows(path, 6000)
    assert len(rows) == 5000 and rows[0]["update"] == 0
    assert read_last_rows(tmp_path / "none.jsonl", 3) == ([], False, 0)


def test_stop_writes_the_request_atomically(line: Path, capsys: pytest.CaptureFixture[str]) -> None:
    beat = {"time": time.time(), "update": 3, "stage": "training", "pid": os.getpid()}
    (line / "heartbeat").write_text(json.dumps(beat))  # a trainer runs the line
    assert main(["stop", str(line)]) == 0
    assert "at the next update" in capsys.readouterr().out
    request = json.loads((line / "STOP").read_text())
    assert set(request) == {"requested", "at_cycle_end"} and request["at_cycle_end"] is None
    assert main(["stop", str(line), "--at-cycle-end", "1"]) == 0
    assert json.loads((line / "STOP").read_text())["at_cycle_end"] == 1
    assert [path.name for path in line.iterdir() if path.name.startswith(".")] == []  # no temporary left


def test_stop_refuses_a_non_line_and_a_negative_cycle(
    tmp_path: Path, line: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["stop", str(tmp_path / "data")]) == 2
    assert "not a training line (no run.json)" in capsys.readouterr().err
    assert main(["stop", str(line), "--at-cycle-end", "-1"]) == 2
    assert not (line / "STOP").exists()
