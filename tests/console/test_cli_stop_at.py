"""`nsconsole run LINE --stop-at N` with N at or below the line's update (its latest checkpoint's)
is refused in one line before anything starts, in every form: it used to be accepted, and the
line then ended as `finished` at once (found in a fault walkthrough). `nsconsole --run LINE`, the
headless form, takes --stop-at and --engine as `run` does (it ended in argparse's `invalid choice`,
found in a CLI walkthrough), and a `--run` option nothing would honour is refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine.errors import LineError
from engine.ops import line_end
from engine.supervisor import supervisor
from nsconsole.cli import main
from nsconsole.commands import run
from nsconsole.commands.run import refuse_a_past_stop_at

pytestmark = pytest.mark.usefixtures("private_host")  # conftest: no supervisor of the user's is seen

LINE = object()
"""Stands for the line's path in FORMS."""
FORMS = {
    "background": ["run", LINE],
    "foreground": ["run", LINE, "--foreground"],
    "no supervisor": ["run", LINE, "--no-supervisor"],
    "headless": ["--run", LINE],
}


@pytest.fixture
def line(tmp_path: Path) -> Path:
    """A line whose `latest` names update 14, a checkpoint with its state.json (all the refusal
    reads; nothing else is needed to refuse)."""
    root = tmp_path / "line"
    (root / "checkpoints" / "u00000014").mkdir(parents=True)
    (root / "run.json").write_text(json.dumps({"model": {"preset": "transformer-tiny"}, "data": {"line": "d"}}))
    (root / "checkpoints" / "u00000014" / "state.json").write_text(json.dumps({"update": 14}))
    (root / "checkpoints" / "latest").write_text("u00000014\n")
    return root


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("stop_at", [5, 14])
def test_a_stop_at_the_line_has_reached_is_refused_before_anything_starts(
    line: Path, form: str, stop_at: int, capsys: pytest.CaptureFixture[str]
) -> None:
    before = sorted(path.name for path in line.rglob("*"))
    command = [str(line) if word is LINE else word for word in FORMS[form]]
    assert main([*command, "--stop-at", str(stop_at)]) == 2
    assert capsys.readouterr().err == (
        f"nsconsole: --stop-at {stop_at}: the line is at update 14 already (its latest checkpoint); "
        "give a later update\n"
    )
    assert sorted(path.name for path in line.rglob("*")) == before  # no supervisor.json, run.log, lock


def test_a_line_without_a_checkpoint_is_at_update_0(line: Path) -> None:
    shutil.rmtree(line / "checkpoints")
    with pytest.raises(LineError, match=r"^--stop-at 0: the line is at update 0 already \(it has no checkpoint yet\)"):
        refuse_a_past_stop_at(line, 0)
    refuse_a_past_stop_at(line, 1)


def test_a_later_update_passes(line: Path) -> None:
    refuse_a_past_stop_at(line, 15)


@pytest.mark.parametrize("latest", ["u00000099\n", "hello", None])
def test_a_latest_naming_no_checkpoint_counts_the_one_a_start_resumes_from(
    line: Path, latest: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    # `latest` damaged (naming a checkpoint that is gone, or garbage, or removed): the trainer
    # resumes from u00000014, so --stop-at 16 is valid; it was refused as "at update 99 already".
    if latest is None:
        (line / "checkpoints" / "latest").unlink()
    else:
        (line / "checkpoints" / "latest").write_text(latest)
    refuse_a_past_stop_at(line, 16)
    assert main(["run", str(line), "--no-supervisor", "--stop-at", "14"]) == 2
    assert capsys.readouterr().err == (
        "nsconsole: --stop-at 14: the line is at update 14 already (u00000014, the checkpoint a start "
        "resumes from); give a later update\n"
    )


def test_run_headless_takes_the_stop_at_and_the_engine_as_run_does(
    line: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[tuple[Path, dict]] = []
    # The line has no data line: the start checks that read it pass here; the --stop-at check runs.
    monkeypatch.setattr(line_end, "refuse_a_finished_line", lambda path, **names: None)
    monkeypatch.setattr(run, "refuse_a_failing_start", lambda path: None)
    monkeypatch.setattr(supervisor, "run_line", lambda path, **options: started.append((path, options)) or 0)
    assert main(["--run", str(line), "--stop-at", "43", "--engine", "eager"]) == 0
    assert started == [(line, {"foreground": False, "stop_at": 43, "engine": "eager"})]


@pytest.mark.parametrize(
    ("arguments", "error"),
    [
        (["--run", "{line}", "--foreground"],
         "--foreground: --run starts the line detached; to keep it in this terminal: nsconsole run {line} --foreground"),
        (["--run", "{line}", "--no-supervisor"],
         "--no-supervisor: --run starts the line detached; to keep it in this terminal: "
         "nsconsole run {line} --no-supervisor"),
        (["--stop-at", "43", "run", "{line}"],
         "--stop-at 43: an option of --run alone (a command takes its options after its name); "
         "write `nsconsole --run {line} --stop-at 43` or `nsconsole run {line} --stop-at 43`"),
        (["--engine", "eager"],
         "--engine eager: an option of --run alone (a command takes its options after its name); "
         "write `nsconsole --run LINE --engine eager` or `nsconsole run LINE --engine eager`"),
    ],
    ids=["--run --foreground", "--run --no-supervisor", "before a command", "with the console"],
)  # fmt: skip
def test_a_run_option_nothing_would_honour_is_refused_in_one_line(
    line: Path, arguments: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([word.format(line=line) for word in arguments]) == 2
    assert capsys.readouterr().err == f"nsconsole: {error.format(line=line)}\n"
    assert not (line / "supervisor.json").exists()
