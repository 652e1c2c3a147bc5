"""branches.json: one record per branch directory, and only branches that still exist are named.

Found in a walkthrough of the branch workflow: a branch deleted by hand and made again into the
same directory left its old record in the trunk's branches.json, so a rollback named the directory
once per attempt (`runs/b3 (forked at update 24)` five times over) and the console, which takes the
first record of a branch, drew the re-made branch over the trunk's rows up to the old fork.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from engine.layout import LineLayout
from engine.ops.branch import BranchRequest
from engine.ops.branch_records import branches_forked_after, read_branches, record_branch
from nsconsole.widgets.line_header import read_fork


def make_branch(trunk: LineLayout, branch: Path, at_cycle: int, update: int, tokens: int) -> None:
    """A branch directory with a run.json, recorded on the trunk as `branch_line` records it."""
    branch.mkdir(parents=True, exist_ok=True)
    (branch / "run.json").write_text("{}")
    request = BranchRequest(branch, trunk.root, at_cycle, "decay:1024", branch.with_name(f"{branch.name}-data"))
    record_branch(trunk, branch, request, update, tokens)


def test_a_branch_made_again_into_its_directory_replaces_its_record(tmp_path: Path) -> None:
    trunk = LineLayout(tmp_path / "trunk")
    trunk.root.mkdir()
    make_branch(trunk, tmp_path / "b1", 1, 24, 5968)
    make_branch(trunk, tmp_path / "b3", 0, 12, 2992)
    (tmp_path / "b3" / "run.json").unlink()  # deleted by hand, then made again from a later cycle end
    make_branch(trunk, tmp_path / "b3", 1, 24, 5968)

    records = [(entry["line"], entry["at_update"]) for entry in read_branches(trunk)]
    assert records == [(str(tmp_path / "b1"), 24), (str(tmp_path / "b3"), 24)]
    fork = read_fork(str(trunk.root), str(tmp_path / "b3"))  # what the console draws the branch over
    assert fork is not None and (fork.update, fork.tokens) == (24, 5968.0)
    assert branches_forked_after(trunk, 12) == [
        f"{tmp_path / 'b1'} (forked at update 24)",
        f"{tmp_path / 'b3'} (forked at update 24)",
    ]


def test_a_rollback_names_no_branch_that_was_deleted(tmp_path: Path) -> None:
    trunk = LineLayout(tmp_path / "trunk")
    trunk.root.mkdir()
    make_branch(trunk, tmp_path / "b1", 1, 24, 5968)
    make_branch(trunk, tmp_path / "gone", 1, 24, 5968)
    for path in (tmp_path / "gone").iterdir():
        path.unlink()
    (tmp_path / "gone").rmdir()

    assert branches_forked_after(trunk, 12) == [f"{tmp_path / 'b1'} (forked at update 24)"]


RECORDER = """
import sys
from pathlib import Path
from engine.layout import LineLayout
from engine.ops.branch import BranchRequest
from engine.ops.branch_records import record_branch
trunk, prefix = LineLayout(sys.argv[1]), sys.argv[2]
go = trunk.root / "go"
while not go.exists():  # both start together
    pass
for index in range(100):
    branch = trunk.root.parent / f"{prefix}{index}"
    record_branch(trunk, branch, BranchRequest(branch, trunk.root, 0, "decay:1024", branch), 12, 2992)
"""


def test_branches_recorded_at_once_by_two_processes_are_all_kept(tmp_path: Path) -> None:
    # A CLI branch and a supervisor's queued fork may record at the same moment: each reads
    # branches.json, adds its record and replaces the file, so without a lock one record is lost.
    trunk = LineLayout(tmp_path / "trunk")
    trunk.root.mkdir()
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    writers = [subprocess.Popen([sys.executable, "-c", RECORDER, str(trunk.root), prefix], env=environment)
               for prefix in ("a", "b")]  # fmt: skip
    time.sleep(1.0)  # both have started (a start takes under a second here); a late one only weakens the test
    (trunk.root / "go").touch()
    assert [writer.wait(timeout=120) for writer in writers] == [0, 0]
    assert len(read_branches(trunk)) == 200
