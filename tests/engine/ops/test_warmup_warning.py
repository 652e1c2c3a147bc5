"""A line that would end inside its learning-rate warmup (the default 2e8 tokens on a small data line
or a short plan) is warned of by `nsconsole new` and `nsconsole check`, in one line naming the
warmup's tokens, what ends the line first and the run.json key to change; nothing warned of it
(found in a CLI walkthrough). A warning, not a refusal: the line is created and its checks pass."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.lines import copy_data_line, data_template_fixture, make_line

from datalines import open_data_line
from engine.config.run import DEFAULT_WARMUP_TOKENS
from nsconsole.cli import main

data_template = data_template_fixture()

FIX = "the line would end still warming up, never at its peak rate; set lr.pieces[0].until in run.json to a fraction of that"


def data_tokens(data: Path) -> int:
    """The tokens the data line holds, as the warning counts them: its planned cycles, nominally."""
    line = open_data_line(data)
    return line.cycle_start_tokens(line.last_cycle()) + line.cycle_tokens


def test_new_warns_of_a_warmup_longer_than_the_data_line_and_creates_the_line(
    tmp_path: Path, data_template: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = copy_data_line(data_template, tmp_path)
    line = tmp_path / "line"
    assert main(["new", str(line), "--model", "transformer-tiny", "--data", str(data), "--seq-len", "32"]) == 0
    warnings = [text for text in capsys.readouterr().out.splitlines() if text.startswith("warning: lr warmup: ")]
    assert warnings == [
        f"warning: lr warmup: lr.pieces[0].until is {DEFAULT_WARMUP_TOKENS:,.0f} tokens, but its data line "
        f"{data} holds about {data_tokens(data):,}: {FIX}"
    ]
    assert (line / "run.json").is_file()


def test_check_warns_until_the_warmup_fits_the_plan_and_the_data_line(
    tmp_path: Path, data_template: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = copy_data_line(data_template, tmp_path)
    plan = [{"name": "trunk", "seq_len": 32, "tokens": 2048}]
    pieces = [{"kind": "warmup", "until": 1e5}, {"kind": "constant"}]
    line = make_line(tmp_path, data, plan=plan, **{"lr.pieces": pieces})
    (line / "accepted_run.json").unlink()  # as `new` leaves it: never started, run.json still free to change

    assert main(["check", str(line)]) == 0  # a warning, not a failure
    warmup = [text for text in capsys.readouterr().out.splitlines() if "lr warmup: " in text]
    assert warmup == [
        f"warn: lr warmup: lr.pieces[0].until is 100,000 tokens, but the plan trains 2,048 and its data line "
        f"{data} holds about {data_tokens(data):,}: {FIX}"
    ]

    document = json.loads((line / "run.json").read_text())
    document["lr"]["pieces"][0]["until"] = 512
    (line / "run.json").write_text(json.dumps(document))
    assert main(["check", str(line)]) == 0
    warmup = [text for text in capsys.readouterr().out.splitlines() if "lr warmup: " in text]
    assert warmup == ["ok: lr warmup: over before the line ends (at about 2,048 tokens)"]


def test_a_started_line_is_not_warned_of_a_schedule_it_can_no_longer_change(
    tmp_path: Path, data_template: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pieces = [{"kind": "warmup", "until": 1e9}, {"kind": "constant"}]
    line = make_line(tmp_path, copy_data_line(data_template, tmp_path), **{"lr.pieces": pieces})
    assert (line / "accepted_run.json").is_file()  # its first start accepted it: lr.pieces only grow now
    assert main(["check", str(line)]) == 0
    assert "lr warmup: " not in capsys.readouterr().out
