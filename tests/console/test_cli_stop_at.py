"""`nsconsole run LINE --stop-at N` with N at or below the line's update (its latest checkpoint's)
is refused in one line before anything starts, in every form: it used to be accepted, and the
line then ended as `finished` at once (found in a fault walkthrough)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.errors import LineError
from nsconsole.cli import main
from nsconsole.commands.run import refuse_a_past_stop_at

pytestmark = pytest.mark.usefixtures("private_host")  # conftest: no supervisor of the user's is seen

FORMS = {"background": [], "foreground": ["--foreground"], "no supervisor": ["--no-supervisor"]}


@pytest.fixture
def line(tmp_path: Path) -> Path:
    """A line whose `latest` names update 14 (all the refusal reads; nothing else is needed to refuse)."""
    root = tmp_path / "line"
    (root / "checkpoints").mkdir(parents=True)
    (root / "run.json").write_text(json.dumps({"model": {"preset": "transformer-tiny"}, "data": {"line": "d"}}))
    (root / "checkpoints" / "latest").write_text("u00000014\n")
    return root


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("stop_at", [5, 14])
def test_a_stop_at_the_line_has_reached_is_refused_before_anything_starts(
    line: Path, form: str, stop_at: int, capsys: pytest.CaptureFixture[str]
) -> None:
    before = sorted(path.name for path in line.rglob("*"))
    assert main(["run", str(line), "--stop-at", str(stop_at), *FORMS[form]]) == 2
    assert capsys.readouterr().err == (
        f"nsconsole: --stop-at {stop_at}: the line is at update 14 already (its latest checkpoint); "
        "give a later update\n"
    )
    assert sorted(path.name for path in line.rglob("*")) == before  # no supervisor.json, run.log, lock


def test_a_line_without_a_checkpoint_is_at_update_0(line: Path) -> None:
    (line / "checkpoints" / "latest").unlink()
    with pytest.raises(LineError, match=r"^--stop-at 0: the line is at update 0 already \(it has no checkpoint yet\)"):
        refuse_a_past_stop_at(line, 0)
    refuse_a_past_stop_at(line, 1)


def test_a_later_update_passes(line: Path) -> None:
    refuse_a_past_stop_at(line, 15)
