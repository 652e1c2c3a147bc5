"""The demo line can branch at its cycle ends (issue 20 item 3: its cosine decay refused a fork at
either of them, 32 minutes after the branch was queued). The demo's run.json is made as `nsconsole
--run` makes it (the data line's BPE trained on the spot: some seconds), never trained."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config.run import RunConfig
from engine.ops.branch import BranchRequest, check_branch_request
from engine.ops.demo import DemoPaths, ensure_demo_line
from engine.training.schedule import learning_rate

pytestmark = pytest.mark.slow


def test_a_branch_of_the_demo_at_the_end_of_cycle_0_or_1_passes_the_request_checks(tmp_path: Path) -> None:
    paths = DemoPaths(data=tmp_path / "demo-data", line=tmp_path / "demo")
    line = ensure_demo_line(paths, echo=lambda _message: None)
    config = RunConfig.load(line / "run.json")
    for cycle in (0, 1):
        # The demo's data line serves as the branch's too: its tokenizer, rows of 256 and 512 tokens.
        check_branch_request(BranchRequest(tmp_path / f"decay{cycle}", line, cycle, "decay:2e5", paths.data))
        fork_tokens = (cycle + 1) * 1_000_000
        # Inside the trunk's linear decay: still decaying, so the branch has a rate to decay from.
        assert config.lr.peak > learning_rate(config, fork_tokens) > 0.1 * config.lr.peak
