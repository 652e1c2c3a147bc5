"""A line that stops or ends leaves no consumed cycle's shards on disk (spec: "Consumed data
cycles are deleted by the preparer, also when a line stops"), and what it deleted is rebuilt
exactly when a rollback reopens it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.lines import copy_data_line, data_template_fixture, make_line
from helpers.supervise import RUNNER

from datalines import open_data_line
from datalines.dataline import CONSUMED_MARK
from datalines.manifest import MANIFEST_NAME
from datalines.preparer import prepare_cycle
from engine.supervisor import registry
from nsconsole.client import SupervisorClient

pytestmark = pytest.mark.usefixtures("private_host")  # conftest: an empty host.json, a private runtime dir

data_template = data_template_fixture()  # every cycle (0..3) prepared

IDLE_PREPARER = [sys.executable, "-c", "import time; time.sleep(600)"]
"""A preparer that never deletes anything: only the supervisor's stop path can clean up."""


def _supervise(root: Path, line: Path, preparer_command: list[str] | None) -> subprocess.Popen[bytes]:
    (root / "runner.py").write_text(RUNNER)
    settings = {"poll_seconds": 0.1, "relaunch_delay_seconds": 0.05, "preparer_command": preparer_command}
    return subprocess.Popen([sys.executable, str(root / "runner.py"), str(line), json.dumps(settings)])


def _cycle_files(data: Path) -> dict[int, set[str]]:
    return {int(path.name[1:]): {f.name for f in path.iterdir()} for path in sorted((data / "cycles").glob("c*"))}


@pytest.mark.slow
def test_a_stopped_or_finished_line_leaves_no_consumed_shards(tmp_path: Path, data_template: Path) -> None:
    data = copy_data_line(data_template, tmp_path)
    line = make_line(tmp_path, data)
    supervisor = _supervise(tmp_path, line, IDLE_PREPARER)
    try:
        deadline = time.monotonic() + 60
        while registry.find_supervisor(line) is None:
            assert time.monotonic() < deadline and supervisor.poll() is None, "the supervisor did not start"
            time.sleep(0.1)
        with SupervisorClient(line / "supervisor.sock", timeout=60) as client:
            client.call("stop", request_id="stop-after-cycle-1", at_cycle_end=1)
        assert supervisor.wait(timeout=300) == 0
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
    assert json.loads((line / "supervisor.json").read_text())["state"] == "stopped"
    files = _cycle_files(data)
    consumed = {index for index, names in files.items() if CONSUMED_MARK in names}
    assert {0, 1} <= consumed and 3 not in consumed
    for index, names in files.items():
        # Consumed: the manifest and the mark only. The cycles still to train keep their shards.
        assert (names == {MANIFEST_NAME, CONSUMED_MARK}) == (index in consumed), (index, names)

    # Resumed with the real preparer, the line trains to its data end: a finished line keeps manifests only.
    resumed = _supervise(tmp_path, line, None)
    try:
        assert resumed.wait(timeout=300) == 0
    finally:
        if resumed.poll() is None:
            resumed.kill()
    assert json.loads((line / "supervisor.json").read_text())["state"] == "finished"
    assert _cycle_files(data) == {index: {MANIFEST_NAME, CONSUMED_MARK} for index in range(4)}

    # A rollback reopens a cycle: its shards are rebuilt from the manifest, byte for byte.
    data_line = open_data_line(data)
    assert data_line.reopen(0)
    prepare_cycle(data_line, 0)
    assert data_line.cycle_ready(0)
    template_shards = {path.name: path.read_bytes() for path in (data_template / "cycles" / "c0000").iterdir()}
    assert {path.name: path.read_bytes() for path in (data / "cycles" / "c0000").iterdir()} == template_shards
