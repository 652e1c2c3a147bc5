"""`nsconsole run`, `stop` and `new` tell the truth (issue 20 item 10), on real tiny lines.

- `run` refuses, in the terminal, a line its trainer would refuse, instead of reporting a start
  that fails seconds later in supervisor.out;
- `stop` on a line that is not running says so and leaves no STOP to stop the next start at once;
- `new` leaves run.json open (its learning-rate schedule included) until the first start.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from helpers.lines import SEQ_LEN, TOKENS_PER_UPDATE, copy_data_line, data_template_fixture, make_line
from helpers.supervise import this_process_as_trainer

from engine.config.run import RunConfig
from engine.errors import LineError
from engine.supervisor import registry
from engine.training.trainer import Trainer
from nsconsole.cli import main
from nsconsole.commands.run import refuse_a_failing_start

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread

data_template = data_template_fixture()


@pytest.fixture(autouse=True)
def private_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No host.json and a private runtime directory: no supervisor of this machine is seen."""
    monkeypatch.delenv("NSCONSOLE_HOST", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "run").mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    return tmp_path / "run"


@pytest.fixture
def line(tmp_path: Path, data_template: Path) -> Path:
    return make_line(tmp_path, copy_data_line(data_template, tmp_path))


def rows(line: Path) -> list[dict[str, Any]]:
    return [json.loads(text) for text in (line / "rows.jsonl").read_text().splitlines()]


def edit_run_json(line: Path, edit: Any) -> None:
    document = json.loads((line / "run.json").read_text())
    edit(document)
    (line / "run.json").write_text(json.dumps(document))


# -- stop -----------------------------------------------------------------------------------------


def test_stop_on_a_line_not_running_says_so_and_the_next_start_trains(
    line: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["stop", str(line)]) == 2
    error = capsys.readouterr().err
    assert error == f"nsconsole: {line}: not running (no supervisor or trainer); nothing to stop, no STOP written\n"
    assert not (line / "STOP").exists()
    # The next start is not stopped at once by a request nobody served.
    assert Trainer(line, stop_at=3, echo=None).run() == 0
    assert [row["update"] for row in rows(line)] == [1, 2, 3]


def test_stop_reaches_a_line_whose_supervisor_or_trainer_runs(
    line: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A supervisor registered for the line (this test's process stands in for it).
    entry = registry.register(line, tmp_path / "supervisor.sock")
    try:
        assert main(["stop", str(line), "--at-cycle-end", "1"]) == 0
    finally:
        registry.unregister(entry)
    assert "stop requested for" in capsys.readouterr().out
    assert json.loads((line / "STOP").read_text())["at_cycle_end"] == 1
    (line / "STOP").unlink()
    # A trainer running without a supervisor: its heartbeat names a live pid.
    beat = {"time": 0, "update": 4, "stage": "training", **this_process_as_trainer()}
    (line / "heartbeat").write_text(json.dumps(beat))
    assert main(["stop", str(line)]) == 0
    assert json.loads((line / "STOP").read_text())["at_cycle_end"] is None
    assert "replaces" not in capsys.readouterr().out  # nothing was pending


def test_a_stop_past_the_data_line_s_last_cycle_is_refused(
    line: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The line finishes at its data's end: a stop at the end of a later cycle would wait in STOP for
    a cycle that never comes (found in a README walk: accepted without a word)."""
    from datalines import open_data_line

    last = open_data_line(Path(json.loads((line / "run.json").read_text())["data"]["line"])).last_cycle()
    assert last is not None
    entry = registry.register(line, tmp_path / "supervisor.sock")
    try:
        assert main(["stop", str(line), "--at-cycle-end", str(last + 1)]) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and f"its data line's last cycle is {last}, where the line finishes" in error
        assert not (line / "STOP").exists()
        assert main(["stop", str(line), "--at-cycle-end", str(last)]) == 0
    finally:
        registry.unregister(entry)
    assert json.loads((line / "STOP").read_text())["at_cycle_end"] == last


def test_a_second_stop_says_which_pending_stop_it_replaces(
    line: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A request replaces a pending one (found in a README walk: a stop at the end of cycle 0
    became one at the end of cycle 5 without a word)."""
    entry = registry.register(line, tmp_path / "supervisor.sock")
    try:
        assert main(["stop", str(line), "--at-cycle-end", "0"]) == 0
        first = json.loads((line / "STOP").read_text())["requested"]
        capsys.readouterr()
        assert main(["stop", str(line)]) == 0
    finally:
        registry.unregister(entry)
    said = capsys.readouterr().out
    assert said.startswith(f"stop requested for {line} at the next update (")
    assert said.endswith(f"; it replaces the stop at the end of cycle 0 requested {first}\n")
    assert json.loads((line / "STOP").read_text())["at_cycle_end"] is None


# -- run ------------------------------------------------------------------------------------------


def test_run_refuses_a_line_that_fails_a_start_check_before_detaching(
    tmp_path: Path, data_template: Path, private_host: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = copy_data_line(data_template, tmp_path)
    shutil.rmtree(data / "val")  # no held-out rows: the trainer refuses such a line at its start
    line = make_line(tmp_path, data)
    assert main(["run", str(line)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1, error
    assert error.startswith(f"nsconsole: {line}: not started, a start check fails: ")
    assert f"no held-out rows of length {SEQ_LEN}" in error
    assert error.endswith(f"(`nsconsole check {line}` lists every check)\n")
    # Nothing was started: no supervisor registered, no supervisor output.
    assert registry.find_supervisor(line) is None
    assert list(registry.runtime_dir().glob("*.json")) == []
    assert not (line / "supervisor.out").exists()


def test_runs_start_checks_leave_the_checkpoints_to_the_trainer(
    line: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # An interrupted checkpoint write: `check` reports it, the trainer's start discards it.
    (line / "checkpoints" / "u00000005.partial").mkdir()
    assert main(["check", str(line)]) == 1
    assert "an interrupted write (discarded at the next start)" in capsys.readouterr().out
    refuse_a_failing_start(line)  # not refused
    assert Trainer(line, stop_at=1, echo=None).run() == 0


# -- new ------------------------------------------------------------------------------------------


def test_new_leaves_the_schedule_open_until_the_first_start(
    tmp_path: Path, data_template: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = copy_data_line(data_template, tmp_path)
    line = tmp_path / "line"
    arguments = ["new", str(line), "--model", "transformer-tiny", "--data", str(data),
                 "--seq-len", str(SEQ_LEN), "--tokens-per-update", str(TOKENS_PER_UPDATE)]  # fmt: skip
    assert main(arguments) == 0
    assert sorted(path.name for path in line.iterdir()) == ["checkpoints", "run.json"]

    # Before the first start the user rewrites the schedule and a seed (lifelong keys).
    def first_settings(document: dict[str, Any]) -> None:
        document.update(device="cpu", print_every=1)
        document["guards"]["min_free_disk_gb"] = 0.01
        document["lr"]["pieces"] = [{"kind": "warmup", "until": 512, "to": 1.0}, {"kind": "constant"}]
        document["seeds"]["data"] = 1

    edit_run_json(line, first_settings)
    assert main(["check", str(line)]) == 0, capsys.readouterr().out
    assert "ok: lifelong keys: no accepted_run.json yet" in capsys.readouterr().out

    # The first start accepts run.json as it is then: from now on the schedule may only grow.
    assert main(["run", str(line), "--no-supervisor", "--stop-at", "1"]) == 0
    assert RunConfig.load(line / "accepted_run.json") == RunConfig.load(line / "run.json")
    capsys.readouterr()
    edit_run_json(line, lambda document: document["lr"]["pieces"][0].update(until=256))
    assert main(["check", str(line)]) == 1
    assert "FAIL: run.json: lr.pieces piece 0 changed" in capsys.readouterr().out


def test_check_refuses_a_rows_jsonl_the_trainer_would_refuse(line: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert Trainer(line, stop_at=6, echo=None).run() == 0
    assert main(["check", str(line)]) == 0
    assert "ok: rows.jsonl: holds the 6 rows u00000006 counts" in capsys.readouterr().out
    rows_jsonl = line / "rows.jsonl"
    rows_jsonl.write_bytes(rows_jsonl.read_bytes()[:-30])  # truncated (a lost tail, an edit)
    assert main(["check", str(line)]) == 1
    [failure] = [text for text in capsys.readouterr().out.splitlines() if not text.startswith("ok: ")]
    assert failure.startswith(f"FAIL: rows.jsonl: {rows_jsonl}: ") and "the checkpoint counts 6 rows" in failure
    # The remedy: the newest earlier checkpoint whose rows are all there.
    remedy = f"`nsconsole rollback {line} --to 5` goes back to u00000005, the newest checkpoint whose rows it holds"
    assert remedy in failure
    with pytest.raises(LineError, match="the checkpoint counts 6 rows") as refused:  # what the start refuses
        Trainer(line, stop_at=8, echo=None).run()
    assert remedy in str(refused.value)
    assert main(["rollback", str(line), "--to", "5"]) == 0  # as it says: the line trains on from there
    assert Trainer(line, stop_at=8, echo=None).run() == 0
