"""The README's rollback steps on a finished line, from the command line: `nsconsole run`,
`nsconsole rollback LINE --to U`, `nsconsole run` again, with no `nsconsole data rebuild` between.

A line that ends leaves its consumed cycles' manifests only (its supervisor deletes their shards);
the rollback reopens the cycles after U. `run`'s start check refused such a line ("shard missing
(cycle 1); no update can train on it until it is rebuilt") before the supervisor's data preparer,
which rebuilds them byte for byte, could start; now the trainer waits for them, and retrains the
rows it trained before, bit for bit on the CPU. A start without a supervisor (no preparer) is
still refused, with the rebuild command.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from helpers.lines import make_data_line, make_line, rows_without_wall_clock
from helpers.supervise import kill_line_processes

from datalines.dataline import CONSUMED_MARK
from datalines.manifest import MANIFEST_NAME
from engine.checkpoints.format import list_checkpoints
from engine.supervisor import registry
from engine.supervisor.reads import read_json, running_supervisor_pid
from nsconsole.cli import main
from nsconsole.history import read_at_rest
from nsconsole.state import LineView
from nsconsole.widgets.curves import CurveSettings, build_frame

pytestmark = pytest.mark.usefixtures("private_host")  # conftest: an empty host.json, a private runtime dir


def run_to_its_end(line: Path, timeout: float = 600) -> None:
    """`nsconsole run LINE` (its supervisor in the background), then wait for the line to finish."""
    assert main(["run", str(line)]) == 0
    deadline = time.monotonic() + timeout
    # Until the supervisor has exited, not only left the registry: its process holds the line's lock
    # until then, and a rollback in that window is refused ("a supervisor already runs this line").
    while registry.find_supervisor(line) is not None or running_supervisor_pid(read_json(line / "supervisor.json") or {}):
        assert time.monotonic() < deadline, f"{line} did not finish; run.log:\n{(line / 'run.log').read_text()}"
        time.sleep(0.2)
    assert json.loads((line / "supervisor.json").read_text())["state"] == "finished", (line / "run.log").read_text()


def cycle_end(line: Path, cycle: int) -> int:
    """The update of the line's kept checkpoint at the end of `cycle`."""
    for directory in list_checkpoints(line / "checkpoints"):
        if json.loads((directory / "state.json").read_text()).get("kept") == f"cycle-end {cycle}":
            return int(directory.name[1:])
    raise AssertionError(f"no kept checkpoint at the end of cycle {cycle}")


@pytest.mark.slow
def test_a_finished_line_rolled_back_trains_to_its_end_again_with_the_same_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = make_data_line(tmp_path / "data_root", files=2)  # cycles 0 and 1, both prepared
    line = make_line(tmp_path, data)
    try:
        run_to_its_end(line)
        trained = rows_without_wall_clock(line / "rows.jsonl")
        assert sorted(path.name for path in (data / "cycles" / "c0001").iterdir()) == [CONSUMED_MARK, MANIFEST_NAME]

        to = cycle_end(line, 0)
        before = time.time()
        assert main(["rollback", str(line), "--to", str(to)]) == 0
        after = time.time()
        # Its files say so, as a supervisor's rollback leaves them: not finished, at update `to`.
        assert json.loads((line / "supervisor.json").read_text())["state"] == "stopped"
        assert json.loads((line / "heartbeat").read_text())["update"] == to
        assert f"rollback: done from the command line; the line continues from update {to}" in (
            line / "run.log").read_text()
        assert [path.name for path in (data / "cycles" / "c0001").iterdir()] == [MANIFEST_NAME]  # reopened
        capsys.readouterr()
        # Without a supervisor nobody rebuilds the cycle: refused, with the command that does.
        assert main(["run", str(line), "--no-supervisor"]) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and "shard missing (cycle 1)" in error
        assert f"(`nsconsole data rebuild --work {data} --cycle 1`; a running line's preparer does it)" in error
        assert main(["check", str(line)]) == 0
        assert (
            "ok: current data cycle: 1's shards are missing (text.tokens, text.docs); the line's data preparer "
            "rebuilds them from the manifest, byte for byte, and the trainer waits for them"
        ) in capsys.readouterr().out

        run_to_its_end(line)  # was: "not started, a start check fails: ... shard missing (cycle 1)"
    finally:
        kill_line_processes(tmp_path)
    retrained = rows_without_wall_clock(line / "rows.jsonl")
    assert [row["update"] for row in retrained] == list(range(1, len(trained) + 1))
    assert retrained == trained  # losses included: the CPU retrains bit for bit

    # The console, reading the line at rest, tells of the rollback made from the command line (no
    # supervisor saw it) and marks it ↶ on the curves at the first row trained after it.
    resting = read_at_rest(line)
    assert resting is not None
    (when,) = resting.supervisor["rollbacks"]
    assert int(before) <= when <= after
    view = LineView("line", line)
    view.apply_rest(resting.supervisor, resting.heartbeat, resting.rows, time.time())
    assert [event.kind for event in view.events if event.kind == "rolled_back"] == ["rolled_back"]
    assert view.take_alerts() == []
    frame = build_frame(view, CurveSettings(x_axis="update"), None, {})
    assert [x for x, kind in frame.markers if kind == "rollback"] == [to + 1]
