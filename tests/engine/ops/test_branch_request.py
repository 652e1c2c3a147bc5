"""A branch of a cycle still to come is checked in full when it is asked for (issue 20 item 3: the
demo's queued branch failed 32 minutes later, "the fork falls inside a cosine decay piece").

`nsconsole branch` refuses such a branch anyway (the cycle has not ended), but first says what
would stop its fork; the supervisor's queue runs the same checks (tests/engine/supervisor/
test_supervise_forks.py). Fresh lines, no training: the checks read files only.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers.lines import copy_data_line, data_template_fixture, make_line

from datalines import open_data_line
from engine.config.run import RunConfig
from engine.errors import LineError
from engine.layout import LineLayout
from engine.ops.branch import BranchRequest, check_branch_request
from engine.ops.fork_point import expected_fork_position
from engine.training.trainer import Trainer
from nsconsole.cli import main as cli_main

data_template = data_template_fixture(prepare=1)
"""Cycles of 5,000 tokens; the checks only read it, so every test shares it."""

COSINE = [{"kind": "warmup", "until": 512, "to": 1.0},
          {"kind": "decay", "until": 1e6, "to": 0.1, "shape": "cosine"}, {"kind": "constant", "to": 0.1}]  # fmt: skip
LINEAR = [{**piece, "shape": "linear"} for piece in COSINE]


@pytest.fixture(autouse=True)
def private_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "host.json").write_text("{}")
    monkeypatch.setenv("NSCONSOLE_HOST", str(tmp_path / "host.json"))


def branch(tmp_path: Path, trunk: Path, data: Path, at_cycle: int = 1, plan: str = "decay:1e3") -> int:
    return cli_main(["branch", str(tmp_path / "b"), "--from", str(trunk), "--at-cycle", str(at_cycle),
                     "--plan", plan, "--data", str(data)])  # fmt: skip


def test_the_cli_names_a_fork_inside_a_cosine_decay_before_the_cycle_has_ended(
    tmp_path: Path, data_template: Path, capsys: pytest.CaptureFixture
) -> None:
    trunk = make_line(tmp_path / "cosine", data_template, **{"lr.pieces": COSINE})
    assert branch(tmp_path, trunk, data_template) == 2
    error = capsys.readouterr().err
    assert (
        f"nsconsole: {trunk / 'run.json'}: cycle 1 is expected to end at about 10,000 tokens trained; the fork "
        "at 10,000 tokens falls inside a cosine decay piece (512 to 1,000,000 tokens)"
    ) in error
    # The same fork point inside a linear piece passes: only the cycle's end is missing.
    trunk = make_line(tmp_path / "linear", data_template, **{"lr.pieces": LINEAR})
    assert branch(tmp_path, trunk, data_template) == 2
    error = capsys.readouterr().err
    assert "has no checkpoint yet; cycle 1 has not ended; branch once it has, or ask the line's supervisor" in error
    assert not (tmp_path / "b").exists()


def test_a_branch_on_a_data_line_another_line_trains_on_is_refused_when_asked_for(
    tmp_path: Path, data_template: Path, capsys: pytest.CaptureFixture
) -> None:
    # The trunk's own data line: the branch's first start would be refused, so is the request.
    data = copy_data_line(data_template, tmp_path)
    trunk = make_line(tmp_path / "trunk", data, **{"lr.pieces": LINEAR})
    assert Trainer(trunk, stop_at=1, echo=None).run() == 0  # its start takes the data line
    assert branch(tmp_path, trunk, data) == 2
    error = capsys.readouterr().err
    assert error == (
        f"nsconsole: {data}: trained by {trunk}, the first line that started on it; a data line is trained by "
        f"one line, so the branch {tmp_path / 'b'} cannot train on it; make an identical data line with "
        f"`nsconsole data init --work DIR --like {data}` and train on DIR\n"
    )
    assert not (tmp_path / "b").exists()


def test_the_cli_names_a_branch_data_line_without_held_out_rows_before_the_cycle_has_ended(
    tmp_path: Path, data_template: Path, capsys: pytest.CaptureFixture
) -> None:
    trunk = make_line(tmp_path, data_template)
    without_rows = tmp_path / "without_rows"
    shutil.copytree(data_template, without_rows)
    shutil.rmtree(without_rows / "val")
    assert branch(tmp_path, trunk, without_rows) == 2
    assert (
        f"nsconsole: {without_rows}: no held-out rows of length 32 for this line's validation; build them with "
        f"`nsconsole data val --work {without_rows} --seq-len 32 --long-seq-len 0`"
    ) in capsys.readouterr().err


def test_a_request_with_faults_of_its_own_is_refused_and_a_sound_one_passes(tmp_path: Path, data_template: Path) -> None:
    trunk = make_line(tmp_path, data_template)
    for refusal, request in (
        ("nowhere: no such data line directory", BranchRequest(tmp_path / "b", trunk, 1, "decay:1e3", tmp_path / "nowhere")),
        ("--plan: 'decay:x': 'x' is not a number", BranchRequest(tmp_path / "b", trunk, 1, "decay:x", data_template)),
        ("--at-cycle must be a cycle index", BranchRequest(tmp_path / "b", trunk, -1, "decay:1e3", data_template)),
    ):  # fmt: skip
        with pytest.raises(LineError, match=refusal):
            check_branch_request(request)
    check_branch_request(BranchRequest(tmp_path / "b", trunk, 1, "decay:1e3", data_template))  # passes
    assert not (tmp_path / "b").exists()


def test_the_fork_point_of_a_later_cycle_end_carries_the_line_on_and_walks_the_plan(
    tmp_path: Path, data_template: Path
) -> None:
    plan = [{"name": "short", "seq_len": 32, "tokens": 7000}, {"name": "rest", "seq_len": 32, "tokens": None}]
    line = make_line(tmp_path, data_template, plan=plan)
    config = RunConfig.load(line / "run.json")
    data = open_data_line(data_template)
    # A branch's count carries its trunk's (50,000 at its start), its data line starts at 0.
    position = {"cycle": 0, "sample": 10, "stage": 0, "stage_tokens": 320, "tokens_trained": 50_320}
    assert expected_fork_position(LineLayout(line), config, data, position, 1) == {
        "tokens_trained": 60_000, "stage": 1, "cycle": 2,
    }  # fmt: skip
    assert expected_fork_position(LineLayout(line), config, data, {}, 0) == {
        "tokens_trained": 5_000, "stage": 0, "cycle": 1,
    }  # fmt: skip


# -- a fork past the trunk's data, a plan past the branch's data: refused when asked (not weeks later) --

whole_data = data_template_fixture()
"""Every cycle prepared: the line's last cycle and each cycle's tokens are known exactly."""

ESTIMATED = "estimated from its files' pinned sizes, calibration and schedule: its last cycle is not planned yet"


def rows_tokens(data: Path, row_len: int) -> int:
    """The tokens a branch can train on a prepared data line: each cycle's sources in whole rows."""
    line = open_data_line(data)
    return sum((tokens - 1) // row_len * row_len for index in range(line.last_cycle() + 1)
               for tokens in (source["tokens"] for source in line.cycle(index).manifest["sources"].values()))  # fmt: skip


def test_a_fork_past_the_end_of_the_trunk_s_data_line_is_refused_when_asked_for(
    tmp_path: Path, data_template: Path, whole_data: Path, capsys: pytest.CaptureFixture
) -> None:
    # Planned to its end: the last cycle is known.
    trunk = make_line(tmp_path / "whole", whole_data)
    assert open_data_line(whole_data).last_cycle() == 3
    assert branch(tmp_path, trunk, whole_data, at_cycle=4) == 2
    assert capsys.readouterr().err == (
        f"nsconsole: {whole_data}: the trunk's data line has 4 cycles (0 to 3), so cycle 4 never ends on it; "
        "the last cycle a branch can fork at is 3\n"
    )
    # One cycle planned: the end is estimated from the pins and calibration (the same 4 cycles).
    trunk = make_line(tmp_path / "estimated", data_template)
    assert open_data_line(data_template).last_cycle() is None
    assert branch(tmp_path, trunk, data_template, at_cycle=7) == 2
    assert capsys.readouterr().err == (
        f"nsconsole: {data_template}: the trunk's data line will have about 4 cycles (0 to 3; {ESTIMATED}), and at "
        "most 5 even with 10% more tokens than estimated, so cycle 7 never ends on it; the last cycle a branch "
        "can fork at is about 3\n"
    )
    # Within the estimate's margin: checked in full, and refused only for the cycle's end to come.
    assert branch(tmp_path, trunk, data_template, at_cycle=4) == 2
    assert "has no checkpoint yet; cycle 4 has not ended" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def test_a_plan_longer_than_the_branch_s_data_is_refused_when_asked_for(
    tmp_path: Path, data_template: Path, whole_data: Path, capsys: pytest.CaptureFixture
) -> None:
    trunk = make_line(tmp_path, data_template)
    held = rows_tokens(whole_data, 32)  # 21,408: about 4 cycles of 5,000
    assert branch(tmp_path, trunk, whole_data, plan="decay:2e4,decay:2e3") == 2  # 20,000 + 2,016
    assert capsys.readouterr().err == (
        f"nsconsole: {whole_data}: the branch's plan trains 22,016 tokens (decay 20,000, decay2 2,016) but its "
        f"data line holds {held:,} tokens to train in rows of 32 in 4 cycles (0 to 3), {22_016 - held:,} too "
        "few; shorten the plan or give the branch a larger data line\n"
    )
    # Not planned to its end: its tokens are estimated (within 1% of the 21,408 its cycles hold).
    assert branch(tmp_path, trunk, data_template, plan="decay:3e4") == 2
    error = capsys.readouterr().err
    assert error.startswith(f"nsconsole: {data_template}: the branch's plan trains 30,016 tokens (decay 30,016) but "
                            "its data line holds about 21,312 tokens to train in rows of 32 in 4 cycles (0 to 3; ")
    # A plan the data holds passes every check: only the cycle's end is missing.
    assert branch(tmp_path, trunk, whole_data, plan=f"decay:{held}") == 2
    assert "cycle 1 has not ended" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def test_a_fork_point_retention_removed_is_refused_naming_what_the_line_keeps(
    tmp_path: Path, data_template: Path
) -> None:
    """`the kept checkpoint of cycle 1's end is missing` said neither why nor where a branch could fork
    instead (found in the disk walkthrough, on a line with `checkpoints.keep_cycle_ends 2`)."""
    import json

    from engine.ops.branch import find_cycle_end

    layout = LineLayout(make_line(tmp_path, data_template, **{"checkpoints.keep_cycle_ends": 2}))
    for update, cycle in ((30, 2), (40, 3), (45, None)):  # retention removed the ends of cycles 0 and 1
        directory = layout.checkpoint(update)
        directory.mkdir(parents=True)
        kept = None if cycle is None else f"cycle-end {cycle}"
        state = {"update": update, "kept": kept, "position": {"cycle": 4}}
        (directory / "state.json").write_text(json.dumps(state))
    (layout.checkpoints / "latest").write_text("u00000045\n")
    with pytest.raises(LineError) as refusal:
        find_cycle_end(layout, 1)
    assert str(refusal.value) == (
        f"{layout.checkpoints}: the kept checkpoint of cycle 1's end is missing; it keeps the ends of cycles 2, 3 "
        "(checkpoints.keep_cycle_ends 2: retention keeps the newest 2)"
    )
