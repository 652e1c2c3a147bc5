"""`nsconsole resume` of a line whose supervisor, started by an older nsconsole, was lost (a reboot
after `pip install -U`; found walking the upgrade): that supervisor.json records no --engine or
--stop-at, and a line run with `--engine eager --stop-at 400` was resumed with `--engine auto` and
no --stop-at without a word. It is still resumed (a reboot should not leave lines idle), and the
resume says what it cannot know and what to do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.lines import make_data_line, make_line
from test_resume_lost import dead_pid

from engine.supervisor.lost import lost_line
from nsconsole.cli import main

pytestmark = pytest.mark.usefixtures("private_host")  # conftest: an empty host.json, a private runtime dir


def older_supervisor_json(pid: int) -> dict[str, object]:
    """supervisor.json as a supervisor of c997b03 (a day before `engine` and `stop_at` were recorded)
    left it when it was killed while its trainer trained (taken from the walkthrough's line)."""
    return {
        "pid": pid, "started": 1796613476.7, "boot_start": 22652.5, "state": "training", "trainer_pid": pid,
        "launches": 2, "trainer_launched": 1796613489.8, "crashes": 2, "failures_in_a_row": 1,
        "crashes_beside_others": 0, "gpu_index": None, "gpu_uuid": None, "trainer_children": [], "gpu_indices": [],
        "gpu_candidates": None, "gpu_holders": [], "last_exit": None, "last_event": None, "requests": [],
        "queued_forks": [],
    }  # fmt: skip


def test_a_line_lost_by_an_older_supervisor_is_resumed_saying_what_it_cannot_know(
    tmp_path: Path, private_host: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    work_root = tmp_path / "lines"
    private_host.write_text(json.dumps({"work_root": str(work_root)}))
    line = make_line(work_root, make_data_line(tmp_path / "data_root", files=1))
    lost = dead_pid()
    (line / "supervisor.json").write_text(json.dumps(older_supervisor_json(lost)))
    found = lost_line(line)
    assert found is not None and not found.settings_recorded
    assert (found.engine, found.stop_at) == ("auto", None)

    assert main(["resume", "--dry-run"]) == 0
    assert capsys.readouterr().out == (
        f"would resume {line} (it was training when its supervisor (pid {lost}) was lost; {line}/supervisor.json, "
        "written by an older nsconsole, does not record the --engine and --stop-at its supervisor ran it with: "
        f"it runs with --engine auto and no --stop-at (`nsconsole stop {line}`, then `nsconsole run {line} "
        "--stop-at N`, for one it had))\n"
    )

    # This nsconsole's record says it all: nothing more is said.
    (line / "supervisor.json").write_text(json.dumps({**older_supervisor_json(lost), "engine": "auto", "stop_at": None}))
    found = lost_line(line)
    assert found is not None and found.settings_recorded
    assert main(["resume", "--dry-run"]) == 0
    assert capsys.readouterr().out == f"would resume {line} (it was training when its supervisor (pid {lost}) was lost)\n"
