"""branches.json: one record per branch directory, and only branches that still exist are named.

Found in a walkthrough of the branch workflow: a branch deleted by hand and made again into the
same directory left its old record in the trunk's branches.json, so a rollback named the directory
once per attempt (`runs/b3 (forked at update 24)` five times over) and the console, which takes the
first record of a branch, drew the re-made branch over the trunk's rows up to the old fork.
"""

from __future__ import annotations

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
